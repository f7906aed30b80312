"""Domain errors shared by the daemon and its clients, each with a hint of what to do next.

Invariant: every failure a user can cause surfaces as exactly one ``LoractlError`` subclass
with a one-line ``message`` and a one-line ``hint``. The daemon raises them; the service maps
them to gRPC status codes; the client maps the status back to the same class, so callers of
``loractl.Client`` and the CLI see the same error the daemon raised.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from grpclib.const import Status


class LoractlError(Exception):
    """Base class: ``message`` says what went wrong, ``hint`` what to run next."""

    kind: ClassVar[str] = "internal"
    grpc_status: ClassVar[Status] = Status.INTERNAL
    exit_code: ClassVar[int] = 1
    default_hint: ClassVar[str] = "Run with LORACTL_DEBUG=1 for details, and check the daemon's log."

    def __init__(self, message: str, hint: str | None = None) -> None:
        # One line each, whatever a wrapped library's exception text looked like.
        message = one_line(message)
        super().__init__(message)
        self.message = message
        self.hint = one_line(hint if hint is not None else self.default_hint)

    def __str__(self) -> str:
        return self.message


class DaemonNotRunning(LoractlError):
    kind = "daemon_not_running"
    grpc_status = Status.UNAVAILABLE
    exit_code = 3
    default_hint = "Start it with: loractld --model demo"


class DaemonExited(DaemonNotRunning):
    """No daemon listens because the last one of this home failed: ``message`` is its error.
    ``exited_at`` is when (seconds since the epoch; loractl/daemon_exit.py)."""

    kind = "daemon_exited"

    def __init__(self, message: str, hint: str | None = None, *, exited_at: float = 0.0) -> None:
        super().__init__(message, hint)
        self.exited_at = exited_at


class InvalidRequest(LoractlError):
    kind = "invalid_request"
    grpc_status = Status.INVALID_ARGUMENT
    exit_code = 2
    default_hint = "See: loractl COMMAND --help"


class AdapterNotFound(LoractlError):
    kind = "adapter_not_found"
    grpc_status = Status.NOT_FOUND
    exit_code = 4
    default_hint = "Give the path of a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."


class InvalidAdapter(LoractlError):
    kind = "invalid_adapter"
    grpc_status = Status.FAILED_PRECONDITION
    exit_code = 5
    default_hint = "Check the adapter's adapter_config.json and weights against the base model."


class EngineUnavailable(LoractlError):
    kind = "engine_unavailable"
    grpc_status = Status.UNAVAILABLE
    exit_code = 6
    default_hint = "Check the daemon's log; restart it with: loractld --model MODEL"


class Cancelled(LoractlError):
    kind = "cancelled"
    grpc_status = Status.CANCELLED
    exit_code = 130
    default_hint = "The request was cancelled (daemon shutting down or client gone); run it again."


class SourceUnavailable(LoractlError):
    kind = "source_unavailable"
    grpc_status = Status.UNAVAILABLE
    exit_code = 7
    default_hint = "Check the network, HF_ENDPOINT and HF_TOKEN, then pull again."


class DiskFull(LoractlError):
    kind = "disk_full"
    grpc_status = Status.RESOURCE_EXHAUSTED
    exit_code = 8
    default_hint = "Free space (loractl rm NAME removes adapters) and pull again."


class PermissionDenied(LoractlError):
    kind = "permission_denied"
    grpc_status = Status.PERMISSION_DENIED
    exit_code = 9
    default_hint = "Run it as the daemon's user, root, or a member of the daemon's socket group."


# Characters. An error may echo what the caller sent, which can be 100 kB long; a gRPC status
# travels in a trailer, which clients cap (grpcio: 8 KiB), and JSON escapes each astral
# character as 12 bytes: 300 + 300 such characters still fit.
MAX_LINE = 300


_FULL_DISK = (28, 122)   # ENOSPC, EDQUOT: the same on Linux and macOS's errno for ENOSPC


def of_os_error(error: BaseException) -> BaseException:
    """``error`` as the domain error a user can cause, where it is one: a write that found the
    disk (or the user's quota) full is :class:`DiskFull`, wherever it was written; any other
    error is returned as it is (an internal error of its own)."""
    if isinstance(error, OSError) and error.errno in _FULL_DISK:
        where = f" writing {error.filename}" if error.filename else ""
        full = DiskFull(f"the disk is full{where} ({error.strerror or 'no space left'})",
                        "Free space on the store's disk (loractl rm NAME removes adapters) and run the command "
                        "again; what it would have changed was not changed.")
        full.__cause__ = error
        return full
    return error


def one_line(text: str) -> str:
    """``text`` on one line, clipped to MAX_LINE characters (as every error message and hint)."""
    line = re.sub(r"\s*\n\s*", " ", str(text)).strip()
    if len(line) > MAX_LINE:  # found by tests/test_fuzz_grpc.py: grpcio saw no error of ours
        line = f"{line[:MAX_LINE]}... ({len(line) - MAX_LINE} more characters)"
    return line


_BY_KIND: dict[str, type[LoractlError]] = {
    cls.kind: cls
    for cls in (LoractlError, DaemonNotRunning, DaemonExited, InvalidRequest, AdapterNotFound, InvalidAdapter,
                EngineUnavailable, Cancelled, SourceUnavailable, DiskFull, PermissionDenied)
}


def to_wire(error: LoractlError) -> str:
    """The gRPC status message for a domain error: JSON, so kind and hint survive the trip."""
    return json.dumps({"kind": error.kind, "message": error.message, "hint": error.hint})


def from_wire(status: Status, wire_message: str | None) -> LoractlError:
    """Rebuild the domain error a daemon sent; any other gRPC error becomes a generic one."""
    try:
        payload = json.loads(wire_message or "")
        cls = _BY_KIND.get(payload["kind"], LoractlError)
        return cls(str(payload["message"]), str(payload["hint"]))
    except (ValueError, KeyError, TypeError):
        if status in (Status.UNAVAILABLE,):
            return DaemonNotRunning(f"the daemon is unavailable: {wire_message or status.name}")
        if status is Status.CANCELLED:
            return Cancelled(wire_message or "the request was cancelled")
        return LoractlError(f"the daemon answered {status.name}: {wire_message or 'no message'}")
