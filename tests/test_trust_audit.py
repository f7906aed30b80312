"""Audit lines are kept whatever --log-level says: the audit logger has its own handler and
does not pass its lines to the root logger, which --log-level WARNING quiets. A real daemon
at WARNING, a real pull and a refused load."""

from __future__ import annotations

import os
import subprocess

from conftest import BIN, run_cli, start_daemon


def test_log_level_warning_keeps_the_audit_lines(home, demo):
    root = home / "quiet"
    root.mkdir(exist_ok=True)
    (root / "tiny").exists() or (root / "tiny").symlink_to(home / "tiny")
    daemon = start_daemon(root, "--log-level", "WARNING", name="q")
    try:
        pulled = run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", "poet/v1",
                         "--socket", str(daemon.socket))
        assert pulled.returncode == 0, pulled.stderr
        folders = [home, root]   # let another uid reach the socket: the peer check is what is tested
        modes = [os.stat(f).st_mode & 0o777 for f in folders]
        for folder in folders:
            os.chmod(folder, 0o711)
        os.chmod(daemon.socket, 0o666)
        try:
            refused = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                      str(BIN / "loractl"), "load", "poet/v1", "--socket", str(daemon.socket)],
                                     capture_output=True, text=True, env={**os.environ, "HOME": "/tmp"})
            assert refused.returncode == 9, refused.stderr
        finally:
            os.chmod(daemon.socket, 0o600)
            for folder, mode in zip(folders, modes):
                os.chmod(folder, mode)
        log = daemon.log.read_text()
    finally:
        daemon.stop()
    assert f"INFO loractld.audit: audit uid={os.getuid()} pid=" in log and "op=pull" in log
    assert "audit uid=65534 pid=" in log and "op=load target=poet/v1 result=denied" in log
    assert "INFO loractld: listening on" not in log   # the level itself still holds for the rest
