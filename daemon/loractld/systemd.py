"""systemd integration without a dependency: sd_notify, the watchdog, socket activation.

sd_notify is one datagram to ``$NOTIFY_SOCKET`` (a leading ``@`` is the abstract namespace).
The environment is captured once, at import of the daemon, because the engine module clears
``NOTIFY_SOCKET`` and ``LISTEN_*`` before vLLM spawns children (with NotifyAccess=main,
systemd would otherwise reject or misattribute their messages).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

SD_LISTEN_FDS_START = 3


@dataclass(frozen=True)
class SystemdEnv:
    notify_socket: str | None
    watchdog_usec: int | None
    listen_fds: int

    @classmethod
    def capture(cls) -> SystemdEnv:
        watchdog = os.environ.get("WATCHDOG_USEC")
        watchdog_pid = os.environ.get("WATCHDOG_PID")
        if watchdog_pid and watchdog_pid != str(os.getpid()):
            watchdog = None
        listen = 0
        if os.environ.get("LISTEN_PID") == str(os.getpid()):
            listen = int(os.environ.get("LISTEN_FDS", "0") or 0)
        return cls(os.environ.get("NOTIFY_SOCKET") or None, int(watchdog) if watchdog else None, listen)

    def notify(self, *fields: str) -> bool:
        """Send ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``; False without systemd."""
        if not self.notify_socket:
            return False
        address = self.notify_socket
        if address.startswith("@"):
            address = "\0" + address[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.connect(address)
                sock.sendall("\n".join(fields).encode())
            except OSError:
                return False
        return True

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1: half the timeout systemd set."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def activated_sockets(self) -> list[socket.socket]:
        """The listening sockets systemd passed us (socket activation), in its order; each
        one's family says what it is for (Unix: gRPC, TCP: the HTTP API)."""
        sockets = []
        for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + self.listen_fds):
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            sockets.append(sock)
        return sockets
