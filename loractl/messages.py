"""Protobuf replies as plain dicts, the one way both the client and the CLI's quick path read them.

Invariant: every field is present (defaults included) and numbers are JSON numbers. Protobuf's
JSON mapping writes 64-bit integers as strings (for JavaScript's doubles); ``loractl ls --json``
then gave ``"size": "282088"``, which a script's ``jq '.size > 1000'`` compares as text. Our
integers are byte counts and request counts, far below 2**53, so they are numbers here.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor

_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def to_dict(message: Any) -> dict[str, Any]:
    """``message`` as a dict with every field present and 64-bit integers as ints."""
    from google.protobuf.json_format import MessageToDict

    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _numbers(message.DESCRIPTOR, data)
    return data


def _numbers(descriptor, data: dict[str, Any]) -> None:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.type in _INT64:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                value_field = sub.fields_by_name["value"]
                if value_field.type in _INT64:
                    data[field.name] = {k: int(v) for k, v in value.items()}
                elif value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    for v in value.values():
                        _numbers(value_field.message_type, v)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, dict):
                        _numbers(sub, item)
            elif isinstance(value, dict):
                _numbers(sub, value)
