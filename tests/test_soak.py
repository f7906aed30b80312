"""A short soak (bench/soak.py): load/evict/pin/unpin/rm cycles over more adapters than slots,
with concurrent generation; no failed request, no wrong output, and RSS that does not keep
growing (the last sample against the first, after the caches have filled)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_short_soak_has_no_failures_no_wrong_outputs_and_bounded_rss(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--cycles", "300", "--checkpoints", "50",
                           "--clients", "8", "--kv-cache", "64MiB", "--check-growth", "64", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["wrong_outputs"] == []
    assert result["answered"] > 50 and sum(result["operations"].values()) == 300
    assert {"rm", "pin", "unpin", "load-device", "evict-host"} <= set(result["operations"])
    first, last = result["checkpoints"][0], result["checkpoints"][-1]
    assert first["cycle"] == 50 and last.get("settled")
    assert last["daemon"]["fds"] <= first["daemon"]["fds"] + 8, "file descriptors leak"
