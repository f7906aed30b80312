"""The audit log: one line per state-changing call, whichever door (socket or HTTP) it came
through, naming the caller, the operation, its target and its outcome.

Invariant: a line is written however the call ends (success, refusal, error, cancellation), and
caller-supplied text in it is escaped and clipped, so a name cannot forge or flood the log.
"""

from __future__ import annotations

import contextlib
import logging

from loractl.errors import LoractlError, PermissionDenied

_audit = logging.getLogger("loractld.audit")


@contextlib.asynccontextmanager
async def audited(principal: str, operation: str, target: str):
    """One audit line per state-changing call, whichever door it came through, with its outcome."""
    outcome = "error"  # anything but a clean exit is an error
    try:
        yield
        outcome = "ok"
    except PermissionDenied:
        outcome = "denied"
        raise
    except LoractlError as e:
        outcome = f"error: {e.kind}"
        raise
    finally:
        _audit.info("audit %s op=%s target=%s result=%s", principal, operation, loggable(target), outcome)


def loggable(text: str, limit: int = 200) -> str:
    """Caller-supplied text for one log line: control characters escaped (a newline in a name
    must not forge an audit line), and clipped (one request must not write 100 kB of log)."""
    if text.isprintable() and len(text) <= limit:
        return text
    escaped = text[:limit].encode("unicode_escape").decode("ascii")
    return escaped if len(text) <= limit else f"{escaped}...({len(text)} characters)"
