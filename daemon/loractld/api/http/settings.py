"""The HTTP API's flags and the checks made before anything starts.

Standard library only: a daemon without ``--http`` never imports FastAPI or uvicorn.

Invariant: the API never listens beyond the loopback interface without an API key. The key is
read from a file (``--api-key-file``), never from the command line, where every local user
could read it in the process list.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import InvalidRequest, LoractlError

_log = logging.getLogger("loractld.http")
DEFAULT_MAX_BODY = 4 << 20
DEFAULT_MAX_CONCURRENCY = 256
DEFAULT_MAX_CHOICES = 128          # prompts x n in one request: vLLM's CPU default of sequences per step
DEFAULT_MAX_CONNECTIONS = 512      # well under the usual 1024 file descriptors a process starts with
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER = 64 << 10      # request line and headers; uvicorn's h11 mode allows 16 KiB
DEFAULT_BODY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpSettings:
    address: tuple[str, int] | None = None    # None: only a socket systemd passes (socket activation)
    api_key: bytes | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_choices: int = DEFAULT_MAX_CHOICES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (uvicorn's forwarded_allow_ips);
    # None: no proxy header is ever read, so the caller in the audit and the uid check is the peer.
    forwarded_allow_ips: str | None = None


def add_arguments(parser: argparse.ArgumentParser, parse_size, positive_int, positive_seconds) -> None:
    parser.add_argument("--http", metavar="HOST:PORT",
                        help="also serve the OpenAI-compatible HTTP API there, e.g. 127.0.0.1:8000 (default: off)")
    parser.add_argument("--api-key-file", metavar="FILE",
                        help="HTTP clients must send the key in this file as 'Authorization: Bearer KEY' "
                             "(required when --http is not a loopback address)")
    parser.add_argument("--http-max-body", type=parse_size, default=DEFAULT_MAX_BODY, metavar="SIZE",
                        help="refuse HTTP request bodies larger than this with 413 (default: 4MiB)")
    parser.add_argument("--http-max-concurrency", type=positive_int, default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                        help="answer generation requests past N at once with 429 (default: 256)")
    parser.add_argument("--http-max-choices", type=positive_int, default=DEFAULT_MAX_CHOICES, metavar="N",
                        help="refuse a request for more than N generations (prompts x n) with 400 "
                             f"(default: {DEFAULT_MAX_CHOICES})")
    parser.add_argument("--http-max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="keep at most N HTTP connections open: one more closes the one waiting longest "
                             "for a request head, or gets 503 when all N are running requests "
                             f"(default: {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--http-header-timeout", type=positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S,
                        metavar="SECONDS", help="close a connection whose request head (line and headers) is not "
                                                f"complete after this long (default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--http-max-header-size", type=parse_size, default=DEFAULT_MAX_HEADER, metavar="SIZE",
                        help="answer a request line and headers larger than this with 431 and close the "
                             "connection (default: 64KiB)")
    parser.add_argument("--http-forwarded-allow-ips", metavar="IPS",
                        help="believe X-Forwarded-For/-Proto only from these proxy addresses (comma-separated; "
                             "default: never, so the audit names the real peer)")
    parser.add_argument("--http-body-timeout", type=positive_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                        metavar="SECONDS", help="answer 408 when a request body takes longer than this to arrive "
                                                f"(default: {DEFAULT_BODY_TIMEOUT_S:g})")


def settings_from(args: argparse.Namespace) -> HttpSettings:
    """The HTTP settings; refuses what must not start (see :func:`check_listener`)."""
    address = parse_address(args.http) if args.http else None
    key = read_api_key(Path(args.api_key_file)) if args.api_key_file else None
    settings = HttpSettings(address=address, api_key=key, max_body_bytes=args.http_max_body,
                            max_concurrency=args.http_max_concurrency, max_choices=args.http_max_choices,
                            max_connections=args.http_max_connections, header_timeout_s=args.http_header_timeout,
                            max_header_bytes=args.http_max_header_size,
                            body_timeout_s=args.http_body_timeout,
                            forwarded_allow_ips=args.http_forwarded_allow_ips or None)
    if address is not None:
        check_listener(settings, *address)
    return settings


def check_listener(settings: HttpSettings, host: str, port: int) -> None:
    """No API key, no listening beyond this machine."""
    if settings.api_key is None and not is_loopback(host):
        raise InvalidRequest(f"the HTTP API on {format_url(host, port)} would be reachable from other machines "
                             "without an API key",
                             "Pass --api-key-file FILE (a file holding the key), or listen on 127.0.0.1.")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPV6]:PORT`` or ``:PORT`` (loopback) -> (host, port)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidRequest(f"not an address to listen on: {text!r}", "Use HOST:PORT, e.g. --http 127.0.0.1:8000.")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def read_api_key(path: Path) -> bytes:
    try:
        text = path.read_text().strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read the API key file {path}: {e}",
                             "Point --api-key-file at a readable file holding one key.") from e
    if not text or len(text.splitlines()) != 1:
        raise InvalidRequest(f"the API key file {path} must hold exactly one non-empty line",
                             "Write one key, e.g.: openssl rand -hex 32 > FILE")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        _log.warning("the API key file %s is readable by others than its owner: chmod 600 %s", path, path)
    return text.encode()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine starts, so a taken port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise LoractlError(f"cannot listen on {format_url(host, port)}: {e.strerror or e}",
                           "Stop what listens there (ss -ltnp shows it), or choose another --http address.") from e
    sock.setblocking(False)
    return sock


def format_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6)


def describe_key_state(settings: HttpSettings, url: str) -> str:
    if settings.api_key is not None:
        return f"HTTP API on {url} (bearer API key required)"
    return f"HTTP API on {url} (no API key: every local user can use it)"


