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
        sock.connect(socket_path)
        return _exchange(sock, method, request)
    except Exception:  # noqa: BLE001 - every failure is reported by the full client's retry
        return None
    finally:
        sock.close()


def _exchange(sock, method: str, request: bytes) -> bytes | None:
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(stream_id, [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
        (b":authority", b"localhost"), (b"te", b"trailers"), (b"content-type", CONTENT_TYPE),
    ])
    conn.send_data(stream_id, struct.pack(">?I", False, len(request)) + request, end_stream=True)
    sock.sendall(conn.data_to_send())
    body = bytearray()
    status_ok = headers_ok = False
    while True:
        data = sock.recv(65536)
        if not data:
            return None
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                headers = dict(event.headers)
                # A trailers-only reply (grpc-status in the headers) is an error: the full client reports it.
                headers_ok = (headers.get(b":status") == b"200" and b"grpc-status" not in headers
                              and headers.get(b"content-type", b"").startswith(b"application/grpc"))
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.TrailersReceived):
                status_ok = dict(event.headers).get(b"grpc-status") == b"0"
            elif isinstance(event, h2.events.StreamEnded):
                return _message(bytes(body)) if headers_ok and status_ok else None
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                return None
        pending = conn.data_to_send()
        if pending:
            sock.sendall(pending)


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
    path = explicit_socket(socket)
    if path is None and not os.environ.get("LORACTL_SOCKET"):
        from loractl.cli._quick_registry import discovered_socket

        path = discovered_socket(home)
    if path is None:
        return None
    answer = unary(path, method, request.SerializeToString())
    if answer is None:
        return None
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(reply_type.FromString(answer), preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
