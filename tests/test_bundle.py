"""scripts/bundle.py: the offline-install bundle, end to end on tiny pure-Python wheels.

Builds real bundles from the package index through pip (rich 13.9.4 and its pure-Python
dependencies, for a Python 3.12 manylinux target), installs them with the copy of bundle.py that
travels with the parts, imports the result, and breaks the parts in the ways a transfer does.
No vLLM is downloaded. The index must be reachable: a build failure fails the test, it never skips.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bundle.py"
TARGET = ["--python-version", "3.12", "--platform", "manylinux_2_28_x86_64"]


def load_bundle():
    """scripts/bundle.py as a module (it is a script, not part of the package)."""
    if "loractl_bundle_script" in sys.modules:
        return sys.modules["loractl_bundle_script"]
    spec = importlib.util.spec_from_file_location("loractl_bundle_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def build(out: Path, *args: str) -> dict:
    done = run(SCRIPT, "build", "--out", str(out), *TARGET, *args)
    assert done.returncode == 0, (
        "bundle.py build failed; it needs the package index through pip "
        f"(check `pip download rich==13.9.4`):\n{done.stdout}{done.stderr}")
    return json.loads((out / "MANIFEST.json").read_text())


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The error and hint lines: stderr minus warnings."""
    return [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    # pygments is "on the target": rich needs it, so it is skipped; markdown-it-py and mdurl are not.
    out = tmp_path_factory.mktemp("bundles") / "rich"
    return out, build(out, "--have-pkg", "pygments==2.18.0", "--max-part-size", "64KiB", "rich==13.9.4")


@pytest.fixture(scope="module")
def other_build(tmp_path_factory) -> Path:
    """A second, different build with many small parts."""
    out = tmp_path_factory.mktemp("bundles") / "mdurl"
    build(out, "--max-part-size", "1KiB", "mdurl==0.1.2")
    return out


@pytest.fixture
def bundle(built, tmp_path) -> Path:
    """A private copy of the built bundle folder, as it arrives on the target."""
    copy = tmp_path / "transfer"
    shutil.copytree(built[0], copy)
    return copy


def test_build_bundles_what_the_target_lacks(built):
    out, manifest = built
    names = {d["name"]: d["version"] for d in manifest["distributions"]}
    assert names["rich"] == "13.9.4"
    assert {"rich", "markdown-it-py", "mdurl"} == set(names), names
    # skipped: on the target already
    assert "pygments" not in names and manifest["skipped"]["pygments"]["version"] == "2.18.0"
    # rich needs typing-extensions only on python_version < "3.11": not for a 3.12 target
    assert "typing-extensions" not in names and "typing-extensions" not in manifest["skipped"]
    assert manifest["target"] == {"python_version": "3.12", "implementation": "cp",
                                  "platforms": ["manylinux_2_28_x86_64"]}
    parts = manifest["parts"]
    assert len(parts) >= 3, parts
    assert [p["name"] for p in parts] == [f"bundle.tar.xz.part{i:03d}" for i in range(len(parts))]
    assert all(0 < p["bytes"] <= 64 * 1024 for p in parts)
    assert sorted(p.name for p in out.glob("bundle.tar.xz.part*")) == [p["name"] for p in parts]
    assert sum(p["bytes"] for p in parts) == manifest["archive"]["bytes"] == manifest["sizes"]["packed"]
    assert (out / "bundle.py").read_bytes() == SCRIPT.read_bytes()
    assert manifest["env"] == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # no vllm: no vLLM vars
    assert manifest["trim"] == {"preset": "vllm-text", "removed": []}
    assert manifest["sizes"]["unpacked"] > manifest["sizes"]["packed"] > 0
    assert not list(out.glob("*.whl")) and not (out / "bundle.tar.xz").exists()


def test_install_imports_the_bundle(bundle, tmp_path):
    prefix = tmp_path / "prefix"
    # The copy of bundle.py that travels with the parts installs them; no network is used.
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(prefix))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "self-check passed" in done.stdout
    assert "built for Python 3.12" in done.stderr  # this venv is 3.11: a warning, not an error
    env_sh = (prefix / "env.sh").read_text()
    assert f"export PYTHONPATH={prefix}" in env_sh and "export HF_HUB_OFFLINE=1" in env_sh

    code = ("import importlib.metadata as m, rich, markdown_it, mdurl; "
            "print(rich.__file__); print(m.version('rich'), m.version('markdown-it-py'))")
    shown = subprocess.run(["bash", "-c", f"source {prefix}/env.sh && {sys.executable} -c \"{code}\""],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    file, versions = shown.stdout.split("\n")[:2]
    assert Path(file).is_relative_to(prefix)
    assert versions.split()[0] == "13.9.4"

    again = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(prefix), "--no-self-check")
    assert again.returncode == 1 and "exists and is not empty" in again.stderr
    forced = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(prefix), "--force",
                 "--self-check", f"{sys.executable} -c 'import rich.console, os; print(os.environ[\"TRANSFORMERS_OFFLINE\"])'")
    assert forced.returncode == 0 and "self-check passed: 1" in forced.stdout, forced.stdout + forced.stderr


def test_failed_self_check_is_one_line_with_a_hint(bundle, tmp_path):
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(tmp_path / "p"),
               "--self-check", f"{sys.executable} -c 'import not_a_module_anywhere'")
    lines = error_lines(done)
    assert done.returncode == 2
    assert lines[0].startswith("bundle.py install: error: self-check failed (exit 1): ModuleNotFoundError"), lines
    assert lines[1].startswith("  hint: ") and len(lines) == 2


def test_corrupt_part_is_named(bundle, tmp_path):
    part = bundle / "bundle.tar.xz.part001"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(tmp_path / "p"))
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 2, done.stderr
    assert "part bundle.tar.xz.part001" in lines[0] and "corrupt" in lines[0]
    assert lines[1].startswith("  hint: copy bundle.tar.xz.part001 again")
    assert not (tmp_path / "p").exists()
    assert run(bundle / "bundle.py", "verify", str(bundle)).returncode == 1


def test_truncated_part_is_named(bundle, tmp_path):
    part = bundle / "bundle.tar.xz.part000"
    part.write_bytes(part.read_bytes()[:-10])
    done = run(bundle / "bundle.py", "verify", str(bundle))
    assert done.returncode == 1
    assert "bundle.tar.xz.part000" in done.stderr and "MANIFEST.json expects 65536" in done.stderr


def test_missing_part_is_named(bundle, tmp_path):
    (bundle / "bundle.tar.xz.part002").unlink()
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(tmp_path / "p"))
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 2, done.stderr
    assert "missing part bundle.tar.xz.part002" in lines[0]
    assert "hint: copy bundle.tar.xz.part002" in lines[1]


def test_missing_manifest(bundle, tmp_path):
    (bundle / "MANIFEST.json").unlink()
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(tmp_path / "p"))
    assert done.returncode == 1 and "MANIFEST.json is missing" in done.stderr and "hint:" in done.stderr


def test_part_from_another_build(bundle, other_build, tmp_path):
    shutil.copy(other_build / "bundle.tar.xz.part001", bundle / "bundle.tar.xz.part001")
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(tmp_path / "p"))
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 2, done.stderr
    assert "bundle.tar.xz.part001" in lines[0] and "from another build" in lines[0]


def test_extra_part_from_a_bigger_build(bundle, other_build, tmp_path):
    extra = sorted(other_build.glob("bundle.tar.xz.part*"))[-1]
    assert not (bundle / extra.name).exists(), "the other build should have more parts than the rich one"
    shutil.copy(extra, bundle / extra.name)
    done = run(bundle / "bundle.py", "install", str(bundle), "--prefix", str(tmp_path / "p"))
    assert done.returncode == 1
    assert extra.name in done.stderr and "two different builds" in done.stderr


def test_manifest_of_another_build(bundle, other_build, tmp_path):
    shutil.copy(other_build / "MANIFEST.json", bundle / "MANIFEST.json")
    done = run(bundle / "bundle.py", "verify", str(bundle))
    # the other build has more parts than these: the first one it lacks is named
    assert done.returncode == 1 and "missing part bundle.tar.xz.part004" in done.stderr, done.stderr


def test_a_version_without_a_wheel_is_one_clear_line(tmp_path):
    done = run(SCRIPT, "build", "--out", str(tmp_path / "out"), *TARGET, "rich==0.0.1")
    lines = error_lines(done)
    assert done.returncode == 1, done.stdout + done.stderr
    assert lines[0].startswith("bundle.py build: error: no wheel of rich==0.0.1 for cp312"), lines
    assert "(versions with a wheel there: " in lines[0] and "15.0.0" in lines[0]  # what does exist
    assert lines[1].startswith("  hint: ") and len(lines) == 2


def test_build_refuses_to_mix_into_an_existing_bundle(built, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built[0], out)
    done = run(SCRIPT, "build", "--out", str(out), *TARGET, "mdurl==0.1.2")
    assert done.returncode == 1 and "already holds a bundle" in done.stderr and "--force" in done.stderr


def test_trim_preset_on_a_fake_stage(tmp_path):
    bundle = load_bundle()
    files = {
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": 300,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": 200,
        "vllm/vllm_flash_attn/__init__.py": 10,
        "vllm/_moe_C_stable_libtorch.abi3.so": 100,
        "vllm/_C_stable_libtorch.abi3.so": 50,
        "vllm/vllm-rs": 40,
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": 7,
        "vllm/third_party/deep_gemm/include/x.hpp": 3,
        "vllm/third_party/flashmla/keep.py": 1,
        "vllm/__init__.py": 1,
        "pydantic/__init__.py": 1,
    }
    for rel, size in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * size)
    assert bundle.apply_trim(tmp_path, "none") == []
    removed = bundle.apply_trim(tmp_path, "vllm-text")  # the default keeps FA2 (non-Hopper GPUs, ALiBi)
    assert {r["path"]: r["bytes"] for r in removed} == {
        "vllm/_moe_C_stable_libtorch.abi3.so": 100,
        "vllm/vllm-rs": 40,
        "vllm/third_party/deep_gemm": 10,
    }  # fmha_sm100 is absent: nothing to remove, no error
    kept = ["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm_flash_attn/__init__.py",
            "vllm/_C_stable_libtorch.abi3.so", "vllm/third_party/flashmla/keep.py", "vllm/__init__.py",
            "pydantic/__init__.py"]
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted([*kept, "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"])
    assert bundle.apply_trim(tmp_path, "vllm-text") == []  # idempotent
    removed = bundle.apply_trim(tmp_path, "vllm-text-hopper")  # opt-in: FA2 too
    assert {r["path"]: r["bytes"] for r in removed} == {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": 300}
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == sorted(kept)


def test_markers_are_evaluated_for_the_target_not_this_interpreter():
    bundle = load_bundle()
    Requirement = bundle._packaging()[0]
    env = bundle.marker_environment("3.12", ["manylinux_2_28_x86_64"], "cp")
    assert env["python_version"] == "3.12" and env["platform_machine"] == "x86_64"

    def applies(text, extras=()):
        return bundle.marker_applies(Requirement(text), env, set(extras))

    assert applies('six; python_version > "3.11"')  # false for this 3.11 interpreter
    assert not applies('typing-extensions; python_version < "3.11"')
    assert applies('llguidance; platform_machine == "x86_64" or platform_machine == "aarch64"')
    assert not applies('pywin32; sys_platform == "win32"')
    assert not applies('pandas; extra == "bench"')
    assert applies('pandas; extra == "bench"', ["bench"])
    arm = bundle.marker_environment("3.12", ["manylinux_2_17_aarch64"], "cp")
    assert arm["platform_machine"] == "aarch64"


def test_platform_tags_expand_to_older_glibc():
    bundle = load_bundle()
    tags = bundle.expand_platforms(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_31_x86_64" not in tags and len(tags) == len(set(tags))


def test_sizes_parse():
    bundle = load_bundle()
    assert bundle.parse_size("40MiB") == 40 << 20
    assert bundle.parse_size("64KiB") == 65536
    assert bundle.parse_size("40MB") == 40_000_000
    assert bundle.parse_size("2048") == 2048
    with pytest.raises(Exception):
        bundle.parse_size("lots")


def test_install_checks_free_space_first(bundle, tmp_path, monkeypatch, capsys):
    mod = load_bundle()
    monkeypatch.setattr(mod.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1024))
    assert mod.main(["install", str(bundle), "--prefix", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert "error: not enough space under" in err and "hint:" in err
    assert not (tmp_path / "p").exists()


def test_disk_full_while_unpacking_cleans_up(bundle, tmp_path, monkeypatch, capsys):
    mod = load_bundle()

    def full(paths, dest, manifest):
        (dest / "half-written").write_bytes(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mod, "unpack", full)
    assert mod.main(["install", str(bundle), "--prefix", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert "error: no space left on device while unpacking into" in err and "hint:" in err
    assert list(tmp_path.iterdir()) == [bundle]  # neither the prefix nor a partial folder is left
