"""What the store learned about its content, kept across starts (loractld.store.known), and a
listing that lists content it has not validated yet as ``checking`` instead of making its caller
wait (issue 61: the first ``ls`` after a start took 16.7 s at 10,000 hand-placed adapters).

On the real store, resolver and validator of ``open_catalog``; the engine is not started. The
counters wrap the real functions (they count, then do the real work): a second start that reads
no adapter's bytes and validates nothing is what the kept file is for."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest

from loractld.core.disk_ops import DiskOps
from loractld.core.tier_ops import TierOps
from loractld.engine.client import EngineSettings
from loractld.lifecycle import DaemonSettings, open_catalog
from loractld.store import copies
from loractld.store.identity import CHECKING, INLINE_NEW
from loractld.store.known import KNOWN_FILE

ADAPTERS = 4


@pytest.fixture
def store_dir(tmp_path: Path, demo: Path) -> Path:
    """A store of ADAPTERS hand-placed copies of the demo's poet adapter, each of its own content."""
    root = tmp_path / "adapters"
    source = demo / "adapters" / "poet" / "v1"
    for i in range(ADAPTERS):
        folder = root / "hand" / f"a{i}"
        shutil.copytree(source, folder)
        distinct(folder, i)
    return root


def distinct(folder: Path, i: int) -> None:
    """Give the adapter in ``folder`` content of its own: the last float32 of its last tensor
    (a lora_B) set to a small value of ``i``'s, as bench/store_scale.py does."""
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + struct.pack("<f", 0.01 + (i + 1) * 1e-5))


class Counted:
    """Wraps the hashing and the validation of the real store; counts the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hashed = 0
        self.validated = 0
        real_hash = copies._read_hashing

        def hashing(*args):
            self.hashed += 1
            return real_hash(*args)
        monkeypatch.setattr(copies, "_read_hashing", hashing)
        self._monkeypatch = monkeypatch

    def open(self, store_dir: Path, demo: Path, **settings):
        catalog = open_catalog(DaemonSettings(engine=EngineSettings(model="tiny", **settings)), store_dir,
                               str(demo / "model"))
        real_validate = catalog.resolver.validate

        def validate(*args):
            self.validated += 1
            return real_validate(*args)
        catalog.resolver.validate = validate
        return catalog


def _listed(catalog) -> dict:
    adapters = catalog.store.list()
    return {name: (ref.digest, ref.engine_id, str(ref.path))
            for name, ref in catalog.resolver.resolve_listed(adapters).items()}


def test_a_second_start_hashes_and_validates_nothing_and_resolves_the_same(store_dir, demo, monkeypatch):
    counted = Counted(monkeypatch)
    first = counted.open(store_dir, demo)
    answers = _listed(first)
    assert len(answers) == ADAPTERS and counted.hashed == 2 * ADAPTERS and counted.validated == ADAPTERS
    assert first.store.save_known()
    assert not first.store.save_known()   # nothing new: not written again
    counted.hashed = counted.validated = 0

    second = counted.open(store_dir, demo)
    assert _listed(second) == answers
    assert (counted.hashed, counted.validated) == (0, 0)
    # A use resolves through the full path: the same answer from the kept facts.
    assert second.resolver.resolve("hand/a1").digest == answers["hand/a1"][0]
    assert (counted.hashed, counted.validated) == (0, 0)


def test_a_changed_file_or_base_setting_is_hashed_or_validated_again(store_dir, demo, monkeypatch):
    counted = Counted(monkeypatch)
    first = counted.open(store_dir, demo)
    answers = _listed(first)
    first.store.save_known()

    # Rewritten by hand between the runs (another content): hashed and validated again, alone.
    distinct(store_dir / "hand" / "a2", 1000)
    counted.hashed = counted.validated = 0
    second = counted.open(store_dir, demo)
    again = _listed(second)
    assert (counted.hashed, counted.validated) == (2, 1)
    assert again["hand/a2"][0] != answers["hand/a2"][0]
    assert {k: v for k, v in again.items() if k != "hand/a2"} == \
        {k: v for k, v in answers.items() if k != "hand/a2"}
    second.store.save_known()

    # Another rank limit is another fingerprint: every adapter validated again, none hashed.
    counted.hashed = counted.validated = 0
    third = counted.open(store_dir, demo, max_lora_rank=64)
    _listed(third)
    assert (counted.hashed, counted.validated) == (0, ADAPTERS)


def test_a_damaged_or_foreign_file_is_ignored(store_dir, demo, monkeypatch, caplog):
    counted = Counted(monkeypatch)
    answers = _listed(counted.open(store_dir, demo))
    for text in ("{not json", json.dumps({"format": 99, "hand": {}, "facts": {}, "fingerprint": ""})):
        (store_dir / KNOWN_FILE).write_text(text)
        counted.hashed = counted.validated = 0
        assert _listed(counted.open(store_dir, demo)) == answers
        assert (counted.hashed, counted.validated) == (2 * ADAPTERS, ADAPTERS)
    assert "ignoring" in caplog.text and KNOWN_FILE in caplog.text


def test_a_removed_adapter_leaves_the_kept_file(store_dir, demo, monkeypatch):
    counted = Counted(monkeypatch)
    catalog = counted.open(store_dir, demo)
    _listed(catalog)
    catalog.store.save_known()
    shutil.rmtree(store_dir / "hand" / "a0")
    catalog = counted.open(store_dir, demo)
    _listed(catalog)
    assert catalog.store.save_known()   # pruned
    kept = json.loads((store_dir / KNOWN_FILE).read_text())
    assert len(kept["hand"]) == len(kept["facts"]) == ADAPTERS - 1
    assert not any("/a0" in entry["manifest"]["ref"] for entry in kept["hand"].values())


class Listing(DiskOps, TierOps):
    """The core's listing over a catalog, without an engine (as bench/store_scale.py --profile)."""

    tiers = None

    def __init__(self, catalog) -> None:
        self.catalog = catalog
        self.started_up = True   # as after READY: a listing's unchecked names are validated at once
        self._unchecked = []
        self._foreground = 0
        self._warming = None
        self._manifest_views = {}

    async def _wait_catalog(self):
        return self.catalog


def test_a_listing_past_its_deadline_lists_new_content_as_checking_then_validates_it(tmp_path, demo, monkeypatch):
    """More new adapters than a listing validates inline, with its deadline passed at once: the
    first INLINE_NEW are validated, the rest are ``checking``, validated in the background; the
    next listing shows each as it is (one of them invalid: failed)."""
    source = demo / "adapters" / "poet" / "v1"
    root = tmp_path / "adapters"
    count = INLINE_NEW + 6
    for i in range(count):
        folder = root / "many" / f"a{i:03d}"
        shutil.copytree(source, folder)
        distinct(folder, i)
    broken = root / "many" / f"a{count - 1:03d}" / "adapter_config.json"
    broken.write_text(json.dumps({**json.loads(broken.read_text()), "r": 4096}))   # over any rank limit
    monkeypatch.setattr("loractld.core.disk_ops.LISTING_VALIDATION_S", -1.0)
    catalog = open_catalog(DaemonSettings(engine=EngineSettings(model="tiny")), root, str(demo / "model"))
    listing = Listing(catalog)

    async def scenario() -> tuple[list, list]:
        first = await listing.list_adapters()
        assert await listing.checked_in_background()
        return first, await listing.list_adapters()
    first, second = asyncio.run(scenario())
    states = [view.state for view in first]
    assert states[:INLINE_NEW] == ["ready"] * INLINE_NEW
    assert states[INLINE_NEW:] == ["checking"] * (count - INLINE_NEW)
    assert all(view.error == "" and view.tier == "disk" for view in first[INLINE_NEW:])
    assert [view.state for view in second] == ["ready"] * (count - 1) + ["failed"]
    assert "rank" in second[-1].error
    # What the background validation learned is kept for the next start.
    assert len(json.loads((root / KNOWN_FILE).read_text())["facts"]) == count - 1
    assert CHECKING not in catalog.resolver.resolve_listed(catalog.store.list(), deadline=0.0).values()


def test_a_background_validation_waits_while_a_request_holds_it(store_dir, demo, monkeypatch):
    """``warm``'s ``hold``: while it is true (a listing runs: ``DiskOps.in_foreground``), the
    validation thread finishes the adapter in hand and waits; then it goes on to the end."""
    counted = Counted(monkeypatch)
    catalog = counted.open(store_dir, demo)
    held = threading.Event()
    held.set()
    names = [f"hand/a{i}" for i in range(ADAPTERS)]
    thread = threading.Thread(target=catalog.resolver.warm, args=(names, 0.0, held.is_set))
    thread.start()
    try:
        time.sleep(0.5)
        assert counted.validated == 1
    finally:
        held.clear()
        thread.join(30)
    assert counted.validated == ADAPTERS
