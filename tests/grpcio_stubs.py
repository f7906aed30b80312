"""grpcio, the reference gRPC implementation, as a second client of loractld.

The daemon speaks grpclib; ``loractl.Client`` does too, so a bug shared by both ends of the same
library would go unseen. These stubs are generated from the .proto at test time with
grpc_tools.protoc (nothing generated is committed, so nothing can go stale) and run over
grpcio's own HTTP/2 stack (C core). Only the message classes (``loractl_pb2``) are shared.

Also: a handful of protobuf wire-format helpers, for sending bytes no generated class would
produce (wrong wire types, invalid UTF-8, truncated varints).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import grpc

from loractl.v1 import loractl_pb2 as pb

REPO = Path(__file__).resolve().parent.parent
PROTO = "loractl/v1/loractl.proto"
SERVICE = "/loractl.v1.Loractl/"
# Every RPC of the service, with its request class and whether the reply is a stream.
RPCS: dict[str, tuple[type, bool]] = {
    "Status": (pb.StatusRequest, False), "Generate": (pb.GenerateRequest, True),
    "GenerateMany": (pb.GenerateManyRequest, True),   # a request stream too: raw_call sends one, then ends
    "Pull": (pb.PullRequest, True), "List": (pb.ListRequest, False), "Show": (pb.ShowRequest, False),
    "Remove": (pb.RemoveRequest, False), "Load": (pb.LoadRequest, False), "Evict": (pb.EvictRequest, False),
    "Pin": (pb.PinRequest, False), "Unpin": (pb.NameRequest, False), "Events": (pb.EventsRequest, True),
    "Metrics": (pb.MetricsRequest, False), "Create": (pb.CreateRequest, False), "Copy": (pb.CopyRequest, False),
    "Merge": (pb.MergeRequest, False), "SetAdmission": (pb.AdmissionRequest, False),
}


def generate_stubs(out: Path) -> ModuleType:
    """Run grpc_tools.protoc --grpc_python_out into ``out``; import the stub module from there."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--grpc_python_out={out}", PROTO],
                   cwd=REPO, check=True)
    path = out / "loractl" / "v1" / "loractl_pb2_grpc.py"
    spec = importlib.util.spec_from_file_location("grpcio_loractl_pb2_grpc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def channel(socket: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{Path(socket).resolve()}")


def raw_call(chan: grpc.Channel, rpc: str, payload: bytes, timeout: float = 30) -> list[bytes]:
    """Send ``payload`` as the request of ``rpc`` unparsed; return the raw replies (grpc.RpcError on a status)."""
    streaming = RPCS[rpc][1]
    if rpc == "GenerateMany":
        call = chan.stream_stream(SERVICE + rpc, request_serializer=None, response_deserializer=None)
        return list(call(iter([payload]), timeout=timeout))
    if streaming:
        call = chan.unary_stream(SERVICE + rpc, request_serializer=None, response_deserializer=None)
        replies = []
        for reply in call(payload, timeout=timeout):
            replies.append(reply)
            if rpc == "Events":
                break  # endless by design; one event (or none, as here) is enough
        return replies
    call = chan.unary_unary(SERVICE + rpc, request_serializer=None, response_deserializer=None)
    return [call(payload, timeout=timeout)]


def wire_error(error: grpc.RpcError) -> dict:
    """The daemon's error payload (loractl.errors.to_wire: kind, message, hint) from a status."""
    return json.loads(error.details())


# -- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) ------------------
def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative numbers are ten-byte two's complement, as protobuf sends them
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes | int) -> bytes:
    """One field: wire type 0 (varint, ``payload`` an int), 1 (8 bytes), 2 (length-delimited), 5 (4 bytes)."""
    key = varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + varint(payload)
    if wire_type == 2:
        return key + varint(len(payload)) + payload
    return key + payload
