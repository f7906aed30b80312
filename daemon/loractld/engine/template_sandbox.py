"""Chat templates that are not the model's own, rendered in a child process with a deadline and
a memory cap, off the event loop and off vLLM's renderer thread.

A profile's TEMPLATE (and a request's ``chat_template`` under --trust-request-chat-template) is
text a client wrote. vLLM renders a chat template with transformers' sandboxed Jinja in its
renderer's one worker thread, the same thread that tokenizes every other request: a template
that loops for a minute held every generation for that minute (and went on after its client
left), and one that built a 400 MB string grew the daemon by 1.5 GB. Here vLLM's
``HfRenderer._apply_chat_template_async`` is wrapped on the instance: a render whose template is
not the server's own (the model's, or ``--chat-template``) is

1. resolved by vLLM's own ``safe_apply_chat_template`` up to the tokenizer's
   ``apply_chat_template`` call (the template, the developer role, the keyword arguments it keeps),
   in a thread, with a tokenizer that records that call instead of making it;
2. rendered by transformers' ``render_jinja_template`` in a child process
   (:mod:`loractld.engine.template_child`), under :data:`RENDER_SECONDS`, :data:`RENDER_MEMORY`
   and an output cap; the child is killed at the deadline and when the request is cancelled (its
   client left), and the request gets vLLM's validation error (a 400, "could not be rendered");
3. tokenized in a thread as ``apply_chat_template`` tokenizes (``add_special_tokens=False``).

The same tokens come out as from vLLM's own path. Every other render (the model's template, a
raw prompt, tokenization) takes vLLM's path unchanged and never waits for one of these.

Invariants:
- At most :data:`MAX_CHILDREN` children at once; a render beyond waits for one (renders are
  short or killed at the deadline), never for vLLM's renderer thread.
- A child that failed (deadline, memory, died, cancelled) is killed and dropped; only one that
  answered is reused.
- ``vllm`` is imported inside functions only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import struct
import sys
import time
from typing import Any

_log = logging.getLogger("loractld.engine")

RENDER_SECONDS = 10.0            # one render's deadline
RENDER_MEMORY = 256 * 1024 ** 2  # a child's address space past its start
MAX_CHILDREN = 4                 # renders at once
OUTPUT_FLOOR = 4 * 1024 ** 2     # the rendered text's cap: this, or 64 bytes a token of the context
START_SECONDS = 120.0            # a child's start (imports transformers' chat template module)


# Templates the daemon's owner gave (the model's own, --chat-template): compiled in the daemon,
# as vLLM compiles them. Any other is only parsed here (parsing folds nothing).
_TRUSTED: set[str] = set()
# A template's undeclared variables as a child found them (a function of the template's text
# alone, so shared by every render of it): what vLLM's kwargs filter reads for a template the
# daemon must not compile. The last 64 templates, and any a render is using (_RENDERING).
_FOUND: dict[str, frozenset[str]] = {}
_FOUND_KEPT = 64
_RENDERING: dict[str, int] = {}


def trust(template: Any) -> None:
    """Count ``template`` (a text, or a tokenizer's dict of named templates) as the owner's."""
    if isinstance(template, str):
        _TRUSTED.add(template)
    elif isinstance(template, dict):
        _TRUSTED.update(t for t in template.values() if isinstance(t, str))


def patch_vllm() -> None:
    """Keep an untrusted template out of Jinja's compiler in the daemon: vLLM's content-format
    detection parses it without compiling it, and its kwargs filter takes the variables a child
    found (:meth:`TemplateSandbox.variables`). Once per process; trusted templates as before."""
    from vllm.renderers import hf

    if getattr(hf._try_extract_ast, "_loractl_sandbox", False):
        return
    extract, variables = hf._try_extract_ast, hf._cached_resolve_chat_template_kwargs

    def _try_extract_ast(chat_template: str) -> Any:
        if chat_template in _TRUSTED:
            return extract(chat_template)
        import jinja2.ext
        import jinja2.sandbox

        try:
            return jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True,
                extensions=[hf.AssistantTracker, jinja2.ext.loopcontrols]).parse(chat_template)
        except Exception:  # noqa: BLE001 - as vLLM's: no AST, the default format
            return None

    def _cached_resolve_chat_template_kwargs(chat_template: str) -> Any:
        found = _FOUND.get(chat_template)
        if found is not None:
            return found
        return variables(chat_template)   # vLLM's own path (the renders this module does not take)

    _try_extract_ast._loractl_sandbox = True   # type: ignore[attr-defined]
    hf._try_extract_ast = _try_extract_ast
    hf._cached_resolve_chat_template_kwargs = _cached_resolve_chat_template_kwargs


class _Captured(BaseException):
    """Raised by the recording tokenizer: the call vLLM would make (BaseException, so vLLM's
    ``except Exception`` around the call does not turn it into a template error)."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        super().__init__("captured")
        self.arguments = arguments


class _Recording:
    """A tokenizer that answers as ``tokenizer`` but records ``apply_chat_template`` instead."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        real = tokenizer.apply_chat_template
        signature = _signature(tokenizer)

        @functools.wraps(real)
        def apply_chat_template(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(None, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            arguments.pop("self", None)
            raise _Captured(arguments)

        self.apply_chat_template = apply_chat_template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _signature(tokenizer: Any) -> inspect.Signature:
    """The signature of the ``apply_chat_template`` that does the work (transformers'; vLLM's
    thread-safe tokenizer wraps it in ``*args, **kwargs``), ``self`` included."""
    for klass in type(tokenizer).__mro__:
        method = klass.__dict__.get("apply_chat_template")
        if method is not None:
            signature = inspect.signature(method)
            if "conversation" in signature.parameters:
                return signature
    raise TypeError(f"{type(tokenizer).__name__} has no apply_chat_template(conversation, ...)")


class _Child:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def call(self, request: bytes) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(struct.pack(">I", len(request)) + request)
        await self.process.stdin.drain()
        return await _answer(self.process.stdout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def reap(self) -> None:
        self.kill()
        with contextlib.suppress(Exception):
            await self.process.wait()


async def _answer(stdout: asyncio.StreamReader) -> dict:
    head = await stdout.readexactly(4)
    (size,) = struct.unpack(">I", head)
    return json.loads(await stdout.readexactly(size))


class TemplateSandbox:
    """The children and the wrapped renderer; one per :class:`~loractld.engine.openai_serving.OpenAISurface`."""

    def __init__(self, *, server_template: str | None, max_model_len: int, seconds: float = RENDER_SECONDS,
                 memory: int = RENDER_MEMORY, children: int = MAX_CHILDREN) -> None:
        self.server_template = server_template
        self.seconds = seconds
        self.memory = memory
        self.max_output = max(OUTPUT_FLOOR, 64 * max_model_len)
        self._idle: list[_Child] = []
        self._slots = asyncio.Semaphore(children)
        self.renders = 0          # renders done here (tests, metrics)
        self.killed = 0           # children killed (deadline, memory, cancelled)
        self._spare: asyncio.Task | None = None
        _TRUSTED.add(server_template) if server_template is not None else None

    def wraps(self, kwargs: dict[str, Any]) -> bool:
        template = kwargs.get("chat_template")
        return template is not None and template != self.server_template

    def install(self, renderer: Any) -> bool:
        """Wrap ``renderer``'s chat template call (vLLM's HfRenderer); False where it has none
        (another renderer: vLLM renders there, as before)."""
        original = getattr(renderer, "_apply_chat_template_async", None)
        if original is None or getattr(original, "_loractl_sandbox", False):
            return False

        async def apply_chat_template_async(model_config: Any, tokenizer: Any, conversation: Any, **kwargs: Any):
            if not self.wraps(kwargs):
                return await original(model_config, tokenizer, conversation, **kwargs)
            return await self.apply(model_config, tokenizer, conversation, **kwargs)

        apply_chat_template_async._loractl_sandbox = True   # type: ignore[attr-defined]
        renderer._apply_chat_template_async = apply_chat_template_async
        trust(getattr(getattr(renderer, "tokenizer", None), "chat_template", None))
        patch_vllm()
        with contextlib.suppress(RuntimeError):   # no loop: the first render starts one
            asyncio.get_running_loop()
            self.prewarm()
        return True

    async def apply(self, model_config: Any, tokenizer: Any, conversation: Any, **kwargs: Any) -> Any:
        """What vLLM's ``safe_apply_chat_template`` returns for these arguments, rendered in a child."""
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.hf import safe_apply_chat_template

        template = await asyncio.to_thread(tokenizer.get_chat_template, kwargs.get("chat_template"),
                                           kwargs.get("tools"))
        known = await self.variables(template)

        def record() -> dict[str, Any]:
            try:
                safe_apply_chat_template(model_config, _Recording(tokenizer), conversation, **kwargs)
            except _Captured as captured:
                return captured.arguments
            raise VLLMValidationError("the chat template was not applied")   # vLLM did not call it

        _FOUND.setdefault(template, known)   # read by vLLM's kwargs filter in the thread below
        _RENDERING[template] = _RENDERING.get(template, 0) + 1
        try:
            call = await asyncio.to_thread(record)
        finally:
            if _RENDERING[template] == 1:
                del _RENDERING[template]
            else:
                _RENDERING[template] -= 1
        extra = dict(call.pop("kwargs", None) or {})
        if call.get("return_assistant_tokens_mask"):
            raise VLLMValidationError("return_assistant_tokens_mask is not served with a profile's chat template")
        conversation = call["conversation"]
        if not conversation:
            raise VLLMValidationError("Cannot apply chat template to an empty conversation.")
        if call.get("continue_final_message") and call.get("add_generation_prompt"):
            raise VLLMValidationError("continue_final_message and add_generation_prompt are not compatible.")
        request = {"conversation": conversation, "tools": call.get("tools"), "documents": call.get("documents"),
                   "chat_template": call.get("chat_template"), "continue_final_message": call.get("continue_final_message"),
                   "add_generation_prompt": call.get("add_generation_prompt"),
                   "kwargs": {**tokenizer.special_tokens_map, **extra}}
        text = await self.render(json.dumps(request, default=str).encode())
        if not call.get("tokenize", True):
            return text

        def tokenized() -> Any:
            out = tokenizer(text, padding=call.get("padding", False), truncation=call.get("truncation", False),
                            max_length=call.get("max_length"), add_special_tokens=False,
                            return_tensors=call.get("return_tensors"), **(call.get("tokenizer_kwargs") or {}))
            return out if call.get("return_dict") else out["input_ids"]

        return await asyncio.to_thread(tokenized)

    async def render(self, request: bytes) -> str:
        """The text the child renders for ``request``, within the deadline."""
        return (await self._ask(request))["text"]

    async def variables(self, template: str) -> frozenset[str]:
        """``template``'s undeclared variables (vLLM's ``resolve_chat_template_kwargs`` keeps the
        keyword arguments it names), found in a child: finding them compiles the template, and
        Jinja's compiler folds constants (``"a" * 400000000`` is built there)."""
        known = _FOUND.get(template)
        if known is None:
            known = frozenset((await self._ask(json.dumps({"variables_of": template}).encode()))["variables"])
            if len(_FOUND) >= _FOUND_KEPT:
                oldest = next((t for t in _FOUND if t not in _RENDERING), None)
                if oldest is not None:
                    del _FOUND[oldest]
            _FOUND[template] = known
        return known

    async def _ask(self, request: bytes) -> dict:
        """A child's answer to ``request`` within the deadline; a refusal is vLLM's validation error."""
        from vllm.exceptions import VLLMValidationError

        async with self._slots:
            child = self._idle.pop() if self._idle else await self._start()
            self.prewarm()
            started = time.monotonic()
            keep = False
            try:
                answer = await asyncio.wait_for(child.call(request), self.seconds)
                keep = "error" not in answer or answer["error"] in ("template", "output")
            except TimeoutError:
                raise VLLMValidationError(
                    f"the chat template took longer than {self.seconds:g} s to render (loractl's cap on a "
                    "profile's template): make it do less") from None
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                raise VLLMValidationError(f"the chat template's renderer ended: {e}") from None
            finally:
                self.renders += 1
                if keep:
                    self._idle.append(child)
                else:
                    self.killed += 1
                    await asyncio.shield(child.reap())
                    _log.warning("a chat template's renderer was stopped after %.1f s", time.monotonic() - started)
                    self.prewarm()   # the next render need not wait for a start
        if "error" not in answer:
            return answer
        kind, message = answer.get("error"), answer.get("message", "")
        if kind == "memory":
            raise VLLMValidationError(
                f"the chat template used more than {self.memory // 1024 ** 2} MiB while rendering (loractl's cap "
                "on a profile's template): make it build less")
        if kind == "output":
            raise VLLMValidationError(
                f"the chat template rendered {message} bytes, over loractl's cap of {self.max_output} bytes")
        raise VLLMValidationError(message or "the chat template failed")

    def prewarm(self) -> None:
        """Start a spare child in the background unless one is idle or starting (its start, a
        second or more, is not paid by the next render)."""
        if self._idle or self._spare is not None:
            return

        async def spare() -> None:
            try:
                self._idle.append(await self._start())
            except Exception as e:  # noqa: BLE001 - the next render starts its own and says why
                _log.warning("could not start a chat template renderer: %s", e)
            finally:
                self._spare = None

        self._spare = asyncio.get_running_loop().create_task(spare())

    async def _start(self) -> _Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loractld.engine.template_child", "--memory", str(self.memory),
            "--max-output", str(self.max_output), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
            start_new_session=True)
        child = _Child(process)
        try:
            assert process.stdout is not None
            ready = await asyncio.wait_for(_answer(process.stdout), START_SECONDS)
            if "ready" not in ready:
                raise OSError(f"unexpected first answer {ready!r}")
        except BaseException:
            await asyncio.shield(child.reap())
            raise
        return child

    async def close(self) -> None:
        if self._spare is not None:
            self._spare.cancel()
            await asyncio.gather(self._spare, return_exceptions=True)
        idle, self._idle = self._idle, []
        for child in idle:
            await child.reap()
