"""Regenerate loractl/v1/*_pb2*.py and *_grpc.py from loractl/v1/loractl.proto.

Usage: python scripts/gen_proto.py [--out DIR]   (default: in place)

Needs grpcio-tools (the test extra) and grpclib's protoc plugin, which sits next to this
Python in the virtual environment's bin folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "loractl/v1/loractl.proto"
GENERATED = ("loractl_pb2.py", "loractl_pb2.pyi", "loractl_grpc.py")


def generate(out: Path) -> list[Path]:
    """Run protoc into ``out`` (mirroring the package layout); return the generated files."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out}", f"--pyi_out={out}",
         f"--grpclib_python_out={out}", PROTO],
        cwd=ROOT, env=env, check=True,
    )
    return [out / "loractl" / "v1" / name for name in GENERATED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write here instead of in place")
    args = parser.parse_args()
    if args.out:
        for f in generate(args.out):
            print(f)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            shutil.copy(f, ROOT / "loractl" / "v1" / f.name)
            print(ROOT / "loractl" / "v1" / f.name)


if __name__ == "__main__":
    main()
