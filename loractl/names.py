"""Adapter names: ``sql-expert/v1`` — lowercase ``[a-z0-9][a-z0-9._-]*``, at most one ``/``.

Invariant: a valid name, joined to the store folder, stays inside it (no ``..``, no absolute
paths, no empty parts), so a name is safe to use as a relative path.
"""

from __future__ import annotations

import re

from loractl.errors import InvalidRequest

_PART = r"[a-z0-9][a-z0-9._-]*"
NAME_RE = re.compile(rf"^{_PART}(/{_PART})?$")
MAX_NAME_LEN = 128


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid adapter name, else raise :class:`InvalidRequest`."""
    if not name or len(name) > MAX_NAME_LEN or not NAME_RE.match(name) or any(
        part in (".", "..") or part.endswith(".") for part in name.split("/")
    ):
        weighted = colon_weight(name or "")
        raise InvalidRequest(
            f"invalid adapter name {name!r}",
            f"A weight is written with '=': {weighted[0]}={weighted[1]}." if weighted else
            "Names are lowercase letters, digits, '.', '_' and '-', with at most one '/', e.g. sql-expert/v1.",
        )
    return name


# ``sql-expert/v1:0.7``: a weight written as Ollama writes a tag, which loractl spells ``=0.7``.
_COLON_WEIGHT = re.compile(r"^(.+?)\s*:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$")


def colon_weight(text: str) -> tuple[str, str] | None:
    """(name, weight) when ``text`` is a valid name and a number joined by ``:`` (meant as ``=``)."""
    match = _COLON_WEIGHT.match(text.strip())
    return (match[1], match[2]) if match and NAME_RE.match(match[1]) else None


def default_name(repo_id: str, subfolder: str = "") -> str:
    """The name a pulled repo gets without ``--name``: ``Org/My_Adapter`` -> ``org/my_adapter``."""
    parts = [p for p in (repo_id.split("/") + ([subfolder.replace("/", "-")] if subfolder else [])) if p]
    if len(parts) > 2:  # org/repo/sub -> org/repo-sub
        parts = [parts[0], "-".join(parts[1:])]
    cleaned = [re.sub(r"[^a-z0-9._-]+", "-", p.lower()).strip("-.") or "x" for p in parts]
    cleaned = [p if p[0].isalnum() else "x" + p for p in cleaned]
    return validate_name("/".join(cleaned))
