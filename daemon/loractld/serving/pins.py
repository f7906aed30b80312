"""The pins file: which adapters are pinned where, by name, across restarts (``state.json``).

Only :class:`loractld.serving.tiers.Tiers` changes it (it owns the pin caps and the gate's
places that go with the pins); start-up (``loractld.lifecycle.open_state``) prunes it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loractl.errors import of_os_error
from loractld.store.disk import write_json_atomic
from loractld.store.formats import STATE_FORMAT

_log = logging.getLogger("loractld.tiers")


class PersistentState:
    """Pins, by adapter name, in ``state.json`` (written atomically): ``pins`` in host RAM (the
    key older daemons wrote and read), ``device_pins`` in a device slot."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pins: list[str] = []
        self.device_pins: list[str] = []
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
                self.pins = [str(n) for n in saved.get("pins", [])]
                self.device_pins = [str(n) for n in saved.get("device_pins", []) if n not in self.pins]
            except (ValueError, AttributeError, TypeError) as e:
                _log.warning("ignoring unreadable %s: %s", path, e)

    def pin_of(self, name: str) -> str:
        return "device" if name in self.device_pins else "host" if name in self.pins else ""

    def set_pin(self, name: str, to: str) -> None:
        """Record ``name`` pinned ``to`` "device", "host", or "" (unpinned); saved at once, and
        changed in memory only once saved (a full disk: DiskFull, the pins as they were)."""
        pins = [n for n in self.pins if n != name] + ([name] if to == "host" else [])
        device_pins = [n for n in self.device_pins if n != name] + ([name] if to == "device" else [])
        self._write(pins, device_pins)
        self.pins, self.device_pins = pins, device_pins

    def save(self) -> None:
        self._write(self.pins, self.device_pins)

    def _write(self, pins: list[str], device_pins: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_json_atomic(self.path, {"format": STATE_FORMAT, "pins": pins, "device_pins": device_pins})
        except OSError as e:
            raise of_os_error(e) from e
