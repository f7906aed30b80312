"""One unary gRPC call over a blocking socket, for ``loractl ls``: asyncio plus grpclib were
~45 ms of that command's start-up, more than the rest of its work.

Only the plain success is handled here; anything else (no daemon, a gRPC error status, a reset,
an unexpected frame) returns None and the caller repeats the call through ``loractl.Client``,
which reports it exactly as always. That is only right for read-only calls such as List.
"""

from __future__ import annotations

import os
import struct

CONTENT_TYPE = b"application/grpc+proto"


def unary(socket_path: str, method: str, request: bytes) -> bytes | None:
    """The reply message of ``method`` (``/pkg.Service/Method``), or None: see the module."""
    import socket

    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.settimeout(10.0)  # a stuck exchange falls back to the full client, which waits as it always has
        sock.connect(socket_path)
        return _exchange(sock, method, request)
    except Exception:  # noqa: BLE001 - every failure is reported by the full client's retry
        return None
    finally:
        sock.close()


# HTTP/2 frame types and flags (RFC 9113, section 6) this exchange reads or writes.
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _CONTINUATION = 0, 1, 3, 4, 6, 7, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_FRAME = 16384     # the size every peer must accept before any SETTINGS
_MAX_WINDOW = 2**31 - 1
_STREAM = 1            # the client's first stream


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _exchange(sock, method: str, request: bytes) -> bytes | None:
    """One gRPC call on a fresh HTTP/2 connection, framed here: the h2 package's state machine
    cost ~20 ms of import, a third of the command. Only hpack (header compression) is borrowed.

    The client opens every window to the maximum at once (SETTINGS and a connection
    WINDOW_UPDATE), so a reply of any size needs no flow control on the way in; anything this
    code does not expect (a reset, GOAWAY, a frame on another stream, an oversized request)
    returns None and the caller asks again through the full client."""
    import hpack

    message = struct.pack(">?I", False, len(request)) + request
    if len(message) > _MAX_FRAME:
        return None
    headers = hpack.Encoder().encode([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
        (b":authority", b"localhost"), (b"te", b"trailers"), (b"content-type", CONTENT_TYPE),
    ])
    if len(headers) > _MAX_FRAME:
        return None
    settings = struct.pack(">HI", 0x2, 0) + struct.pack(">HI", 0x4, _MAX_WINDOW)  # no push; open stream windows
    sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0, settings)
                 + _frame(8, 0, 0, struct.pack(">I", _MAX_WINDOW - 65535))  # WINDOW_UPDATE, connection
                 + _frame(_HEADERS, _END_HEADERS, _STREAM, headers)
                 + _frame(_DATA, _END_STREAM, _STREAM, message))
    decoder = hpack.Decoder()
    frames = _Frames(sock)
    body = bytearray()
    block = bytearray()   # a header block, across CONTINUATION frames
    blocks: list[dict] = []
    ended = False         # END_STREAM seen; the trailers' CONTINUATION frames may still come
    while True:
        frame = frames.next()
        if frame is None:
            return None
        kind, flags, stream, payload = frame
        if kind == _SETTINGS and not flags & _ACK:
            sock.sendall(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            sock.sendall(_frame(_PING, _ACK, 0, payload))
        elif kind in (_GOAWAY, _RST_STREAM):
            return None
        elif kind in (_DATA, _HEADERS, _CONTINUATION):
            if stream != _STREAM:
                return None
            if kind != _CONTINUATION:
                payload = _unpad(payload, flags, priority=kind == _HEADERS)
                if payload is None:
                    return None
            if kind == _DATA:
                body += payload
            else:
                block += payload
                if flags & _END_HEADERS:
                    blocks.append({k: v for k, v in decoder.decode(bytes(block), raw=True)})
                    block.clear()
            ended = ended or bool(flags & _END_STREAM and kind != _CONTINUATION)
            if ended and not block:
                return _reply(blocks, bytes(body))


def _reply(blocks: list[dict], body: bytes) -> bytes | None:
    """The message when the reply was headers 200 (no grpc-status: a trailers-only reply is
    an error), the message, then trailers with grpc-status 0."""
    if len(blocks) != 2:
        return None
    headers, trailers = blocks
    if (headers.get(b":status") != b"200" or b"grpc-status" in headers
            or not headers.get(b"content-type", b"").startswith(b"application/grpc")):
        return None
    return _message(body) if trailers.get(b"grpc-status") == b"0" else None


def _unpad(payload: bytes, flags: int, priority: bool) -> bytes | None:
    start, end = 0, len(payload)
    if flags & _PADDED:
        if not payload:
            return None
        start, end = 1, len(payload) - payload[0]
    if priority and flags & _PRIORITY:
        start += 5
    return payload[start:end] if start <= end else None


class _Frames:
    """Frames read off a blocking socket, one at a time."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def next(self) -> tuple[int, int, int, bytes] | None:
        while True:
            if len(self.buffer) >= 9:
                length = int.from_bytes(self.buffer[:3], "big")
                if len(self.buffer) >= 9 + length:
                    kind, flags, stream = struct.unpack(">BBI", self.buffer[3:9])
                    payload = bytes(self.buffer[9:9 + length])
                    del self.buffer[:9 + length]
                    return kind, flags, stream & 0x7FFFFFFF, payload
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data


def _message(body: bytes) -> bytes | None:
    """The single, uncompressed length-prefixed message a unary reply carries."""
    if len(body) < 5:
        return None
    compressed, length = struct.unpack(">?I", body[:5])
    if compressed or len(body) != 5 + length:
        return None
    return body[5:]


def explicit_socket(socket: str | None) -> str | None:
    """The socket the user named (``--socket`` or ``$LORACTL_SOCKET``), as ``Client`` resolves
    it; None when the registry decides (that path already costs what this module saves)."""
    chosen = socket or os.environ.get("LORACTL_SOCKET")
    if not chosen:
        return None
    # paths.socket_path's Path(chosen).expanduser().absolute(), without pathlib's and
    # dataclasses' import (loractl.paths): the same file for connect(), ".." left to the kernel.
    chosen = os.path.expanduser(chosen)
    return chosen if os.path.isabs(chosen) else os.path.join(os.getcwd(), chosen)


def reply(socket: str | None, home: str | None, method: str, request, reply_type) -> dict | None:
    """``method``'s reply as ``loractl.client.to_dict`` gives it, asked of the named socket or the
    one daemon the registry lists (``_quick_registry``); None: ask through ``Client`` instead."""
    answer = message(socket, home, method, request, reply_type)
    if answer is None:
        return None
    from loractl.messages import to_dict

    return to_dict(answer)


def message(socket: str | None, home: str | None, method: str, request, reply_type):
    """``method``'s reply message, as :func:`reply` asks for it; None: ask through ``Client``."""
    path = explicit_socket(socket)
    if path is None and not os.environ.get("LORACTL_SOCKET"):
        from loractl.cli._quick_registry import discovered_socket

        path = discovered_socket(home)
    if path is None:
        return None
    answer = unary(path, method, request.SerializeToString())
    return None if answer is None else reply_type.FromString(answer)
