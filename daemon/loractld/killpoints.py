"""Test-only fault injection: the daemon SIGKILLs itself at a named step.

A real engine cannot be stopped at a precise step from outside, so the crash tests
(tests/test_kill_points.py) arm one of the steps below and let the daemon kill its own pid
there, exactly as ``kill -9`` or the OOM killer would (no handler, no cleanup).

Arming: start the daemon with ``LORACTL_TEST_KILL_AT=FILE``; when a step runs while FILE holds
that step's name, the daemon removes FILE (so its restart is not armed) and SIGKILLs itself.
Unset (always, outside those tests), ``reached`` is one comparison with None. Steps:

    engine-add          vLLM added the adapter (disk -> host -> device), before the reply
    engine-deactivate   the adapter left its device slot (load --to host, evict --from device)
    engine-pin          the worker pinned the adapter; state.json does not record it yet
    engine-remove       vLLM dropped the adapter (evict --from host, rm)
    store-install       a pull's object is renamed into .objects/; the name's link is not
    store-unlink        rm unlinked the name; the adapter's folder and any pin are still there
    write:NAME          a JSON file NAME (e.g. state.json) is written beside it, not yet renamed
"""

from __future__ import annotations

import os
import signal

ENV = "LORACTL_TEST_KILL_AT"
_ARMED = os.environ.get(ENV) or None


def reached(step: str) -> None:
    """SIGKILL this process if the arming file names ``step``."""
    if _ARMED is None:
        return
    try:
        with open(_ARMED) as f:
            if f.read().strip() != step:
                return
        os.unlink(_ARMED)
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
