"""Checks that need no daemon: generated code is current, the CLI stays light, the fix works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def test_generated_protocol_code_is_current(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True)
    for name in ("loractl_pb2.py", "loractl_pb2.pyi", "loractl_grpc.py"):
        fresh = (tmp_path / "loractl" / "v1" / name).read_text()
        committed = (REPO / "loractl" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run python scripts/gen_proto.py"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["status", "--socket", "/tmp/lct-none.sock"]])
def test_cli_never_imports_torch_or_vllm(argv):
    code = (
        "import sys\n"
        "from loractl.cli.app import app\n"
        f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "HEAVY []" in out, out


def test_the_ls_fast_path_never_imports_typer_torch_or_vllm(daemon):
    code = (
        "import sys\n"
        f"sys.argv = ['loractl', 'ls', '--json', '--socket', {str(daemon.socket)!r}]\n"
        "from loractl.cli import main\n"
        "main()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers', 'typer'))\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


def test_masked_lora_ops_zero_the_no_adapter_rows():
    import torch
    from loractld.cpu_fixes import _masked
    from vllm.lora.ops.torch_ops import lora_ops

    torch.manual_seed(0)
    slots, rank, hidden, tokens = 2, 4, 8, 5
    x = torch.randn(tokens, hidden)
    a = torch.randn(slots, 1, rank, hidden)
    b = torch.randn(slots, 1, hidden, rank)
    idx = torch.tensor([0, -1, 1, -1, 0])
    original = getattr(lora_ops.bgmv_shrink, "__wrapped__", lora_ops.bgmv_shrink)
    original_expand = getattr(lora_ops.bgmv_expand, "__wrapped__", lora_ops.bgmv_expand)

    wrong = torch.zeros(tokens, rank)
    original(x, a, wrong, idx, 1.0)
    assert wrong[1].abs().sum() > 0  # the upstream bug: -1 picked up the last slot

    shrunk = torch.zeros(tokens, rank)
    _masked(original)(x, a, shrunk, idx, 1.0)
    assert torch.equal(shrunk[[1, 3]], torch.zeros(2, rank))
    assert torch.equal(shrunk[[0, 2, 4]], wrong[[0, 2, 4]])

    base = torch.randn(tokens, hidden)
    out = base.clone()
    _masked(original_expand)(torch.randn(tokens, rank), b, out, idx, True)
    assert torch.equal(out[[1, 3]], base[[1, 3]])  # no delta for tokens without an adapter


def test_demo_build_is_deterministic(demo, tmp_path):
    from loractld.demo import ensure_demo

    rebuilt = ensure_demo(tmp_path / "demo")
    for f in sorted(p for p in demo.rglob("*") if p.is_file()):
        assert (rebuilt / f.relative_to(demo)).read_bytes() == f.read_bytes(), f
