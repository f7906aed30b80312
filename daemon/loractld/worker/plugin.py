"""The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts.

Inert unless loractld's engine asked for it through the environment, so a plain vLLM in the
same environment (a benchmark baseline, say) is left exactly as it is:
- ``LORACTL_ENGINE=1``: attach loractl's worker methods (``worker_ext``);
- ``LORACTL_VLLM_CPU_FIXES=1``: install the CPU fixes (``cpu_fixes``);
- ``LORACTL_DAEMON_PID=N``: in a direct child of daemon N (vLLM's engine core), ask the kernel
  to SIGKILL this process when the daemon dies, however it dies (``kill -9 PID``, the OOM
  killer). Otherwise the engine outlives the daemon as an orphan holding its RAM (and on a
  GPU the device memory, so that a restarted daemon could not start).
"""

from __future__ import annotations

import os

ENGINE_FLAG = "LORACTL_ENGINE"
DAEMON_PID = "LORACTL_DAEMON_PID"
_PR_SET_PDEATHSIG = 1


def register() -> None:
    die_with_daemon()
    if os.environ.get(ENGINE_FLAG) == "1":
        from loractld.worker import extension as worker_ext

        worker_ext.install()
    from loractld.worker import cpu_fixes

    if os.environ.get(cpu_fixes.ENV_FLAG) == "1":
        cpu_fixes.install()


def die_with_daemon() -> None:
    """PR_SET_PDEATHSIG(SIGKILL) in a direct child of the daemon; nothing anywhere else."""
    daemon_pid = os.environ.get(DAEMON_PID, "")
    if not daemon_pid.isdigit() or os.getpid() == int(daemon_pid) or os.getppid() != int(daemon_pid):
        return
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not fatal: the stale-engine check at the next start still clears an orphan
    if os.getppid() != int(daemon_pid):  # the daemon died before the request took effect
        os._exit(1)
