"""The README's first command, as a new user runs it (issue 45, item 2): ``bash scripts/demo.sh``
in a fresh copy of the tree, in the ``.venv`` that the demo makes for itself with
``setup.sh main`` (the ``cpu`` extra only: no test tool, no peft, nothing this suite's venv
brought), with a fresh ``LORACTL_HOME``: it fetches, converts and trains the demo model, and
must print the SQL answer and ``demo: done``.

A demo that died in its own environment went unseen for a round because every check ran in the
developers' venv. This test shares what the suite builds anyway: the demo model, which it builds
first and hands to ``conftest.real_demo`` (moved into ``REAL_DEMO_CACHE`` when that holds none yet).

The copy and its venv are made in the background from the session's start (support_background:
``bash scripts/setup.sh main`` in the copy, the command demo.sh starts with; minutes of pip
unpacking and byte-compiling), so that they overlap the engine tests; demo.sh, run here, finds
that setup done (its stamp) and goes on from there as it does after a user's first setup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import support_background as background
from conftest import REAL_DEMO_CACHE, REPO

# What the demo answers with the trained adapters (greedy: the same on every run).
SQL_ANSWER = "SELECT"
DEMO_TIMEOUT_S = 1800


def fresh_copy(dest: Path) -> Path:
    """The tree as a clone of it would be: tracked files and new files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if not source.is_file():   # listed but deleted in the work tree
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return dest


def user_environment(home: Path) -> dict[str, str]:
    """This process's environment less what the suite's own venv and settings put there."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LORACTL_", "PYTEST_", "VIRTUAL_ENV", "PYTHON")) and k != "CONDA_PREFIX"}
    suite_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != suite_bin)
    env["LORACTL_HOME"] = str(home)
    return env


def _setup_in_a_fresh_copy(root: Path) -> tuple[list[str], Path, dict[str, str]]:
    """The background job: a fresh copy under ``root`` and ``setup.sh main`` in it, as demo.sh runs it."""
    clone = fresh_copy(root / "loractl")
    return ["bash", "scripts/setup.sh", "main"], clone, user_environment(root / "home")


# The copy and its venv (the cpu extra only): 2.6-2.7 GiB.
background.register("first-run-venv", __name__, _setup_in_a_fresh_copy, disk_bytes=3 << 30)


def test_the_readmes_first_command_runs_in_the_environment_it_makes():
    job = background.job("first-run-venv")
    try:
        root = job.ok(DEMO_TIMEOUT_S)
        clone = root / "loractl"
        home = root / "home"
        result = subprocess.run(["bash", "scripts/demo.sh"], cwd=clone, env=user_environment(home),
                                capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, stdin=subprocess.DEVNULL)
        shown = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
        assert result.returncode == 0, shown
        # The venv holds only what `setup.sh main` installs: no test tool came along.
        venv_python = clone / ".venv" / "bin" / "python"
        extras = subprocess.run([str(venv_python), "-c", "import importlib.util as u; "
                                 "print(*[m for m in ('peft', 'pytest', 'pexpect') if u.find_spec(m)])"],
                                capture_output=True, text=True, check=True).stdout.split()
        assert extras == [], f"the demo's venv has test tools: {extras}"
        out = result.stdout
        sql = out.split("$ loractl run --lora sql-expert/v1", 1)[1].split("\n$ ", 1)[0]
        assert SQL_ANSWER in sql, shown
        pirate = out.split("$ loractl run --lora pirate/v1", 1)[1]
        assert pirate.strip(), shown
        assert "demo: done in" in out, shown
        _share_the_demo_build(home)
    finally:
        job.clean()


def _share_the_demo_build(home: Path) -> None:
    """Hand the demo model and adapters to ``conftest.real_demo`` (which finds them stamped and
    builds nothing) when its cache is still empty: the suite builds them once per run."""
    if (REAL_DEMO_CACHE / "demo").exists() or (REAL_DEMO_CACHE / "models").exists():
        return
    REAL_DEMO_CACHE.mkdir(parents=True, exist_ok=True)
    for part in ("demo", "models"):
        shutil.move(str(home / part), str(REAL_DEMO_CACHE / part))
