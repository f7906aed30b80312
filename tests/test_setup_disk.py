"""``scripts/setup.sh`` on a disk without room for its venv: one line naming the free space and
what to do, before pip starts (its own module: a test of test_first_run.py would start that
module's background venv)."""

from __future__ import annotations

import shutil
import subprocess

from conftest import REPO
from test_first_run import user_environment


def test_setup_on_a_disk_without_room_says_so_before_pip_and_makes_nothing(tmp_path):
    """A disk too small for the venv is named with its free space and a hint at once, not after
    minutes of pip ending in ``[Errno 28]``. (``LORACTL_SETUP_NEED_MIB`` stands in for a full
    disk: the free space is this disk's, read by ``df`` as for a user.)"""
    venv = tmp_path / "not" / "yet" / ".venv"
    free_mib = shutil.disk_usage(tmp_path).free >> 20
    done = subprocess.run(["bash", "scripts/setup.sh", "main"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**user_environment(tmp_path / "home"), "LORACTL_VENV": str(venv),
                               "LORACTL_SETUP_NEED_MIB": str(free_mib + (1 << 30))})
    assert done.returncode == 1, done
    said = done.stderr.strip()
    assert len(said.splitlines()) == 1, said
    assert said.startswith("setup: ") and f"on the disk of {tmp_path}," in said, said
    shown_free = int(said.split(" MiB free")[0].removeprefix("setup: "))
    assert abs(shown_free - free_mib) < 1024, (shown_free, free_mib)
    assert "LORACTL_VENV" in said and "free some space" in said, said
    assert not (tmp_path / "not").exists() and "creating" not in done.stdout, done
