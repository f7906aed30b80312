"""Protobuf messages straight to the JSON text ``loractl ... --json`` prints, for ``ls --json``.

Invariant: :func:`messages_json` gives exactly
``dumps_indented([to_dict(m) for m in messages])`` (``loractl.messages``,
``loractl.cli._output``: json.dumps with indent=2 and sorted keys), or None where a field is of a
kind it does not write (an enum, bytes, a float32, a well-known type, a map to messages, a NaN),
for the caller to take that path instead (tests/test_store_listing.py compares the two on every
message type, empty and filled).

Why: at 10,000 adapters the dicts in between cost more than the text, and a loop over each
message's fields cost more than the values. So each message type gets, once, a writer function
generated from its descriptor: its fields in sorted order, each read and encoded in one
expression (the encoders are json's C functions); a field with presence (a sub-message) is
written only when set, as json_format does.
"""

from __future__ import annotations

import json
import keyword
from typing import Any

from google.protobuf.descriptor import FieldDescriptor as F

_string = json.encoder.encode_basestring_ascii   # C: what json.dumps uses (ensure_ascii)
_INTS = (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_SINT32, F.TYPE_SINT64, F.TYPE_FIXED32,
         F.TYPE_FIXED64, F.TYPE_SFIXED32, F.TYPE_SFIXED64)
_WRITERS: dict[Any, Any] = {}   # descriptor -> its writer, or None: not written here


class _Other(Exception):
    """A field this module does not write: the caller goes through dicts."""


def messages_json(messages) -> str | None:
    """The messages as an indented JSON list (see the module), or None."""
    try:
        return list_json([_writer(m.DESCRIPTOR)(m, "\n  ") for m in messages])
    except _Other:
        return None


def message_json(message, indent: str = "\n  ") -> str | None:
    """One message as it stands in :func:`messages_json`'s list (``indent``: the new line and
    spaces its fields' lines start after), or None; ``list_json`` joins such texts."""
    try:
        return _writer(message.DESCRIPTOR)(message, indent)
    except _Other:
        return None


LIST_OPEN, LIST_SEPARATOR, LIST_CLOSE = "[\n  ", ",\n  ", "\n]"   # a non-empty list's; an empty one is "[]"


def list_json(texts: list[str]) -> str:
    """Texts of :func:`message_json` (list indent) as :func:`messages_json` writes their list."""
    return LIST_OPEN + LIST_SEPARATOR.join(texts) + LIST_CLOSE if texts else "[]"


def _double(value: float) -> str:
    if value - value != 0:   # NaN or infinite: json_format writes them as strings
        raise _Other
    return float.__repr__(value)


def _bool(value: bool) -> str:
    return "true" if value else "false"


_ENCODERS = {F.TYPE_STRING: "_string", F.TYPE_BOOL: "_bool", F.TYPE_DOUBLE: "_double",
             **{t: "_int" for t in _INTS}}


def _scalars(values, indent: str, encode) -> str:
    deeper = indent + "  "
    return "[" + deeper + ("," + deeper).join(map(encode, values)) + indent + "]" if values else "[]"


def _messages(values, indent: str) -> str:
    if not values:
        return "[]"
    deeper = indent + "  "
    write = _writer(values[0].DESCRIPTOR)
    return "[" + deeper + ("," + deeper).join([write(v, deeper) for v in values]) + indent + "]"


def _map(values, indent: str, encode) -> str:
    if not values:
        return "{}"
    deeper = indent + "  "
    return "{" + deeper + ("," + deeper).join(
        [_string(k) + ": " + encode(v) for k, v in sorted(values.items())]) + indent + "}"


def _message(value, indent: str) -> str:
    return _writer(value.DESCRIPTOR)(value, indent)


def _writer(descriptor):
    """The writer of ``descriptor``'s messages: ``write(message, indent) -> text``."""
    write = _WRITERS.get(descriptor, False)
    if write is False:
        write = _WRITERS[descriptor] = _generate(descriptor)
    if write is None:
        raise _Other
    return write


def _generate(descriptor):
    """Python source for one message type's writer, compiled; None if a field is of a kind not
    written here. The writer is one f-string (a single allocation: joining a list of
    ``key + value`` strings cost a third more at 10,000 adapters): each field one expression
    after its separator, a field with presence written with its separator under its HasField.
    A type whose first field (sorted) has presence, or has no fields, is written as a list."""
    fields = sorted(descriptor.fields, key=lambda f: f.name)
    if not fields or _present(fields[0]):
        return _generate_list(descriptor, fields)
    lines = ["def write(m, nl):", "    i = nl + '  '", "    c = ',' + i"]
    text = "{{{i}"
    for n, field in enumerate(fields):
        expression = _expression(field)
        if expression is None:
            return None
        key = _string(field.name) + ": "
        if _present(field):
            lines.append(f"    f{n} = c + {key!r} + {expression} if m.HasField({field.name!r}) else ''")
            text += f"{{f{n}}}"
        else:
            text += ("" if n == 0 else "{c}") + key + "{" + expression + "}"
    lines.append("    return f'" + text + "{nl}}}'")
    return _compiled(lines, descriptor)


def _present(field) -> bool:
    return field.has_presence and not field.is_repeated


def _expression(field) -> str | None:
    """The expression of ``field``'s JSON value in ``m`` at indent ``i``, or None: not written
    here. Its quotes are double (it goes inside the writer's single-quoted f-string)."""
    read = f'getattr(m, "{field.name}")' if keyword.iskeyword(field.name) else f"m.{field.name}"
    sub = field.message_type if field.type == F.TYPE_MESSAGE else None
    if sub is not None and sub.GetOptions().map_entry:
        encode = _ENCODERS.get(sub.fields_by_name["value"].type)
        if sub.fields_by_name["key"].type != F.TYPE_STRING or encode is None:
            return None
        return f"_map({read}, i, {encode})"
    if sub is not None:
        if sub.file.name.startswith("google/protobuf/"):
            return None
        return f"_messages({read}, i)" if field.is_repeated else f"_message({read}, i)"
    if field.type in _ENCODERS:
        encode = _ENCODERS[field.type]
        return f"_scalars({read}, i, {encode})" if field.is_repeated else f"{encode}({read})"
    return None


def _generate_list(descriptor, fields):
    """The writer as a list of ``key + value`` joined (see :func:`_generate`)."""
    lines = ["def write(m, nl):", "    i = nl + '  '", "    items = []"]
    run: list[str] = []
    for field in fields:
        expression = _expression(field)
        if expression is None:
            return None
        expression = f"{_string(field.name) + ': '!r} + {expression}"
        if _present(field):
            if run:
                lines.append(f"    items += [{', '.join(run)}]")
                run = []
            lines.append(f"    if m.HasField({field.name!r}): items.append({expression})")
        else:
            run.append(expression)
    if run:
        lines.append(f"    items += [{', '.join(run)}]")
    lines.append("    return '{' + i + (',' + i).join(items) + nl + '}' if items else '{}'")
    return _compiled(lines, descriptor)


def _compiled(lines: list[str], descriptor):
    scope = {"_string": _string, "_bool": _bool, "_double": _double, "_int": int.__repr__, "_map": _map,
             "_messages": _messages, "_message": _message, "_scalars": _scalars}
    exec(compile("\n".join(lines), f"<message_json {descriptor.full_name}>", "exec"), scope)   # noqa: S102
    return scope["write"]
