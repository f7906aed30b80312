"""``loractld --socket-group GROUP``: the socket is 0660 in that group; a member of it can use
the daemon (read and change), a user outside it gets one error line with a hint that names
the group. Real users: a group and a member made for the session (conftest's socket_users),
and nobody (65534) as the outsider."""

from __future__ import annotations

import grp
import os
import stat
import subprocess

import pytest

from conftest import BIN
from test_errors import assert_one_error


@pytest.fixture
def opened(rig, socket_users):
    """The rig's socket, reachable by other users (its folders opened for the test only)."""
    users, why_not = socket_users
    if users is None:
        pytest.skip(why_not)
    folders = [rig.root.parent, rig.root]
    modes = [os.stat(f).st_mode & 0o777 for f in folders]
    for folder in folders:
        os.chmod(folder, 0o711)  # search only: the socket's own mode and group decide
    yield rig, users
    for folder, mode in zip(folders, modes):
        os.chmod(folder, mode)


def as_user(uid: int, gid: int, *args: str, groups: bool) -> subprocess.CompletedProcess:
    ids = [f"--reuid={uid}", f"--regid={gid}", "--init-groups" if groups else "--clear-groups"]
    return subprocess.run(["setpriv", *ids, str(BIN / "loractl"), *args], capture_output=True, text=True,
                          env={**os.environ, "NO_COLOR": "1", "HOME": "/tmp", "COLUMNS": "100"}, timeout=60)


def test_the_socket_is_group_read_write(opened):
    rig, users = opened
    st = os.stat(rig.daemon.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(users.group).gr_gid


def test_a_member_of_the_group_may_use_the_daemon(opened):
    rig, users = opened
    sock = str(rig.daemon.socket)
    status = as_user(users.member_uid, users.member_gid, "status", "--socket", sock, groups=True)
    assert status.returncode == 0 and "ready" in status.stdout, status.stderr
    rig.pull("poet/v1")
    load = as_user(users.member_uid, users.member_gid, "load", "poet/v1", "--to", "host", "--socket", sock,
                   groups=True)
    assert load.returncode == 0, load.stderr
    assert f"audit uid={users.member_uid}" in rig.daemon.log_tail(200)


def test_a_user_outside_the_group_is_refused_in_one_line(opened):
    rig, users = opened
    refused = as_user(65534, 65534, "status", "--socket", str(rig.daemon.socket), groups=False)
    assert_one_error(refused, 9, "no permission to use the daemon's socket", f"socket's group '{users.group}'")
