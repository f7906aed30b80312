#!/usr/bin/env python3
"""Offline-install bundles: vLLM + loractl for an air-gapped GPU host, in transferable parts.

    build    on a machine that reaches the package index: download the wheels the target lacks,
             unpack them into one tree, trim what a text-only run does not need, pack it with
             xz and split it into parts of at most --max-part-size bytes, plus MANIFEST.json
             and a copy of this script.
    verify   check every part against MANIFEST.json (sizes, sha256), nothing else.
    install  on the target, no network: verify, reassemble, unpack into --prefix, write
             PREFIX/env.sh and PREFIX/bin wrappers, run a self-check.

Standard library only; the build calls pip as a subprocess and reads requirement markers with
the ``packaging`` library that pip vendors. See docs/offline-install.md.
"""

from __future__ import annotations

import argparse
import configparser
import email.parser
import errno
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1
ARCHIVE = "bundle.tar.xz"
PART_PREFIX = ARCHIVE + ".part"
MANIFEST = "MANIFEST.json"
SELF_NAME = "bundle.py"
REPO = Path(__file__).resolve().parent.parent
# "." is this repository, built with pip wheel --no-deps. uvicorn serves loractld --http; vLLM
# brings it only through fastapi[standard], an extra the vllm-text preset drops. The last four
# are what vLLM 0.26's own OpenAI server (the benchmarks' baseline, scripts/gpu_check.sh) imports
# beyond the text engine: found by walking its module-level imports, and the server ran with
# them on an H200 (docs/benchmarks.md, "The first GPU lease").
DEFAULT_REQUIREMENTS = ["vllm==0.26.0", ".", "uvicorn", "model-hosting-container-standards", "watchfiles",
                        "prometheus-fastapi-instrumentator", "python-multipart"]
CHUNK = 1 << 20

# What a text-only run on Hopper does not need from the vllm wheel (see docs/offline-install.md).
# Globs relative to the unpacked tree; only what exists is removed.
_TEXT_TRIM = [
    ("vllm/_moe_C_stable_libtorch*", "fused-MoE kernels; needed by MoE models only"),
    ("vllm/vllm-rs", "Rust front-end binary; the Python engine does not use it"),
    ("vllm/third_party/deep_gemm", "DeepGEMM FP8 kernels; vLLM falls back without them"),
    ("vllm/third_party/fmha_sm100", "Blackwell (SM100) attention kernels; unused on Hopper"),
]
# FlashAttention-2 stays in the default: vLLM 0.26 picks FA2 on every GPU that is not Hopper or
# Blackwell (Ampere, Ada: most workstations), and on Hopper for what FA3 cannot run (ALiBi), read
# in vllm/v1/attention/backends/fa_utils.py:get_flash_attn_version. Dropping it is an opt-in.
TRIM_PRESETS: dict[str, list[tuple[str, str]]] = {
    "none": [],
    "vllm-text": _TEXT_TRIM,
    "vllm-text-hopper": [
        ("vllm/vllm_flash_attn/_vllm_fa2_C*", "FlashAttention-2 kernels; Hopper runs FA3 (_vllm_fa3_C stays), "
         "except for ALiBi models"),
        *_TEXT_TRIM,
    ],
}
DEFAULT_TRIM = "vllm-text"

# Which of a distribution's own requirements are followed. "all": every one (what pip would
# install). "vllm-text": for vllm, only the small set that importing the engine, worker,
# attention, LoRA and llama/qwen model code needs (plus small optional extras), with extras
# dropped (fastapi[standard] -> fastapi); every other distribution is walked in full.
VLLM_TEXT_DEPS = {
    "pydantic", "pyzmq", "msgspec", "cbor2", "pybase64", "cachetools", "openai", "openai-harmony",
    "llguidance", "xgrammar", "apache-tvm-ffi", "fastapi", "starlette", "partial-json-parser",
    # small optional extras
    "blake3", "setproctitle", "depyf", "compressed-tensors", "lark", "ijson",
}
DEPS_PRESETS: dict[str, dict[str, set[str]]] = {
    "all": {},
    "vllm-text": {"vllm": VLLM_TEXT_DEPS},
}

BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


class BundleError(Exception):
    """A failure the user can act on: one line, plus a hint."""

    def __init__(self, message: str, hint: str | None = None, code: int = 1):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code
        self.versions: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def canon(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def mib(n: int) -> str:
    """A size for people: KiB below 1 MiB, else MiB."""
    return f"{n / 1024:.1f} KiB" if n < (1 << 20) else f"{n / (1 << 20):.1f} MiB"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 40MiB, 64KiB, 2000000)")
    number, unit, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
    base = 1000 if suffix == "b" and unit else 1024  # MB = 10^6, MiB / M = 2^20
    value = int(number * base ** "_kmgt".index(unit)) if unit else int(number)
    if value < 1024:
        raise argparse.ArgumentTypeError(f"part size {text!r} is too small (at least 1KiB)")
    return value


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def no_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


# --------------------------------------------------------------------------------------------
# Requirements, markers, versions (build side only)
# --------------------------------------------------------------------------------------------

def _packaging():
    """(Requirement, SpecifierSet, Version, InvalidRequirement, InvalidVersion) from packaging."""
    try:
        from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.version import InvalidVersion, Version
    except ImportError:
        try:
            from packaging.requirements import InvalidRequirement, Requirement
            from packaging.specifiers import SpecifierSet
            from packaging.version import InvalidVersion, Version
        except ImportError:
            raise BundleError(f"{sys.executable} has neither pip nor packaging",
                              "run the build with a Python that has pip (python -m ensurepip)") from None
    return Requirement, SpecifierSet, Version, InvalidRequirement, InvalidVersion


def platform_facts(platform: str) -> tuple[str, str, str, str]:
    """(platform_machine, sys_platform, platform_system, os_name) for a wheel platform tag."""
    m = re.fullmatch(r"(?:many|musl)?linux(?:_\d+_\d+|1|2010|2014)?_(.+)", platform)
    if m:
        return m.group(1), "linux", "Linux", "posix"
    m = re.fullmatch(r"macosx_\d+_\d+_(.+)", platform)
    if m:
        return m.group(1), "darwin", "Darwin", "posix"
    windows = {"win32": "x86", "win_amd64": "AMD64", "win_arm64": "ARM64"}
    if platform in windows:
        return windows[platform], "win32", "Windows", "nt"
    raise BundleError(f"unknown platform tag {platform!r}",
                      "use a wheel platform tag such as manylinux_2_28_x86_64 or manylinux_2_17_aarch64")


def expand_platforms(platforms: list[str]) -> list[str]:
    """Add the older tags a glibc/musl-versioned tag accepts (pip < 24 does not expand them):
    manylinux_2_28_x86_64 also takes manylinux_2_27 ... manylinux_2_5 and the legacy aliases
    manylinux2014 / manylinux2010 / manylinux1 of the same machine."""
    legacy = {"2014": 17, "2010": 12, "1": 5}
    out: list[str] = []
    for tag in platforms:
        expanded = [tag]
        m = re.fullmatch(r"manylinux(2014|2010|1)_(.+)", tag)
        if m:
            tag = f"manylinux_2_{legacy[m.group(1)]}_{m.group(2)}"
        m = re.fullmatch(r"(manylinux|musllinux)_(\d+)_(\d+)_(.+)", tag)
        if m and m.group(1) == "manylinux" and m.group(2) == "2":
            arch = m.group(4)
            lowest = 5 if arch in ("x86_64", "i686") else 17
            for minor in range(int(m.group(3)), lowest - 1, -1):
                expanded.append(f"manylinux_2_{minor}_{arch}")
                expanded += [f"manylinux{alias}_{arch}" for alias, at in legacy.items() if at == minor]
        elif m and m.group(1) == "musllinux":
            expanded += [f"musllinux_{m.group(2)}_{minor}_{m.group(4)}" for minor in range(int(m.group(3)), -1, -1)]
        out += [t for t in dict.fromkeys(expanded) if t not in out]
    return out


def marker_environment(python_version: str, platforms: list[str], implementation: str) -> dict[str, str]:
    facts = {platform_facts(p) for p in platforms}
    if len({f[0] for f in facts}) > 1 or len({f[1] for f in facts}) > 1:
        raise BundleError(f"--platform values name different machines: {', '.join(platforms)}",
                          "a bundle targets one machine; pass tags of one OS and architecture")
    machine, sys_platform, system, os_name = facts.pop()
    full = python_version if python_version.count(".") >= 2 else python_version + ".0"
    impl_name = {"cp": "cpython", "pp": "pypy"}.get(implementation, implementation)
    return {
        "implementation_name": impl_name,
        "implementation_version": full,
        "os_name": os_name,
        "platform_machine": machine,
        "platform_python_implementation": {"cpython": "CPython", "pypy": "PyPy"}.get(impl_name, impl_name),
        "platform_release": "",
        "platform_system": system,
        "platform_version": "",
        "python_full_version": full,
        "python_version": ".".join(full.split(".")[:2]),
        "sys_platform": sys_platform,
        "extra": "",
    }


def marker_applies(req, env: dict[str, str], extras: set[str]) -> bool:
    """Whether ``req``'s marker holds on the target, for the base install or any requested extra."""
    if req.marker is None:
        return True
    for extra in {""} | extras:
        for spelling in {extra, canon(extra)}:
            try:
                if req.marker.evaluate(dict(env, extra=spelling)):
                    return True
            except Exception:  # an undefined marker variable: treat as not applying
                return False
    return False


@dataclass
class Dist:
    name: str            # canonical
    display: str         # as the wheel spells it
    version: str
    wheel: Path
    requires: list[str]
    top_level: list[str]
    local: bool = False  # built or given locally: never re-downloaded


@dataclass
class Want:
    specs: list[tuple[str, str, str | None]] = field(default_factory=list)  # (specifier, by, by name)
    extras: set[str] = field(default_factory=set)
    url: str | None = None
    display: str = ""


def read_wheel(path: Path) -> Dist:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            metas = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if len(metas) != 1:
                raise BundleError(f"{path.name}: not a wheel (no single *.dist-info/METADATA)",
                                  "pass a .whl file built by pip wheel or a build backend")
            meta = email.parser.BytesParser().parsebytes(zf.read(metas[0]), headersonly=True)
    except zipfile.BadZipFile:
        raise BundleError(f"{path.name}: not a wheel (not a zip file)", "delete it and build again") from None
    top: set[str] = set()
    for n in names:
        parts = n.split("/")
        if parts[0].endswith((".dist-info", ".data")):
            if len(parts) > 3 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                parts = parts[2:]
            else:
                continue
        head = parts[0]
        if len(parts) == 1:
            head = head.split(".")[0] if head.endswith((".py", ".so", ".pyd")) else ""
        if head.isidentifier():
            top.add(head)
    return Dist(name=canon(meta["Name"]), display=meta["Name"], version=meta["Version"], wheel=path,
                requires=meta.get_all("Requires-Dist") or [], top_level=sorted(top))


def read_have(files: list[str], pkgs: list[str]) -> dict[str, str | None]:
    """What the target already has: normalised name -> version (None when unknown)."""
    have: dict[str, str | None] = {}
    for file in files:
        try:
            lines = Path(file).read_text().splitlines()
        except OSError as exc:
            raise BundleError(f"cannot read --have {file}: {exc.strerror}",
                              "on the target run: python -m pip freeze > freeze.txt, and copy it here") from None
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:===?\s*(\S+)|@\s*\S.*)?", line)
            if not m:
                warn(f"{file}:{number}: ignored (not name==version): {line}")
                continue
            have[canon(m.group(1))] = m.group(2)
    for pkg in pkgs:
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:===?\s*(\S+))?\s*", pkg)
        if not m:
            raise BundleError(f"--have-pkg {pkg!r} is not NAME==VERSION", "e.g. --have-pkg torch==2.11.0+cu130")
        have[canon(m.group(1))] = m.group(2)
    return have


# --------------------------------------------------------------------------------------------
# pip
# --------------------------------------------------------------------------------------------

def pip_base() -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


def run_pip(args: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(pip_base() + args, capture_output=True, text=True)
    except OSError as exc:
        raise BundleError(f"cannot run pip for {what}: {exc.strerror}", "install pip: python -m ensurepip") from None
    if done.returncode and "No module named pip" in done.stderr:
        raise BundleError(f"{sys.executable} has no pip", "install it: python -m ensurepip")
    return done


def pip_failure(done: subprocess.CompletedProcess, target: str) -> BundleError:
    """One line from pip's output that says what went wrong, with a hint."""
    text = done.stdout + "\n" + done.stderr
    errors = [ln.strip()[len("ERROR: "):] for ln in text.splitlines() if ln.strip().startswith("ERROR: ")]
    offline = re.search(r"NewConnectionError|Failed to establish|Name or service not known|"
                        r"Temporary failure in name resolution|Network is unreachable|ConnectTimeout|"
                        r"Read timed out|SSLError|ProxyError", text)
    m = re.search(r"Could not find a version that satisfies the requirement (\S+) \(from versions: ([^)]*)\)", text)
    if m:
        versions = [v.strip() for v in m.group(2).split(",") if v.strip() and v.strip() != "none"]
        if not versions and offline:
            return BundleError(f"pip could not reach the package index while looking for {m.group(1)}",
                               "check the network and pip's index settings (pip config list)")
        shown = ", ".join(versions[-8:]) if versions else "none"
        err = BundleError(
            f"no wheel of {m.group(1)} for {target} (versions with a wheel there: {shown})",
            "pick a version that has a wheel for that Python and platform, add a --platform tag it "
            "ships (e.g. manylinux_2_17_x86_64), or build a wheel and pass its .whl path")
        err.versions = versions  # every version with a wheel for the target, for backtracking
        return err
    if offline:
        return BundleError("pip could not reach the package index",
                           "check the network and pip's index settings (pip config list)")
    line = errors[-1] if errors else (text.strip().splitlines() or ["(no output)"])[-1]
    return BundleError(f"pip failed: {line}", "re-run with --verbose to see pip's full output")


# --------------------------------------------------------------------------------------------
# build: resolve
# --------------------------------------------------------------------------------------------

@dataclass
class Resolution:
    dists: list[Dist]
    skipped: dict[str, dict]      # name -> {version, required_by: [..], conflicts: [..]}
    rounds: int
    roots: list[str]              # canonical names of the requirements asked for


def resolve(args, work: Path) -> Resolution:
    Requirement, SpecifierSet, Version, InvalidRequirement, InvalidVersion = _packaging()
    env = marker_environment(args.python_version, args.platform, args.implementation)
    have = read_have(args.have or [], args.have_pkg or [])
    replace = {canon(n) for n in args.replace or []}
    follow_only = {canon(k): {canon(n) for n in v} for k, v in DEPS_PRESETS[args.deps].items()}
    target = f"cp{env['python_version'].replace('.', '')} {' '.join(args.platform)}"

    def satisfies(version: str | None, spec: str) -> bool:
        if version is None or not spec:
            return True
        try:
            return SpecifierSet(spec).contains(Version(version), prereleases=True)
        except (InvalidVersion, Exception):
            return True

    def parse_req(text: str, by: str):
        try:
            return Requirement(text)
        except InvalidRequirement as exc:
            raise BundleError(f"invalid requirement {text!r} ({by}): {exc}",
                              "write it as NAME==VERSION, NAME>=X, or a path to a .whl / project folder") from None

    # Roots: requirement strings, .whl files, project folders (built with pip wheel --no-deps).
    dists: dict[str, Dist] = {}
    roots: list = []
    for text in args.requirements or DEFAULT_REQUIREMENTS:
        path = (REPO if text == "." and not args.requirements else Path(text)).expanduser()
        if text.endswith(".whl") or os.sep in text or text in (".", ".."):
            dist = local_wheel(path, work)
            dist.local = True
            dists[dist.name] = dist
            roots.append(Requirement(dist.display))
        else:
            roots.append(parse_req(text, "command line"))

    root_names = {canon(r.name) for r in roots}
    fetched: dict[str, str] = {}      # name -> the pip requirement last used to fetch it
    fetch_order: dict[str, int] = {}  # name -> when it was last fetched (for backtracking)
    excluded: dict[str, list[str]] = {}
    backtracks = 0
    for rounds in range(1, 200):
        wanted: dict[str, Want] = {}
        skipped: dict[str, dict] = {}
        walked: set[tuple[str, str]] = set()
        queue = [(r, "command line", None, True) for r in roots]
        while queue:
            req, by, by_name, top = queue.pop(0)
            if top and not marker_applies(req, env, set()):
                continue  # a dependency's marker was evaluated (with its extra) before it was queued
            name = canon(req.name)
            spec = str(req.specifier)
            if name in have and name not in replace and not (top and not satisfies(have[name], spec)):
                entry = skipped.setdefault(name, {"version": have[name], "required_by": [], "conflicts": []})
                entry["required_by"].append(by)
                if not satisfies(have[name], spec):
                    entry["conflicts"].append(f"{by} needs {req.name}{spec}")
                continue
            if name not in wanted:
                wanted[name] = Want(display=req.name)
                wanted[name].specs += [(f"!={v}", "backtracking", None) for v in excluded.get(name, [])]
            want = wanted[name]
            want.specs.append((spec, by, by_name))
            want.extras |= {canon(e) for e in req.extras}
            if req.url:
                want.url = str(req)
            dist = dists.get(name)
            if dist is None or not all(satisfies(dist.version, s) for s, _, _ in want.specs):
                continue
            only = follow_only.get(name)
            for extra in [""] + sorted(want.extras):
                if (name, extra) in walked:
                    continue
                walked.add((name, extra))
                for line in dist.requires:
                    dep = parse_req(line, f"Requires-Dist of {dist.display} {dist.version}")
                    if only is not None:
                        if canon(dep.name) not in only:
                            continue
                        dep.extras = set()
                    applies_base = marker_applies(dep, env, set())
                    if extra == "" and applies_base:
                        queue.append((dep, f"{dist.display} {dist.version}", name, False))
                    elif extra and not applies_base and marker_applies(dep, env, {extra}):
                        queue.append((dep, f"{dist.display}[{extra}] {dist.version}", name, False))

        need: dict[str, str] = {}
        for name, want in wanted.items():
            dist = dists.get(name)
            if dist is not None and (dist.local or all(satisfies(dist.version, s) for s, _, _ in want.specs)):
                continue
            if want.url:
                need[name] = want.url
                continue
            specs = sorted({s for s, _, _ in want.specs if s})
            pip_req = f"{want.display}{','.join(specs)}"
            if fetched.get(name) == pip_req:
                raise BundleError(f"pip chose {want.display} {dist.version if dist else '?'} for {pip_req}, "
                                  "which does not satisfy it", "pin its version on the command line")
            need[name] = pip_req
        if not need:
            break
        say(f"round {rounds}: downloading {len(need)}: {', '.join(sorted(need.values()))}")
        try:
            got = fetch(need, args, work, rounds, target)
        except BundleError as exc:
            failed = re.search(r"no wheel of ([A-Za-z0-9._-]+)", exc.message)
            want = wanted.get(canon(failed.group(1))) if failed else None
            if want is None:
                raise
            # Backtrack: an older release of the newest-fetched requirer that asked for this one.
            def pinned(name: str) -> bool:  # asked for at one exact version: nothing older to try
                return any(re.search(r"(^|,)\s*===?[^=]", s) for s, _, _ in wanted[name].specs) \
                    if name in wanted else False

            movable = [bn for s, _, bn in want.specs
                       if s and bn and bn not in root_names and not dists[bn].local and not pinned(bn)]
            specs = [(s, b) for s, b, _ in want.specs if s and b != "backtracking"]
            if not movable or backtracks >= 40:
                if len(specs) > 1:
                    raise BundleError(
                        f"no version of {want.display} with a wheel for {target} satisfies all of: "
                        + "; ".join(f"{s} (from {b})" for s, b in specs),
                        "pin compatible versions on the command line, or --have-pkg it if the target has it") from None
                raise
            # Prefer a requirer without whose range some available version fits all the others.
            available = exc.versions

            def fits_without(skip: str) -> bool:
                rest = [s for s, _, bn in want.specs if s and bn != skip]
                return any(all(satisfies(v, s) for s in rest) for v in available)

            culprits = [bn for bn in movable if fits_without(bn)] or movable
            culprit = max(culprits, key=lambda n: fetch_order.get(n, 0))
            version = dists[culprit].version
            excluded.setdefault(culprit, []).append(version)
            backtracks += 1
            say(f"  backtracking: {dists[culprit].display} {version} needs "
                f"{want.display}{next(s for s, _, bn in want.specs if bn == culprit)}, which does not fit; "
                f"trying an older {dists[culprit].display}")
            continue
        dists.update(got)
        for name in need:
            if name not in got:
                raise BundleError(f"pip downloaded nothing for {need[name]}", "re-run with --verbose")
            fetched[name] = need[name]
            fetch_order[name] = rounds
    else:
        raise BundleError("dependency resolution did not settle after 199 rounds",
                          "pin the versions of the requirements on the command line")

    chosen = [dists[n] for n in wanted]
    for name, entry in sorted(skipped.items()):
        for conflict in entry["conflicts"]:
            warn(f"the target's {name} {entry['version']} does not satisfy: {conflict} "
                 f"(kept the target's; --replace {name} would bundle one that does and shadow the target's)")
    return Resolution(dists=chosen, skipped=skipped, rounds=rounds,
                      roots=[canon(r.name) for r in roots if marker_applies(r, env, set())])


def local_wheel(path: Path, work: Path) -> Dist:
    if path.is_file():
        if path.suffix != ".whl":
            raise BundleError(f"{path} is not a .whl file", "pass a wheel, a project folder, or NAME==VERSION")
        dest = work / "local" / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        return read_wheel(dest)
    if not path.is_dir():
        raise BundleError(f"{path} does not exist", "pass a wheel, a project folder, or NAME==VERSION")
    out = work / "local" / f"build-{len(list((work / 'local').glob('build-*'))) if (work / 'local').exists() else 0}"
    out.mkdir(parents=True, exist_ok=True)
    say(f"building a wheel of {path} (pip wheel --no-deps)")
    done = run_pip(["wheel", "--no-deps", "--progress-bar", "off", "-w", str(out), str(path)], f"wheel {path}")
    if done.returncode != 0:
        err = pip_failure(done, "this project")
        raise BundleError(f"cannot build a wheel of {path}: {err.message}", err.hint)
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise BundleError(f"pip wheel of {path} made {len(wheels)} wheels", "re-run with --verbose")
    return read_wheel(wheels[0])


def fetch(need: dict[str, str], args, work: Path, rounds: int, target: str) -> dict[str, Dist]:
    dest = work / f"download-{rounds}"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = ["download", "--only-binary=:all:", "--no-deps", "--progress-bar", "off",
           "--python-version", args.python_version, "--implementation", args.implementation]
    for platform in expand_platforms(args.platform):
        cmd += ["--platform", platform]
    cmd += ["-d", str(dest), *sorted(need.values())]
    done = run_pip(cmd, ", ".join(sorted(need)))
    if args.verbose:
        print(done.stdout + done.stderr, file=sys.stderr)
    if done.returncode != 0:
        raise pip_failure(done, target)
    got: dict[str, Dist] = {}
    store = work / "wheels"
    store.mkdir(exist_ok=True)
    for wheel in sorted(dest.glob("*.whl")):
        final = store / wheel.name
        os.replace(wheel, final)
        dist = read_wheel(final)
        got[dist.name] = dist
    return got


# --------------------------------------------------------------------------------------------
# build: stage, trim, pack, split
# --------------------------------------------------------------------------------------------

def unpack_wheel(wheel: Path, stage: Path) -> None:
    """Install a wheel the way pip install --target does, without compiling or scripts' shebangs."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            parts = info.filename.split("/")
            if info.filename.startswith("/") or ".." in parts or "\\" in info.filename:
                raise BundleError(f"{wheel.name}: unsafe path {info.filename!r} in the wheel",
                                  "this wheel is malformed; pin another version")
            if parts[0].endswith(".data") and len(parts) > 2:
                kind, rest = parts[1], parts[2:]
                if kind in ("purelib", "platlib", "data"):
                    parts = rest
                elif kind == "scripts":
                    parts = ["bin", *rest]
                elif kind == "headers":
                    parts = ["include", parts[0].split("-")[0], *rest]
                else:
                    parts = rest
            target = stage.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111 or parts[0] == "bin":
                os.chmod(target, 0o755)


def apply_trim(stage: Path, preset: str) -> list[dict]:
    """Remove the preset's paths that exist under ``stage``; return what went, with sizes."""
    removed = []
    for pattern, why in TRIM_PRESETS[preset]:
        for path in sorted(stage.glob(pattern)):
            size = tree_size(path) if path.is_dir() and not path.is_symlink() else path.lstat().st_size
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append({"path": path.relative_to(stage).as_posix(), "bytes": size, "why": why})
    return removed


def pack(stage: Path, archive: Path) -> str:
    """Tar the stage (sorted, owner-free) and compress it with xz -9; return the tool used."""
    def members():
        for dirpath, dirs, files in os.walk(stage):
            dirs.sort()
            for name in sorted(files):
                full = Path(dirpath, name)
                yield full, full.relative_to(stage).as_posix()

    def add_all(tar: tarfile.TarFile) -> None:
        for full, arcname in members():
            info = tar.gettarinfo(str(full), arcname)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with open(full, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)

    xz = shutil.which("xz")
    if xz:
        with open(archive, "wb") as out:
            proc = subprocess.Popen([xz, "-9", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
            try:
                with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    add_all(tar)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # xz died; its exit status says so below
            finally:
                try:
                    proc.stdin.close()  # on any error too, or xz would wait for more input forever
                except BrokenPipeError:
                    pass
                rc = proc.wait()
        if rc != 0:
            free = shutil.disk_usage(archive.parent).free
            raise BundleError(f"xz failed (exit {rc}) while packing into {archive} ({mib(free)} free there)",
                              "if that filesystem is full, free space or point --work at a bigger one")
        return "xz -9 -T0"
    with tarfile.open(archive, mode="w:xz", preset=9, format=tarfile.PAX_FORMAT) as tar:
        add_all(tar)
    return "python lzma preset 9"


def split(archive: Path, out: Path, max_part: int) -> tuple[list[dict], str, int]:
    parts: list[dict] = []
    whole = hashlib.sha256()
    total = 0
    with open(archive, "rb") as src:
        while True:
            name = f"{PART_PREFIX}{len(parts):03d}"
            digest, size = hashlib.sha256(), 0
            with open(out / name, "wb") as dst:
                while size < max_part:
                    block = src.read(min(CHUNK, max_part - size))
                    if not block:
                        break
                    dst.write(block)
                    digest.update(block)
                    whole.update(block)
                    size += len(block)
            if size == 0 and parts:
                (out / name).unlink()
                break
            parts.append({"name": name, "bytes": size, "sha256": digest.hexdigest()})
            total += size
            if size < max_part:
                break
    return parts, whole.hexdigest(), total


def clear_out(out: Path, force: bool) -> None:
    old = [p for p in out.iterdir() if p.name in (MANIFEST, SELF_NAME) or p.name.startswith(PART_PREFIX)] \
        if out.is_dir() else []
    if old and not force:
        raise BundleError(f"{out} already holds a bundle ({len(old)} files)",
                          "pass --force to replace it, or choose another --out (mixing two builds' parts breaks both)")
    for p in old:
        p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def cmd_build(args) -> int:
    if args.trim not in TRIM_PRESETS:
        raise BundleError(f"unknown --trim preset {args.trim!r}", f"choose one of: {', '.join(TRIM_PRESETS)}")
    args.platform = args.platform or ["manylinux_2_31_x86_64"]
    args.python_version = args.python_version.strip()
    if re.fullmatch(r"3\d{1,2}", args.python_version):
        args.python_version = f"3.{args.python_version[1:]}"
    if not re.fullmatch(r"3\.\d{1,2}(\.\d+)?", args.python_version):
        raise BundleError(f"--python-version {args.python_version!r} is not like 3.12", "e.g. --python-version 3.12")
    out = Path(args.out).resolve()
    work_root = Path(args.work).resolve() if args.work else None
    if work_root:
        work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bundle-work-", dir=work_root))
    started = time.monotonic()
    try:
        if not args.resolve_only:
            clear_out(out, args.force)
        res = resolve(args, work)
        if args.resolve_only:
            for d in sorted(res.dists, key=lambda d: d.name):
                say(f"  {d.display}=={d.version}  {d.wheel.name}  {mib(d.wheel.stat().st_size)}")
            wheels = sum(d.wheel.stat().st_size for d in res.dists)
            say(f"resolved: {len(res.dists)} wheels, {mib(wheels)}; skipped (on the target): "
                f"{', '.join(sorted(res.skipped)) or 'none'}")
            return 0
        stage = work / "stage"
        stage.mkdir()
        for dist in res.dists:
            unpack_wheel(dist.wheel, stage)
        before = tree_size(stage)
        removed = apply_trim(stage, args.trim)
        after = tree_size(stage)
        archive = work / ARCHIVE
        say(f"packing {mib(after)} with xz -9 (slow for large trees)")
        tool = pack(stage, archive)
        parts, whole_sha, packed = split(archive, out, args.max_part_size)
        shutil.copy2(Path(__file__).resolve(), out / SELF_NAME)

        by_name = {d.name: d for d in res.dists}
        roots = [by_name[n] for n in res.roots if n in by_name]
        modules = [m for d in roots for m in d.top_level]
        has_vllm = any(d.name == "vllm" for d in res.dists)
        env = dict(BASE_ENV, **(VLLM_ENV if has_vllm else {}))
        for item in args.env or []:
            key, sep, value = item.partition("=")
            if not sep or not key.isidentifier():
                raise BundleError(f"--env {item!r} is not NAME=VALUE", "e.g. --env VLLM_USE_FLASHINFER_SAMPLER=0")
            env[key] = value
        first = "vllm" if "vllm" in modules else (modules[0] if modules else "sys")
        check = (f"import {', '.join(modules) or 'sys'}; "
                 f"print(getattr({first}, '__version__', 'ok'))")
        if has_vllm and "loractld" in modules:
            # The real check: start the engine and answer a request with a LoRA adapter.
            check = "import runpy; runpy.run_module('loractld.selfcheck', run_name='__main__')"
        manifest = {
            "format": FORMAT,
            "build_id": whole_sha[:12],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "target": {"python_version": args.python_version, "implementation": args.implementation,
                       "platforms": args.platform},
            "requirements": args.requirements or DEFAULT_REQUIREMENTS,
            "deps_preset": args.deps,
            "distributions": [{"name": d.display, "version": d.version, "wheel": d.wheel.name,
                               "wheel_bytes": d.wheel.stat().st_size, "top_level": d.top_level}
                              for d in sorted(res.dists, key=lambda d: d.name)],
            "skipped": {n: {"version": e["version"], "required_by": sorted(set(e["required_by"])),
                            "conflicts": e["conflicts"]} for n, e in sorted(res.skipped.items())},
            "trim": {"preset": args.trim, "removed": removed},
            "sizes": {"wheels": sum(d.wheel.stat().st_size for d in res.dists), "unpacked": before,
                      "unpacked_after_trim": after, "packed": packed},
            "archive": {"name": ARCHIVE, "bytes": packed, "sha256": whole_sha, "compressor": tool},
            "max_part_bytes": args.max_part_size,
            "parts": parts,
            "env": env,
            "self_check": check,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    except OSError as exc:
        if no_space(exc):
            raise BundleError(f"no space left on device while building ({exc.filename or work})",
                              "free space there, or point --work / --out at a bigger filesystem") from None
        raise
    finally:
        if args.keep_work:
            say(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    wheels = manifest["sizes"]["wheels"]
    say(f"wheels: {len(res.dists)} ({mib(wheels)}); on the target already, skipped: "
        f"{', '.join(sorted(res.skipped)) or 'none'}")
    say(f"unpacked: {mib(before)}; after trim {args.trim}: {mib(after)} "
        f"({len(removed)} paths, {mib(before - after)} removed)")
    say(f"packed: {ARCHIVE} {mib(packed)} ({tool}), sha256 {whole_sha[:16]}…, build {whole_sha[:12]}")
    say(f"parts: {len(parts)} of at most {mib(args.max_part_size)}: "
        + ", ".join(f"{p['name']} ({mib(p['bytes'])})" for p in parts))
    say(f"out: {out} (copy all of it: {MANIFEST}, {SELF_NAME} and the parts) in {time.monotonic() - started:.0f}s")
    say(f"on the target: python3 {SELF_NAME} install . --prefix /opt/loractl-bundle")
    return 0


# --------------------------------------------------------------------------------------------
# verify / install (target side: standard library only, no network)
# --------------------------------------------------------------------------------------------

def load_manifest(bundle: Path) -> dict:
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"{bundle} is not a folder", "pass the folder holding MANIFEST.json and the parts")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path} is missing", "copy MANIFEST.json from the build's --out folder together with the parts") from None
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path} is unreadable or not JSON ({exc})", "copy MANIFEST.json again from the build") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("parts"), list) or not isinstance(manifest.get("archive"), dict)):
        raise BundleError(f"{path} is not a bundle manifest of format {FORMAT}",
                          "use the bundle.py copied next to the parts of the same build")
    return manifest


def verify_parts(bundle: Path, manifest: dict) -> list[Path]:
    parts = manifest["parts"]
    build = manifest.get("build_id", "?")
    listed = {p["name"] for p in parts}
    present = sorted(p.name for p in bundle.glob(PART_PREFIX + "*"))
    missing = [p["name"] for p in parts if p["name"] not in present]
    if missing:
        raise BundleError(
            f"missing part {missing[0]} ({len(parts) - len(missing)} of {len(parts)} parts present"
            + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else "") + ")",
            f"copy {missing[0]} from the build's --out folder (build {build}) into {bundle}")
    stray = [n for n in present if n not in listed]
    if stray:
        raise BundleError(f"{bundle / stray[0]} is not listed in MANIFEST.json (build {build}): "
                          "parts from two different builds are mixed",
                          f"remove {stray[0]}, or use all parts and the MANIFEST.json of one build")
    by_sha = {p["sha256"]: p["name"] for p in parts}
    paths = []
    for index, part in enumerate(parts):
        path = bundle / part["name"]
        size = path.stat().st_size
        got = sha256_file(path)
        if got != part["sha256"]:
            if got in by_sha:
                raise BundleError(f"part {part['name']} holds the content of {by_sha[got]}: the parts were renamed",
                                  f"copy {part['name']} again from the build's --out folder (build {build})")
            detail = (f"{size} bytes, MANIFEST.json expects {part['bytes']}" if size != part["bytes"]
                      else f"sha256 {got[:12]}…, MANIFEST.json expects {part['sha256'][:12]}…")
            raise BundleError(
                f"part {part['name']} ({index + 1} of {len(parts)}) is corrupt or from another build "
                f"({detail}; build {build})",
                f"copy {part['name']} again from the same build as MANIFEST.json; "
                f"`sha256sum {part['name']}` must print {part['sha256']}")
        paths.append(path)
    return paths


class _Chain(io.RawIOBase):
    """The parts, read back to back as one stream, hashed on the way."""

    def __init__(self, paths: list[Path]):
        self._paths = list(paths)
        self._file = None
        self.sha = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = open(self._paths.pop(0), "rb")
            n = self._file.readinto(buffer)
            if n:
                self.sha.update(memoryview(buffer)[:n])
                self.count += n
                return n
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file:
            self._file.close()
        super().close()


def cmd_verify(args) -> int:
    bundle = Path(args.dir)
    manifest = load_manifest(bundle)
    verify_parts(bundle, manifest)
    say(f"ok: {len(manifest['parts'])} parts of build {manifest.get('build_id')} match MANIFEST.json "
        f"({mib(manifest['archive']['bytes'])})")
    return 0


def python_version_of(python: str) -> str:
    try:
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BundleError(f"cannot run --python {python}: {exc}", "pass the target interpreter, e.g. --python /opt/torch/.venv/bin/python3") from None
    if done.returncode != 0:
        raise BundleError(f"--python {python} does not run: {(done.stderr.strip().splitlines() or ['?'])[-1]}",
                          "pass the target interpreter, e.g. --python /opt/torch/.venv/bin/python3")
    return done.stdout.strip()


def write_env(prefix: Path, manifest: dict) -> Path:
    lines = [f"# Written by bundle.py install (build {manifest.get('build_id')}): source it to use the bundle.",
             f"export PYTHONPATH={shlex.quote(str(prefix))}${{PYTHONPATH:+:$PYTHONPATH}}",
             f"export PATH={shlex.quote(str(prefix / 'bin'))}:$PATH"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in manifest.get("env", {}).items()]
    path = prefix / "env.sh"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_scripts(prefix: Path, python: str) -> list[str]:
    """bin/ wrappers for the console scripts of every unpacked distribution, for ``python``."""
    bindir = prefix / "bin"
    made = []
    for eps in sorted(prefix.glob("*.dist-info/entry_points.txt")):
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str
        try:
            parser.read(eps)
        except configparser.Error:
            continue
        for section in ("console_scripts", "gui_scripts"):
            if not parser.has_section(section):
                continue
            for name, target in parser.items(section):
                module, _, attr = target.split("[")[0].strip().partition(":")
                if not re.fullmatch(r"[\w.-]+", name) or not module:
                    continue
                bindir.mkdir(exist_ok=True)
                call = "fn = importlib.import_module({!r})\n".format(module.strip())
                for part in filter(None, attr.strip().split(".")):
                    call += f"fn = getattr(fn, {part!r})\n"
                script = (f"#!{python}\n# Written by bundle.py install.\nimport importlib, sys\n"
                          f"sys.path.insert(0, {str(prefix)!r})\n{call}sys.exit(fn())\n")
                (bindir / name).write_text(script)
                os.chmod(bindir / name, 0o755)
                made.append(name)
    for script in sorted(bindir.glob("*")) if bindir.is_dir() else []:
        try:
            with open(script, "rb") as f:
                head = f.readline()
            if re.fullmatch(rb"#!pythonw?\s*", head):
                body = script.read_bytes()[len(head):]
                script.write_bytes(f"#!{python}\n".encode() + body)
        except OSError:
            pass
    return made


def unpack(paths: list[Path], dest: Path, manifest: dict) -> None:
    try:
        import lzma  # noqa: F401  (tarfile's xz support)
    except ImportError:
        raise BundleError(f"{sys.executable} lacks the lzma module, so it cannot read .tar.xz",
                          "run bundle.py with another python3; --python still picks the target interpreter") from None
    chain = _Chain(paths)
    reader = io.BufferedReader(chain, CHUNK)
    try:
        with tarfile.open(fileobj=reader, mode="r|xz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:
                for member in tar:
                    if member.name.startswith("/") or ".." in member.name.split("/") or not (member.isreg() or member.isdir()):
                        raise BundleError(f"unsafe entry {member.name!r} in the archive", "rebuild the bundle")
                    tar.extract(member, dest)
        while reader.read(CHUNK):
            pass
    except (tarfile.TarError, EOFError) as exc:
        raise BundleError(f"the archive does not unpack: {exc}",
                          "run `bundle.py verify` and copy any bad part again; if all parts verify, rebuild") from None
    finally:
        reader.close()
    if chain.sha.hexdigest() != manifest["archive"]["sha256"]:
        raise BundleError(f"the reassembled archive's sha256 {chain.sha.hexdigest()[:12]}… is not "
                          f"{manifest['archive']['sha256'][:12]}… from MANIFEST.json",
                          "the parts are not in order or not from one build; copy them again")


def self_check(args, prefix: Path, manifest: dict, python: str) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(prefix) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = str(prefix / "bin") + os.pathsep + env.get("PATH", "")
    env.update({k: str(v) for k, v in manifest.get("env", {}).items()})
    if args.self_check:
        cmd, shell, shown = args.self_check, True, args.self_check
    else:
        code = manifest.get("self_check") or "import sys"
        cmd, shell, shown = [python, "-c", code], False, f"{python} -c {shlex.quote(code)}"
    say(f"self-check: {shown}")
    try:
        done = subprocess.run(cmd, shell=shell, env=env, capture_output=True, text=True,
                              timeout=args.self_check_timeout)
    except subprocess.TimeoutExpired:
        raise BundleError(f"self-check did not finish within {args.self_check_timeout}s: {shown}",
                          "raise --self-check-timeout, or pass a command that exits", code=2) from None
    except OSError as exc:
        raise BundleError(f"self-check could not start: {exc}", "check --python / --self-check", code=2) from None
    if done.returncode == 0:
        last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        say(f"self-check passed: {last}")
        return 0
    lines = [ln for ln in (done.stderr + done.stdout).strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "(no output)"
    if "ModuleNotFoundError" in last or "No module named" in last:
        hint = ("a module is on neither the bundle nor the target: rebuild with a --have list that "
                "matches the target (pip freeze there), or add it as a requirement")
    elif re.search(r"undefined symbol|\.so|libcudart|libcuda|GLIBC", last):
        hint = "a binary extension does not load: the bundle's torch/CUDA/glibc target differs from this host"
    else:
        hint = "see the full output with: source " + str(prefix / "env.sh") + " && " + shown
    raise BundleError(f"self-check failed (exit {done.returncode}): {last}",
                      hint + f" (the bundle stays installed in {prefix})", code=2)


def cmd_install(args) -> int:
    bundle = Path(args.dir)
    manifest = load_manifest(bundle)
    paths = verify_parts(bundle, manifest)
    say(f"verified {len(paths)} parts of build {manifest.get('build_id')} ({mib(manifest['archive']['bytes'])})")
    python = args.python or sys.executable
    version = python_version_of(python)
    want = manifest.get("target", {}).get("python_version", "")
    if want and ".".join(want.split(".")[:2]) != version:
        warn(f"the bundle was built for Python {want}, {python} is {version}: binary modules may not load")

    prefix = Path(args.prefix).expanduser().resolve()
    if prefix.exists() and (not prefix.is_dir() or any(prefix.iterdir())) and not args.force:
        raise BundleError(f"{prefix} exists and is not empty", "pass --force to replace it, or choose another --prefix")
    anchor = prefix.parent
    while not anchor.exists():
        anchor = anchor.parent
    need = int(manifest.get("sizes", {}).get("unpacked_after_trim", 0) * 1.02) + (16 << 20)
    free = shutil.disk_usage(anchor).free
    if free < need:
        raise BundleError(f"not enough space under {anchor}: the bundle unpacks to {mib(need)}, {mib(free)} free",
                          "free space there, or choose a --prefix on a bigger filesystem")
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.partial-", dir=prefix.parent))
    except OSError as exc:
        raise BundleError(f"cannot create {prefix.parent}: {exc.strerror}",
                          "choose a --prefix you can write to") from None
    try:
        unpack(paths, tmp, manifest)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it 0700
        if prefix.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.old-", dir=prefix.parent))
            os.replace(prefix, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, prefix)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if no_space(exc):
            raise BundleError(f"no space left on device while unpacking into {prefix} "
                              f"(the bundle needs {mib(need)})",
                              "free space there, or choose a --prefix on a bigger filesystem") from None
        raise BundleError(f"cannot unpack into {prefix}: {exc.strerror or exc}",
                          "choose a --prefix you can write to") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        scripts = write_scripts(prefix, python)
        env_sh = write_env(prefix, manifest)
        (prefix / "bundle-manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    except OSError as exc:
        if no_space(exc):
            raise BundleError(f"no space left on device while writing {prefix}", "free space there and re-run with --force") from None
        raise
    dists = manifest.get("distributions", [])
    say(f"installed {len(dists)} distributions into {prefix} ({mib(tree_size(prefix))})"
        + (f"; commands: {', '.join(sorted(scripts))}" if scripts else ""))
    say(f"environment: source {env_sh}")
    if args.no_self_check:
        return 0
    return self_check(args, prefix, manifest, python)


# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bundle.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="download, trim, pack and split a bundle (needs the package index)")
    b.add_argument("requirements", nargs="*", metavar="REQUIREMENT",
                   help="NAME==VERSION, a .whl path, or a project folder "
                        "(default: vllm==0.26.0, this repository's loractl wheel, uvicorn, and the four "
                        "packages vLLM's OpenAI server needs beyond the text engine)")
    b.add_argument("--out", required=True, help="folder for the parts, MANIFEST.json and bundle.py")
    b.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    b.add_argument("--platform", action="append", help="wheel platform tag of the target, repeatable "
                   "(default manylinux_2_31_x86_64: the lowest glibc that vllm 0.26.0's llguidance pin ships for)")
    b.add_argument("--implementation", default="cp", help="interpreter implementation tag (default cp)")
    b.add_argument("--have", action="append", metavar="FREEZE_FILE",
                   help="pip freeze of the target: these distributions are not bundled")
    b.add_argument("--have-pkg", action="append", metavar="NAME==VER", help="one more distribution the target has")
    b.add_argument("--replace", action="append", metavar="NAME",
                   help="bundle NAME even though the target has it (it then shadows the target's)")
    b.add_argument("--deps", choices=sorted(DEPS_PRESETS), default="vllm-text",
                   help="which requirements are followed: vllm-text (default) follows only the small "
                        "set of vllm's own requirements a text-only engine needs; all follows every one")
    b.add_argument("--trim", default=DEFAULT_TRIM, metavar="PRESET",
                   help=f"files to drop after unpacking: {' or '.join(TRIM_PRESETS)} (default {DEFAULT_TRIM}; "
                        "vllm-text-hopper also drops FlashAttention-2: Hopper only, no ALiBi models)")
    b.add_argument("--max-part-size", type=parse_size, default=parse_size("40MiB"),
                   help="largest part, e.g. 40MiB (default), 64KiB")
    b.add_argument("--env", action="append", metavar="NAME=VALUE", help="one more variable for env.sh")
    b.add_argument("--work", help="where to download and unpack (default: the system temp folder)")
    b.add_argument("--keep-work", action="store_true", help="keep the work folder (wheels, stage)")
    b.add_argument("--resolve-only", action="store_true", help="print what would be bundled and stop")
    b.add_argument("--force", action="store_true", help="replace a bundle already in --out")
    b.add_argument("--verbose", action="store_true", help="show pip's output")
    b.set_defaults(func=cmd_build)

    v = sub.add_parser("verify", help="check the parts against MANIFEST.json (no network)")
    v.add_argument("dir", help="the folder holding MANIFEST.json and the parts")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("install", help="verify, unpack into --prefix, write env.sh, self-check (no network)")
    i.add_argument("dir", help="the folder holding MANIFEST.json and the parts")
    i.add_argument("--prefix", required=True, help="where to unpack; used through PYTHONPATH")
    i.add_argument("--python", help="the target interpreter (default: the one running bundle.py)")
    i.add_argument("--self-check", metavar="CMD",
                   help="shell command to run with env.sh's environment (default: import the bundled packages)")
    i.add_argument("--no-self-check", action="store_true", help="skip the self-check")
    i.add_argument("--self-check-timeout", type=float, default=900, help="seconds (default 900)")
    i.add_argument("--force", action="store_true", help="replace what is in --prefix")
    i.set_defaults(func=cmd_install)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BundleError as exc:
        print(f"bundle.py {args.command}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"bundle.py {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # anything not foreseen above, still as one line
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"bundle.py {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        print("  hint: check the paths given and that you may write there", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
