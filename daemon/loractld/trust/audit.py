"""The audit log: one line per state-changing call, whichever door (socket or HTTP) it came
through, naming the caller, the operation, its target and its outcome.

Invariants:
- A line is written however the call ends (success, refusal, error, cancellation), and
  caller-supplied text in it is escaped and clipped, so a name cannot forge or flood the log.
- ``--log-level`` does not silence it: the audit logger has its own handler and level and does
  not pass its lines to the root logger (:func:`install`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from loractl.errors import LoractlError, PermissionDenied

_audit = logging.getLogger("loractld.audit")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def install(stream=None) -> None:
    """Audit lines to ``stream`` (stderr: the journal under systemd) at INFO, whatever the
    root logger's level; idempotent."""
    if not any(getattr(h, "_loractl_audit", False) for h in _audit.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._loractl_audit = True
        _audit.addHandler(handler)
    _audit.setLevel(logging.INFO)
    _audit.propagate = False


def record(principal: str, operation: str, target: str, outcome: str) -> None:
    """One audit line for a call refused before it became an operation (e.g. by the HTTP guard)."""
    _audit.info("audit %s op=%s target=%s result=%s", principal, operation, loggable(target), outcome)


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
    except asyncio.CancelledError:
        outcome = "cancelled"   # the caller left (Ctrl-C), or the daemon drained: the work was stopped
        raise
    except LoractlError as e:
        outcome = "cancelled" if e.kind == "cancelled" else f"error: {e.kind}"
        raise
    finally:
        record(principal, operation, target, outcome)


def loggable(text: str, limit: int = 200) -> str:
    """Caller-supplied text for one log line: control characters escaped (a newline in a name
    must not forge an audit line), clipped (one request must not write 100 kB of log), and
    quoted when it holds ``=`` or ``"`` (a path like ``/x result=ok`` must not add a field)."""
    forging = "=" in text or '"' in text
    if text.isprintable() and len(text) <= limit and not forging:
        return text
    escaped = text[:limit].encode("unicode_escape").decode("ascii")
    if forging:
        escaped = '"' + escaped.replace('"', '\\"') + '"'
    return escaped if len(text) <= limit else f"{escaped}...({len(text)} characters)"
