"""Regenerate loractl/v1/*_pb2*.py and *_grpc.py from loractl/v1/loractl.proto.

Usage: python scripts/gen_proto.py [--out DIR]   (default: in place)

The generator is pinned (GENERATOR below, also the test extra's pin): its protoc emits gencode
for protobuf 6.33.5, which protobuf 6.33.5 and later 6.x and 7.x runtimes accept. A newer
grpcio-tools would raise the runtime floor (1.82 and later: protobuf >= 7.35.1), and vLLM 0.26's
nvidia-cutlass-dsl needs protobuf < 7 (tests/test_install_resolves.py). When the environment has
another grpcio-tools, the pinned one is fetched once with pip (that wheel alone, no
dependencies) into a cache folder and run from there. grpclib's protoc plugin is taken from
the bin folder next to this Python.

Exit status 0 when done; 3 when the pinned generator is missing and cannot be fetched.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "loractl/v1/loractl.proto"
GENERATED = ("loractl_pb2.py", "loractl_pb2.pyi", "loractl_grpc.py")
GENERATOR = "1.81.1"  # grpcio-tools: the newest whose protoc emits protobuf 6.x gencode (6.33.5)


class NoGenerator(Exception):
    """The pinned grpcio-tools is neither installed nor fetchable."""


def generator_path() -> str | None:
    """A PYTHONPATH entry holding grpcio-tools GENERATOR, or None when this environment has it."""
    try:
        if importlib.metadata.version("grpcio-tools") == GENERATOR:
            return None
    except importlib.metadata.PackageNotFoundError:
        pass
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loractl"
    target = cache / f"grpcio-tools-{GENERATOR}-py{sys.version_info[0]}{sys.version_info[1]}"
    if (target / "grpc_tools" / "protoc.py").is_file():
        return str(target)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "install", "--quiet",
             "--no-deps", "--only-binary=:all:", "--target", str(tmp), f"grpcio-tools=={GENERATOR}"],
            capture_output=True, text=True)
        if done.returncode:
            reason = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("ERROR")][-1:]
            raise NoGenerator(f"gen_proto: grpcio-tools=={GENERATOR} is not installed and pip could not fetch it"
                              f" ({' '.join(reason) or 'no reason given'}); install it: "
                              f"pip install grpcio-tools=={GENERATOR}")
        os.replace(tmp, target)  # atomic: a half-fetched folder is never taken for the tool
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def generate(out: Path) -> list[Path]:
    """Run the pinned protoc into ``out`` (mirroring the package layout); return the generated files."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    tool = generator_path()
    if tool:
        env["PYTHONPATH"] = tool + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out}", f"--pyi_out={out}",
         f"--grpclib_python_out={out}", PROTO],
        cwd=ROOT, env=env, check=True,
    )
    return [out / "loractl" / "v1" / name for name in GENERATED]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write here instead of in place")
    args = parser.parse_args()
    try:
        if args.out:
            for f in generate(args.out):
                print(f)
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            for f in generate(Path(tmp)):
                shutil.copy(f, ROOT / "loractl" / "v1" / f.name)
                print(ROOT / "loractl" / "v1" / f.name)
    except NoGenerator as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
