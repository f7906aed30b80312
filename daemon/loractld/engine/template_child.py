"""The process a chat template not of the model's own (a profile's TEMPLATE, a trusted request's
``chat_template``) is rendered in: :mod:`loractld.engine.template_sandbox` starts it and kills it.

It reads one request at a time from stdin and writes one answer to stdout, each a 4-byte
big-endian length and that many bytes of JSON. A request is what transformers'
``apply_chat_template`` hands its ``render_jinja_template`` (the conversation, tools, documents,
the template, the generation-prompt flags and the template's keyword arguments, the tokenizer's
special tokens among them); the answer is ``{"text": ...}`` or ``{"error": KIND, "message": ...}``.
Rendering is transformers' own function (its sandboxed Jinja environment, ``tojson``,
``raise_exception``, ``strftime_now``), so the text is what vLLM's own path would render; the
parent tokenizes it as ``apply_chat_template`` does.

Invariants:
- Its address space is capped (``RLIMIT_AS``: what it holds once started plus ``--memory``):
  a template that builds a huge string or list gets a MemoryError here, never in the daemon.
- A rendered text over ``--max-output`` bytes is refused here, before it is sent.
- Time is bounded by the parent, which kills this process at its deadline or when the request
  it renders for is cancelled; after any failure but a template's own error the parent drops it.
- Only the standard library, jinja2 and transformers' chat template module are imported: no
  torch, no vllm, nothing of the daemon's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import sys


def _read(stream) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    return stream.read(size)


def _write(stream, answer: dict) -> None:
    data = json.dumps(answer).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def template_variables(template: str) -> list[str]:
    """The template's undeclared variables, as vLLM's ``resolve_chat_template_kwargs`` finds
    them: parsed in the environment vLLM parses it in (its options, ``{% generation %}`` and
    loop controls), then Jinja's code generator, which folds constants (``"a" * 400000000`` is
    built here, under the cap, not in the daemon)."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.nodes
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):   # vLLM's AssistantTracker, as far as parsing goes
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    return sorted(jinja2.meta.find_undeclared_variables(env.parse(template)))


def render(request: dict) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[request["conversation"]], tools=request.get("tools"), documents=request.get("documents"),
        chat_template=request["chat_template"], continue_final_message=request.get("continue_final_message") or False,
        add_generation_prompt=bool(request.get("add_generation_prompt")), **(request.get("kwargs") or {}))
    return rendered[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loractld-template-child")
    parser.add_argument("--memory", type=int, required=True, help="bytes of address space past the start")
    parser.add_argument("--max-output", type=int, required=True, help="the rendered text's cap, in bytes")
    args = parser.parse_args(argv)
    try:   # ended with the daemon, even one killed mid-render
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    import jinja2  # noqa: F401 - imported before the cap
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401

    if hasattr(resource, "RLIMIT_AS"):
        limit = _vm_size() + args.memory
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr      # nothing but answers on the pipe
    _write(stdout, {"ready": os.getpid()})
    while True:
        data = _read(stdin)
        if data is None:
            return 0
        try:
            request = json.loads(data)
            if "variables_of" in request:
                _write(stdout, {"variables": template_variables(request["variables_of"])})
                continue
            text = render(request)
        except MemoryError:
            _write(stdout, {"error": "memory", "message": "memory"})
            return 0
        except RecursionError:
            _write(stdout, {"error": "template", "message": "the template recursed too deep"})
            continue
        except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception, a type error...)
            import jinja2

            reason = e
            seen = set()
            while reason is not None and id(reason) not in seen:   # as vLLM's _template_error_reason
                seen.add(id(reason))
                if isinstance(reason, jinja2.TemplateError):
                    break
                reason = reason.__cause__ or reason.__context__
            _write(stdout, {"error": "template", "message": str(reason if reason is not None else e)
                            or type(e).__name__})
            continue
        encoded = len(text.encode("utf-8", "surrogatepass"))
        if encoded > args.max_output:
            _write(stdout, {"error": "output", "message": str(encoded)})
            continue
        _write(stdout, {"text": text})


if __name__ == "__main__":
    sys.exit(main())
