"""Ollama's Modelfile, read and written: pure text in, :class:`Modelfile` out, and back.

Syntax (Ollama's ``docs/modelfile.md``): one ``INSTRUCTION arguments`` per line, instructions in
any case and any order, ``#`` comments, blank lines; an argument is bare text to the end of the
line, a ``"quoted"`` string (``\\"`` and ``\\\\`` escaped), or a ``\"\"\"`` string that may span
lines. ``PARAMETER name value`` and ``MESSAGE role content`` take a word, then an argument.

What loractl honours: ``FROM`` (the base model, a stored adapter or another profile),
``ADAPTER`` (a stored name, a folder or a Hub ref, optionally ``=WEIGHT``; several lines
merge), ``SYSTEM``, ``TEMPLATE`` (a Jinja chat template, as vLLM's ``--chat-template`` takes),
``PARAMETER`` (:data:`PARAMETERS`, the options the Ollama door maps), ``MESSAGE`` (few-shot
turns) and ``LICENSE``.

Invariants:
- A line that cannot be honoured is refused by its line number and what is wrong with it
  (:class:`~loractl.errors.InvalidRequest`), and nothing is returned: a profile is made from a
  whole Modelfile or not at all. An Ollama Go template (``{{ .System }}``) is refused by name.
- ``parse(render(m)) == m`` for every :class:`Modelfile` (the round trip ``show --modelfile``
  relies on).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from loractl.errors import InvalidRequest
from loractl.names import NAME_RE

INSTRUCTIONS = ("FROM", "ADAPTER", "SYSTEM", "TEMPLATE", "PARAMETER", "MESSAGE", "LICENSE")
ROLES = ("system", "user", "assistant")
# Ollama option -> (type, the OpenAI request field it becomes). The Ollama door maps the same
# names (api/ollama/options.py); num_ctx is checked against the context, never sent.
PARAMETERS: dict[str, tuple[type, str | None]] = {
    "temperature": (float, "temperature"), "top_p": (float, "top_p"), "top_k": (int, "top_k"),
    "min_p": (float, "min_p"), "seed": (int, "seed"), "num_predict": (int, "max_tokens"), "stop": (str, "stop"),
    "repeat_penalty": (float, "repetition_penalty"), "presence_penalty": (float, "presence_penalty"),
    "frequency_penalty": (float, "frequency_penalty"), "num_ctx": (int, None), "repeat_last_n": (int, None),
}
# Samplers vLLM lacks: accepted with the value that turns them off, as the Ollama door does.
NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
_GO_TEMPLATE = re.compile(r"\{\{-?\s*(?:\.[A-Za-z]|(?:if|range|with|else if)\s+[.$(]|end\s*-?\}\}|\$)")
_PARAMETER_HINT = ("loractl honours " + ", ".join(PARAMETERS) + " (and mirostat 0, tfs_z 1, typical_p 1, "
                   "which turn those samplers off).")


@dataclass
class Modelfile:
    """A Modelfile's content. ``parameters`` holds Ollama's names; ``stop`` is a list."""

    base: str = ""                                            # FROM
    adapters: list[tuple[str, float]] = field(default_factory=list)
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    # Each ADAPTER line's number, for refusals that name it (core/profile_sources.py); not content.
    adapter_lines: list[int] = field(default_factory=list, compare=False, repr=False)
    # Each PARAMETER's (last) line, for the refusals only the daemon can make (num_ctx over the context).
    parameter_lines: dict[str, int] = field(default_factory=dict, compare=False, repr=False)


def refused(line: int, message: str, hint: str) -> InvalidRequest:
    return InvalidRequest(f"Modelfile line {line}: {message}" if line else f"Modelfile: {message}", hint)


def parse(text: str, *, require_from: bool = True) -> Modelfile:
    """The :class:`Modelfile` ``text`` says, or the refusal of its first line that cannot be honoured."""
    result = Modelfile()
    for line, instruction, rest in _statements(text):
        word = instruction.upper()
        if word not in INSTRUCTIONS:
            raise refused(line, f"unknown instruction {instruction!r}",
                          f"A Modelfile's instructions are {', '.join(INSTRUCTIONS)}.")
        if not rest.strip():
            raise refused(line, f"{word} needs an argument", f"Write: {word} {_USAGE[word]}")
        if word in ("PARAMETER", "MESSAGE"):
            key, value = (re.split(r"\s+", rest.strip(), maxsplit=1) + [""])[:2]
            if not value.strip():
                raise refused(line, f"{word} {key} needs a value", f"Write: {word} {_USAGE[word]}")
            value = _unquoted(value, line)
            if word == "PARAMETER":
                _set_parameter(result.parameters, key.lower(), value, line)
                result.parameter_lines[key.lower()] = line
            else:
                if key.lower() not in ROLES:
                    raise refused(line, f"MESSAGE role {key!r} is not one of {', '.join(ROLES)}",
                                  "Write: MESSAGE user Is Toronto in Canada?")
                result.messages.append({"role": key.lower(), "content": value})
            continue
        value = _unquoted(rest, line)
        if word == "FROM":
            if result.base:
                raise refused(line, "a second FROM", "A profile has one base: keep one FROM line "
                              "(Ollama's several FROM lines are a split GGUF file, which loractl does not take).")
            result.base = value.strip()
        elif word == "ADAPTER":
            result.adapters.append(adapter_weight(value.strip(), line))
            result.adapter_lines.append(line)
        elif word == "SYSTEM":
            result.system = value
        elif word == "TEMPLATE":
            result.template = checked_template(value, line)
        else:
            result.license.append(value)
    if "repeat_last_n" in result.parameters and result.parameters["repeat_last_n"] != -1 and \
            result.parameters.get("repeat_penalty", 1.0) != 1.0:
        raise refused(0, "repeat_last_n counts back over part of the sequence; vLLM's repetition penalty covers "
                      "all of it", "Leave repeat_last_n out (or set it to -1) beside repeat_penalty.")
    if require_from and not result.base:
        raise refused(0, "no FROM line", "Start with FROM and the base model, a stored adapter or a profile "
                      "(loractl ls lists them).")
    return result


_USAGE = {"FROM": "<base model, adapter or profile>", "ADAPTER": "<stored name, folder or Hub ref>[=WEIGHT]",
          "SYSTEM": '"""<system prompt>"""', "TEMPLATE": '"""<Jinja chat template>"""',
          "PARAMETER": "<name> <value>, e.g. PARAMETER temperature 0", "MESSAGE": "<role> <content>",
          "LICENSE": '"""<license text>"""'}


def adapter_weight(text: str, line: int = 0) -> tuple[str, float]:
    """``NAME[=WEIGHT]`` as (name, weight); the weight is 1 when not given. Spaces around ``=``
    are allowed; after a name (no path) the weight must be a number."""
    name, sep, weight = text.rpartition("=")
    if not sep:
        return text, 1.0
    name, weight = name.strip(), weight.strip()
    try:
        value = float(weight)
    except ValueError:
        if NAME_RE.match(name) and "/" not in weight:
            raise refused(line, f"adapter weight {weight!r} is not a number",
                          f"Write ADAPTER NAME=WEIGHT with a number, e.g. ADAPTER {name}=0.5.") from None
        return text, 1.0   # an '=' inside a path, not a weight
    if not math.isfinite(value) or value == 0:
        raise refused(line, f"adapter weight {weight!r} is not a finite, non-zero number",
                      "Write ADAPTER NAME=WEIGHT, e.g. ADAPTER sql-expert/v1=0.5.")
    return name, value


def checked_template(template: str, line: int = 0) -> str:
    """``template`` if it is a Jinja template; an Ollama Go template is refused by name."""
    if _GO_TEMPLATE.search(template):
        raise refused(line, "TEMPLATE is an Ollama Go template ({{ .System }}, {{ .Prompt }}, {{ range .Messages }})",
                      "loractl renders with vLLM, which takes a Jinja chat template (as --chat-template does): "
                      "write it in Jinja, or leave TEMPLATE out to use the model's own.")
    if "{{" not in template and "{%" not in template:
        raise refused(line, "TEMPLATE has no Jinja in it: every chat would render as that fixed text",
                      "Give a Jinja chat template over messages, or leave TEMPLATE out to use the model's own.")
    import jinja2   # the daemon's (vLLM renders with it); here, not at import: parsing needs none
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:   # as vLLM compiles a chat template (loopcontrols: {% break %}), so each request need not fail
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        at = line + (e.lineno or 1) - 1 if line else 0
        raise refused(at, f"TEMPLATE is not valid Jinja: {e.message}",
                      "Fix the template (every {{ needs its }}, every {% if %} its {% endif %}), or leave TEMPLATE "
                      "out to use the model's own.") from None
    return template


def _set_parameter(parameters: dict, name: str, value: str, line: int) -> None:
    if name in NEUTRAL:
        if _number(value, float, name, line) != NEUTRAL[name]:
            raise refused(line, f"PARAMETER {name} is not supported by loractl's engine (vLLM)",
                          f"Leave it out, or set it to {NEUTRAL[name]}, which turns it off. " + _PARAMETER_HINT)
        return
    if name not in PARAMETERS:
        raise refused(line, f"unknown or unsupported PARAMETER {name!r}", _PARAMETER_HINT)
    kind = PARAMETERS[name][0]
    if name == "stop":
        if not value:
            raise refused(line, "PARAMETER stop is empty: every request would be refused (vLLM takes no empty stop)",
                          'Give the text that ends an answer, e.g. PARAMETER stop ";".')
        parameters.setdefault("stop", []).append(value)
        return
    number = _number(value, kind, name, line)
    if name == "num_predict" and number < -2:
        raise refused(line, f"num_predict {value} is not a number of tokens", "Use a count, or -1 for no limit.")
    ok, wanted = BOUNDS.get(name, (None, ""))
    if ok is not None and not ok(number):
        raise refused(line, f"PARAMETER {name} {value.strip()} is out of range: every request would be refused",
                      f"{name} takes {wanted}.")
    parameters[name] = number


# Each parameter's range as vLLM's SamplingParams (0.32) and the protocol (int32 max_tokens,
# int64 seed) take it, refused at create rather than at every request that uses the profile.
# The context bounds num_predict and num_ctx further, checked where it is known (Core.create).
BOUNDS: dict[str, tuple[Any, str]] = {
    "temperature": (lambda v: 0 <= v <= 2, "a number from 0 to 2"),
    "top_p": (lambda v: 0 < v <= 1, "a number above 0, at most 1"),
    "top_k": (lambda v: v >= -1, "a count of tokens, or 0 (or -1) for no limit"),
    "min_p": (lambda v: 0 <= v <= 1, "a number from 0 to 1"),
    "seed": (lambda v: -(1 << 63) <= v < 1 << 63, "a whole number that fits 64 bits"),
    "num_predict": (lambda v: v in (-1, -2) or 1 <= v < 1 << 31, "a count of tokens from 1, or -1 for no limit"),
    "repeat_penalty": (lambda v: v > 0, "a number above 0 (1 is none)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2"),
    "num_ctx": (lambda v: v >= 1, "a count of tokens from 1"),
    "repeat_last_n": (lambda v: v >= -1, "a count of tokens, 0 or -1"),
}


def _number(value: str, kind: type, name: str, line: int) -> int | float:
    try:
        number = kind(value.strip())
    except ValueError:
        raise refused(line, f"PARAMETER {name} takes {'a whole number' if kind is int else 'a number'}, "
                      f"not {value.strip()!r}", f"Write e.g. PARAMETER {name} {1 if kind is int else 0.5}.") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise refused(line, f"PARAMETER {name} must be finite", f"Write e.g. PARAMETER {name} 0.5.")
    return number


def _statements(text: str):
    """(line number, instruction, the rest) of each statement; a quoted argument may span lines."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start, stripped = i + 1, lines[i].strip()
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        instruction, rest = (re.split(r"\s+", stripped, maxsplit=1) + [""])[:2]
        # A quote opened and not closed on this line runs on over the next ones.
        while _open_quote(rest, instruction.upper() in ("PARAMETER", "MESSAGE")):
            if i >= len(lines):
                raise refused(start, f"{instruction.upper()}'s quoted text is never closed",
                              'Close it with """ (or " for a one-quote string).')
            rest += "\n" + lines[i]
            i += 1
        yield start, instruction, rest


def _argument_start(rest: str, after_word: bool) -> str:
    """The part of a statement that is quoted, if any: PARAMETER and MESSAGE quote after a word."""
    text = rest.strip()
    if not after_word:
        return text if text.startswith('"') else ""
    after = (re.split(r"\s+", text, maxsplit=1) + [""])[1]
    return after if after.startswith('"') else ""


def _open_quote(rest: str, after_word: bool) -> bool:
    arg = _argument_start(rest, after_word)
    if arg.startswith('"""'):
        return len(arg) < 6 or not arg.rstrip().endswith('"""')
    if arg.startswith('"'):
        return not re.search(r'(?<!\\)(?:\\\\)*"\s*$', arg[1:])
    return False


def _unquoted(value: str, line: int) -> str:
    text = value.strip()
    if text.startswith('"""'):
        body = text.rstrip()
        if len(body) < 6 or not body.endswith('"""'):
            raise refused(line, 'unclosed """', 'Close the text with """.')
        return body[3:-3]
    if text.startswith('"'):
        if len(text) < 2 or not text.endswith('"'):
            raise refused(line, "unclosed quote", 'Close the text with ".')
        return re.sub(r'\\(["\\])', r"\1", text[1:-1])
    return text


# -- writing --------------------------------------------------------------------------------
def quoted(text: str) -> str:
    """``text`` as a Modelfile argument that reads back as itself."""
    if text and "\n" not in text and text == text.strip() and not text.startswith('"') and "#" != text[0]:
        return text
    if '"""' not in text and not text.endswith('"'):
        return f'"""{text}"""'
    return _one_quote(text)


def _one_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(m: Modelfile, *, header: str = "") -> str:
    """The Modelfile text that recreates ``m`` (what ``show --modelfile`` prints)."""
    out = [f"# {line}" for line in header.splitlines()]
    out.append(f"FROM {quoted(m.base)}")
    for name, weight in m.adapters:
        out.append(f"ADAPTER {quoted(name if weight == 1 else f'{name}={weight:g}')}")
    if m.template is not None:
        out.append(f"TEMPLATE {quoted(m.template)}")
    if m.system is not None:
        out.append(f"SYSTEM {quoted(m.system)}")
    for name, value in m.parameters.items():
        for v in value if isinstance(value, list) else [value]:
            out.append(f"PARAMETER {name} {_one_quote(v) if name == 'stop' else _number_text(v)}")
    for message in m.messages:
        out.append(f"MESSAGE {message['role']} {quoted(message['content'])}")
    for text in m.license:
        out.append(f"LICENSE {quoted(text)}")
    return "\n".join(out) + "\n"


def _number_text(value: int | float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def openai_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """A profile's parameters as OpenAI request fields (vLLM's names where OpenAI has none);
    ``num_predict`` -1/-2 mean no bound but the context, so no field."""
    fields: dict[str, Any] = {}
    for name, value in parameters.items():
        target = PARAMETERS.get(name, (None, None))[1]
        if target is None or (name == "num_predict" and value < 0):
            continue
        fields[target] = list(value) if name == "stop" else value
    return fields
