"""Format versions of what a daemon keeps on disk, so that an upgrade loses nothing.

- The adapter store carries ``<store>/.loractl-store.json`` (``{"format": N}``, written by
  ``Store.stamp_format``); a store
  written before formats were numbered has none and is format 1, the layout this release
  writes (``loractld/store/disk.py``). Each manifest a pull writes carries ``format`` too.
- Each profile (``<store>/.profiles/<name>.json``, ``loractld/store/profiles.py``) carries
  ``format``; a profile of a newer format is skipped with a warning that names it, never
  misread, overwritten or deleted (a create onto its name is refused by name), while the other
  profiles are served: unlike the store and the pins, it is one model among many.
- The pins (``<state>/state.json``) carry ``format``; a file without one is format 1.
- The service registry's entries carry ``format`` (``loractl/registry.py``), and readers skip an
  entry of a newer format instead of misreading it.

Invariants:
- :func:`check_home` runs once at start, after the daemon holds its home and before anything in
  it is touched (recovery, GC, the pins' clean-up). A store or pins file of a newer format than
  this release reads is refused by name (:class:`NewerFormat`: what, where, which format, which
  this daemon reads) and nothing is rewritten, moved or removed.
- Formats only grow; a release that changes a layout bumps its number and keeps reading every
  older one (``tests/fixtures/store-v1`` is a store this release wrote, read by every later one;
  ``tests/fixtures/profiles-v1`` likewise for profiles and merged adapters).
"""

from __future__ import annotations

import json
from pathlib import Path

from loractl import __version__
from loractl.errors import LoractlError

STORE_FORMAT = 1
STATE_FORMAT = 1
MANIFEST_FORMAT = 1
PROFILE_FORMAT = 1
STORE_MARKER = ".loractl-store.json"


class NewerFormat(LoractlError):
    kind = "newer_format"
    exit_code = 2
    default_hint = "Upgrade loractl to the release that wrote it, or start with another --home; nothing was changed."


class UnreadableFormat(NewerFormat):
    """A ``format`` that is no format number (``"2"``, ``2.0``, ``0``, ``true``): refused, not read as 1."""
    kind = "unreadable_format"
    default_hint = ("Write \"format\" as a whole number (1 for this release's layout) or restore the file; "
                    "nothing was changed.")


def format_of(doc: object) -> int:
    """The ``format`` a JSON document says, 1 when it says none (written before formats)."""
    value = doc.get("format", 1) if isinstance(doc, dict) else 1
    return value if isinstance(value, int) and value >= 1 else 1


_NO_FILE = object()


def _read_format(path: Path) -> object:
    """The ``format`` ``path`` says as written (1 when it says none); ``_NO_FILE`` when there is no file."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return _NO_FILE
    except (OSError, ValueError):
        return 1  # unreadable: the reader of that file reports it as it always has
    return doc.get("format", 1) if isinstance(doc, dict) else 1


def _is_format(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_home(store_root: Path, state_file: Path) -> None:
    """Refuse a store or pins file from a newer release (see the module's invariants)."""
    for what, path, readable in (("adapter store", store_root / STORE_MARKER, STORE_FORMAT),
                                 ("pins file", state_file, STATE_FORMAT)):
        found = _read_format(path)
        where = path.parent if path.name == STORE_MARKER else path
        if found is _NO_FILE:
            continue
        if not _is_format(found):
            raise UnreadableFormat(f"the {what} at {where} says format {json.dumps(found)} in {path.name}, "
                                   f"which is no format number; loractld {__version__} reads format {readable} "
                                   "and older")
        if found > readable:
            raise NewerFormat(f"the {what} at {where} is format {found}, written by a newer loractl; "
                              f"loractld {__version__} reads format {readable} and older")

