"""Adapters placed by hand are served from private copies (``.snapshots/<digest>``, see
loractld/store/copies.py): a copy a request holds is never removed, whatever the budget, and the
budget (bytes) is kept once requests let go. Issue 48: 1,000 hand-placed adapters asked for by 64
clients all failed with "the adapter at .../.snapshots/<digest> was removed meanwhile"."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from pathlib import Path

from adapter_factory import good
from conftest import run_cli, start_daemon, sub_home

ADAPTERS, CLIENTS = 24, 48


def place_by_hand(demo: Path, root: Path, count: int, rank: int = 4) -> list[str]:
    """``count`` adapters of distinct content in the seeds' layout ``hand/aNN`` under ``root``."""
    template = good(demo, root / ".template", name="hand/template", rank=rank)
    weights = (template / "adapter_model.safetensors").read_bytes()
    names = []
    for i in range(count):
        folder = root / "hand" / f"a{i:02d}"
        shutil.copytree(template, folder)
        # The last float32 of the weights: a content (and digest) of its own, still a valid adapter.
        (folder / "adapter_model.safetensors").write_bytes(weights[:-4] + struct.pack("<f", 0.01 + i * 1e-4))
        names.append(f"hand/a{i:02d}")
    shutil.rmtree(template)
    return names


def _store_and_resolver(demo: Path, root: Path, budget: int, grace_s: float):
    from loractld.models.basemodel import describe
    from loractld.store.disk import Store
    from loractld.store.identity import AdapterResolver
    from loractld.store.validate import validate_adapter

    base = describe("tiny", str(demo / "model"))
    store = Store(root, snapshot_budget=budget, snapshot_grace_s=grace_s)
    resolver = AdapterResolver(store, lambda path, force: validate_adapter(
        path, max_lora_rank=16, base_shapes=base.shapes, model_names=base.names, force=force))
    return store, resolver


def test_copies_a_request_holds_outlive_the_budget_and_go_once_released(demo, tmp_path):
    """More requests at once than the budget holds copies, over more adapters than it holds: each
    request resolves and leases as the request path does (resolve off the loop, lease on it,
    core/requests.py) and finds its copy there until it ends; the copies then shrink to the budget."""
    from loractld.store.validate import WEIGHTS_FILE

    root = tmp_path / "adapters"
    names = place_by_hand(demo, root, ADAPTERS)
    one_copy = sum(f.stat().st_size for f in (root / names[0]).iterdir())
    store, resolver = _store_and_resolver(demo, root, budget=3 * one_copy, grace_s=0)
    failures: list[str] = []

    async def request(i: int) -> None:
        name = names[(i * 7) % ADAPTERS]
        try:
            ref = await resolver.resolve_async(name)
            lease = store.lease(ref.path)  # no await since the resolve, as in RequestPath.resolve_model
        except Exception as e:  # noqa: BLE001 - every failure is the finding
            failures.append(f"{name}: {e}")
            return
        try:
            for _ in range(3):   # the request runs; vLLM may (re)load the copy at any step
                await asyncio.sleep(0.01)
                if not (ref.path / WEIGHTS_FILE).is_file():
                    failures.append(f"{name}: its copy went while leased")
                    return
        finally:
            lease.release()

    async def rounds() -> None:
        for _ in range(2):   # the second round asks the resolver's cache, whose copies were trimmed
            await asyncio.gather(*(request(i) for i in range(CLIENTS)))

    asyncio.run(rounds())
    assert not failures, failures[:5]
    # Nothing holds a copy now: the budget is kept again, with at least one copy trimmed.
    store.copies.trim()
    left = [p for p in store.snapshots.iterdir()]
    assert 0 < len(left) <= 3, left
    assert store.copies.overflows > 0   # more were in use at once than the budget holds: said so


def test_listing_many_hand_placed_adapters_copies_none(demo, tmp_path):
    """ls and status resolve every adapter (digest, validation): that reads the folders in place;
    only a request (a lease) makes a copy."""
    root = tmp_path / "adapters"
    names = place_by_hand(demo, root, 6)
    store, resolver = _store_and_resolver(demo, root, budget=1 << 30, grace_s=0)
    resolver.warm([a.name for a in store.list()])
    refs = [resolver.resolve(n) for n in names]
    assert len({r.digest for r in refs}) == 6 and not any(store.snapshots.iterdir())
    lease = store.lease(refs[0].path)
    assert [p.name for p in store.snapshots.iterdir()] == [refs[0].digest]
    lease.release()


def test_a_daemon_serves_more_hand_placed_adapters_at_once_than_its_copy_budget(home, demo):
    """The real daemon (tiny model, vLLM on the CPU), its copies' budget lowered to about three
    adapters: 48 concurrent requests over 24 hand-placed adapters all answer."""
    from loractl.client import Client

    sub = sub_home(home, "copies")
    names = place_by_hand(demo, sub / "adapters", ADAPTERS)
    one_copy = sum(f.stat().st_size for f in (sub / "adapters" / names[0]).iterdir())
    daemon = start_daemon(sub, "--snapshot-budget", str(3 * one_copy))
    try:
        async def ask(i: int) -> str:
            text = []
            async for chunk in Client(daemon.socket).generate("hi", lora=names[i % ADAPTERS], max_tokens=4,
                                                              temperature=0):
                text.append(chunk.get("text", "") if isinstance(chunk, dict) else "")
            return "".join(text)

        async def all_at_once():
            return await asyncio.gather(*(ask(i) for i in range(CLIENTS)), return_exceptions=True)

        answers = asyncio.run(all_at_once())
        failed = [a for a in answers if isinstance(a, BaseException)]
        assert not failed, failed[:3]
        listed = json.loads(run_cli("ls", "--json", "--socket", str(daemon.socket)).stdout)
        assert {a["name"]: a["state"] for a in listed} == {n: "ready" for n in names}
    finally:
        daemon.stop()


def test_a_stat_key_is_packed_and_records_the_files_size(tmp_path):
    # The key a store of 10,000 keeps several of per adapter: bytes, not nested tuples of ints
    # (20 MiB less in-process at 10,000, docs/benchmarks.md), and what the size cap reads.
    from loractld.store.copies import stat_key, stat_key_size

    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w" * 1000)
    key = stat_key(tmp_path)
    assert isinstance(key, bytes) and stat_key_size(key) == 8 + 1000
    assert stat_key(tmp_path) == key
    (tmp_path / "adapter_model.safetensors").write_bytes(b"v" * 1001)
    assert stat_key(tmp_path) != key and stat_key_size(stat_key(tmp_path)) == 1009
    (tmp_path / "adapter_config.json").unlink()
    assert stat_key(tmp_path) is None
