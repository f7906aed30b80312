"""``--max-lora-rank`` from the installed set (issue 48, item 3): without the flag, the daemon
serves the store's largest adapter instead of refusing it, never goes below 16, and names the
outlier that pads every slot."""

from __future__ import annotations

import json

from adapter_factory import edit_config, good
from conftest import ENGINE_FLAGS, run_cli, start_daemon, sub_home

from loractld.store import rank_limit
from loractld.store.disk import StoredAdapter


def _stored(tmp_path, ranks: dict[str, int], pattern: dict[str, dict] | None = None) -> list[StoredAdapter]:
    found = []
    for name, r in ranks.items():
        folder = tmp_path / name
        folder.mkdir(parents=True)
        config = {"peft_type": "LORA", "r": r, "rank_pattern": (pattern or {}).get(name, {})}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        found.append(StoredAdapter(name, folder, {"files": []}, True))
    return found


def test_the_limit_covers_the_largest_and_never_drops_below_16(tmp_path):
    assert rank_limit.from_store([], None) == rank_limit.RankLimit(16)
    assert rank_limit.from_store(_stored(tmp_path / "a", {"a": 4, "b": 8}), None).rank == 16
    # A rank_pattern's largest counts; the next rank vLLM supports is taken.
    limit = rank_limit.from_store(_stored(tmp_path / "b", {"a": 8, "b": 8}, {"b": {"q_proj": 40}}), None)
    assert limit.rank == 64 and limit.outlier is None    # half the adapters: not an outlier
    # A rank the user gave wins, whatever the store holds.
    assert rank_limit.from_store(_stored(tmp_path / "c", {"a": 64}), 8).rank == 8


def test_a_few_large_adapters_are_named_as_the_outlier(tmp_path):
    ranks = {f"small{i}": 8 for i in range(19)} | {"wide": 64}
    limit = rank_limit.from_store(_stored(tmp_path, ranks), None)
    assert limit.rank == 64
    assert "wide (rank 64)" in limit.outlier and "the other 19 of 20 adapters need 16" in limit.outlier
    assert "--max-lora-rank 16" in limit.outlier


def test_an_unreadable_config_is_skipped_here(tmp_path):
    stored = _stored(tmp_path, {"a": 8, "b": 32})
    (stored[1].path / "adapter_config.json").write_text("{not json")
    assert rank_limit.from_store(stored, None).rank == 16


def test_a_daemon_without_the_flag_serves_a_placed_rank_64_adapter(home, demo, reference):
    root = sub_home(home, "rank-limit")
    store = root / "adapters"
    for i in range(10):
        good(demo, store / "small" / f"v{i}", rank=8)
    wide = edit_config(good(demo, store / "wide" / "v1", rank=64), lora_alpha=32)
    at = ENGINE_FLAGS.index("--max-lora-rank")
    flags = ENGINE_FLAGS[:at] + ENGINE_FLAGS[at + 2:]
    daemon = start_daemon(root, engine_flags=flags)
    try:
        status = json.loads(run_cli("status", "--json", "--socket", str(daemon.socket)).stdout)
        assert status["capacity"]["max_lora_rank"] == 64, status["capacity"]
        log = daemon.log.read_text()
        assert "wide/v1 (rank 64) force it up" in log and "the other 10 of 11 adapters need 16" in log, log
        answer = run_cli("run", "--lora", "wide/v1", "-t", "0", "-n", "8", "hello", "--socket", str(daemon.socket))
        assert answer.returncode == 0, answer.stderr
        expected = reference.text(reference.greedy(reference.chat_ids("hello"), wide, 8))
        assert answer.stdout == expected + "\n"
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
