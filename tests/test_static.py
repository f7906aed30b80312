"""Checks that need no daemon: generated code is current, the CLI stays light, the fix works."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO


def test_generated_protocol_code_is_current(tmp_path):
    """Regenerated with the pinned generator (gen_proto.py fetches it when this environment has
    another grpcio-tools), the committed code is byte for byte the same."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    for name in ("loractl_pb2.py", "loractl_pb2.pyi", "loractl_grpc.py"):
        fresh = (tmp_path / "loractl" / "v1" / name).read_text()
        committed = (REPO / "loractl" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run python scripts/gen_proto.py"


def test_the_protobuf_floor_is_what_the_gencode_checks():
    """pyproject's protobuf floor equals the runtime version loractl_pb2.py demands at import: a
    higher floor needlessly excludes the GPU host (protobuf < 7), a lower one installs a runtime
    the gencode refuses."""
    gencode = (REPO / "loractl" / "v1" / "loractl_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", gencode).groups()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    protobuf = next(d for d in deps if re.match(r"protobuf\b", d))
    assert re.search(r">=\s*([\d.]+)", protobuf).group(1) == f"{major}.{minor}.{patch}", protobuf


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["status", "--socket", "/tmp/lct-none.sock"]])
def test_cli_never_imports_torch_vllm_or_the_http_stack(argv):
    code = (
        "import sys\n"
        "from loractl.cli.app import app\n"
        f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "               ('torch', 'vllm', 'transformers', 'fastapi', 'uvicorn', 'starlette'))\n"
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


def test_cpu_lora_ops_give_no_adapter_rows_no_delta_and_match_upstream_elsewhere():
    import torch
    from loractld.worker import cpu_fixes
    from vllm.lora.ops.torch_ops import lora_ops

    torch.manual_seed(0)
    slots, rank, hidden, tokens = 3, 4, 8, 6
    x = torch.randn(tokens, hidden)
    a = torch.randn(slots, 1, rank, hidden)
    b = torch.randn(slots, 1, hidden, rank)
    # vLLM's own ops from a fresh copy of their module: an earlier test in this process (a worker
    # runs many files) may have installed loractl's in the imported one.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_upstream_lora_ops", lora_ops.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    upstream = {name: getattr(fresh, name) for name in cpu_fixes.REPLACEMENTS}
    assert all(op is not cpu_fixes.REPLACEMENTS[name] for name, op in upstream.items())  # the originals

    for idx in (torch.tensor([0, -1, 2, -1, 0, 2]), torch.tensor([1] * tokens), torch.tensor([-1] * tokens)):
        with_lora = idx >= 0
        wrong = torch.zeros(tokens, rank)
        upstream["bgmv_shrink"](x, a, wrong, idx, 0.5)
        shrunk = torch.zeros(tokens, rank)
        cpu_fixes.bgmv_shrink(x, a, shrunk, idx, 0.5)
        assert torch.equal(shrunk[~with_lora], torch.zeros(int((~with_lora).sum()), rank))
        torch.testing.assert_close(shrunk[with_lora], wrong[with_lora])

        delta = torch.randn(tokens, rank)
        for name, extra in (("bgmv_expand", (True,)), ("bgmv_expand_slice", (2, hidden, True))):
            base = torch.randn(tokens, hidden + 2)
            ours, theirs = base.clone(), base.clone()
            cpu_fixes.REPLACEMENTS[name](delta, b, ours, idx, *extra)
            upstream[name](delta, b, theirs, idx, *extra)
            assert torch.equal(ours[~with_lora], base[~with_lora]), name  # no delta without an adapter
            torch.testing.assert_close(ours[with_lora], theirs[with_lora])
    # The prefill wrappers: segments of consecutive tokens, one index each, reused across calls
    # (as every layer of a step does) and then changed (the next step): never a stale answer.
    for lora_indices, lens in ((torch.tensor([2, 0]), torch.tensor([4, 2])), (torch.tensor([2, 0]), torch.tensor([4, 2])),
                               (torch.tensor([1, -1, 0]), torch.tensor([1, 3, 2])), (torch.tensor([0]), torch.tensor([6]))):
        meta = (torch.zeros_like(lens), lens, lora_indices, len(lens), int(lens.max()), tokens)
        with_lora = torch.repeat_interleave(lora_indices, lens) >= 0
        ours, theirs = torch.zeros(tokens, rank), torch.zeros(tokens, rank)
        cpu_fixes.sgmv_shrink(x, a, ours, *meta, 0.5)
        upstream["sgmv_shrink"](x, a, theirs, *meta, 0.5)
        torch.testing.assert_close(ours[with_lora], theirs[with_lora])
        assert not ours[~with_lora].any()
        for name, extra in (("sgmv_expand", (True,)), ("sgmv_expand_slice", (2, hidden, True))):
            base = torch.randn(tokens, hidden + 2)
            mine, ref = base.clone(), base.clone()
            getattr(cpu_fixes, name)(delta, b, mine, *meta, *extra)
            upstream[name](delta, b, ref, *meta, *extra)
            torch.testing.assert_close(mine[with_lora], ref[with_lora])
            assert torch.equal(mine[~with_lora], base[~with_lora]), name

    wrong = torch.zeros(2, rank)
    upstream["bgmv_shrink"](x[:2], a, wrong, torch.tensor([0, -1]), 1.0)
    assert wrong[1].abs().sum() > 0  # the upstream bug this fixes: -1 picked up the last slot


def test_demo_build_is_deterministic(demo, tmp_path):
    from loractld.models.tiny import ensure_demo

    rebuilt = ensure_demo(tmp_path / "demo")
    for f in sorted(p for p in demo.rglob("*") if p.is_file()):
        assert (rebuilt / f.relative_to(demo)).read_bytes() == f.read_bytes(), f
