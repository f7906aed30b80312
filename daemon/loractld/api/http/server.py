"""uvicorn, run inside the daemon's own event loop, on a socket bound before the engine starts.

Why uvicorn and FastAPI: vLLM already brings both (its own OpenAI server is built on them), so
the HTTP door costs no new dependency, and both are well kept; a hand-written HTTP layer would
have to get keep-alive, chunking, disconnects and request smuggling right on its own.

uvicorn normally owns the process: it installs SIGINT/SIGTERM handlers and re-raises the
signal when it stops. Here the daemon owns the signals and the shutdown order (drain the core,
then close the HTTP and gRPC doors, then stop the engine), so :class:`_InLoopServer` leaves the
signals alone and is stopped by the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from loractl.errors import LoractlError
from loractld.api.http.app import build_app
from loractld.api.http.connections import capped_protocol
from loractld.api.http.settings import HttpSettings, describe_key_state, format_url
from loractld.core import Core

_log = logging.getLogger("loractld.http")


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the daemon's loop handles SIGTERM/SIGINT and stops this server itself


class HttpFrontEnd:
    """The running HTTP API; :meth:`close` stops it (connections get ``grace_s`` to finish)."""

    def __init__(self, server: _InLoopServer, task: asyncio.Task, url: str) -> None:
        self._server = server
        self._task = task
        self.url = url

    @classmethod
    async def start(cls, core: Core, settings: HttpSettings, sock: socket.socket, *, grace_s: float = 5.0,
                    debug: bool = False, socket_gid: int | None = None) -> HttpFrontEnd:
        host, port = sock.getsockname()[:2]
        if not debug:
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
                logging.getLogger(name).setLevel(logging.WARNING)
        config = uvicorn.Config(build_app(core, settings, socket_gid=socket_gid), lifespan="off", log_config=None,
                                access_log=debug, server_header=False, ws="none", timeout_graceful_shutdown=grace_s,
                                # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local
                                # process could then name another caller in the audit line.
                                proxy_headers=settings.forwarded_allow_ips is not None,
                                forwarded_allow_ips=settings.forwarded_allow_ips or "")
        config.load()
        config.http_protocol_class = capped_protocol(config.http_protocol_class,
                                                     max_connections=settings.max_connections,
                                                     header_timeout_s=settings.header_timeout_s,
                                                     max_head_bytes=settings.max_header_bytes)
        server = _InLoopServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                error = task.exception() if not task.cancelled() else None
                raise LoractlError(f"the HTTP API did not start: {error or 'cancelled'}",
                                   "See the daemon's log; run with --log-level DEBUG for uvicorn's own.") from error
            await asyncio.sleep(0.01)
        url = format_url(host, port)
        _log.info("%s", describe_key_state(settings, url))
        return cls(server, task, url)

    async def close(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        if not self._task.done():
            self._server.force_exit = True
            self._task.cancel()
