"""The Dynamo door's flags. Standard library only: a daemon without ``--dynamo`` never imports
the Dynamo runtime."""

from __future__ import annotations

import argparse
import importlib.util
import re
from dataclasses import dataclass

from loractl.errors import InvalidRequest

DISCOVERY_BACKENDS = ("etcd", "file", "kubernetes")
DEFAULT_NAMESPACE = "dynamo"
COMPONENT = "loractl"       # the component every loractl worker serves under, in its namespace
_NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(frozen=True)
class DynamoSettings:
    enabled: bool = False
    discovery: str = "etcd"
    namespace: str = DEFAULT_NAMESPACE

    @property
    def generate_path(self) -> str:
        return f"{self.namespace}.{COMPONENT}.generate"

    def path(self, endpoint: str) -> str:
        return f"{self.namespace}.{COMPONENT}.{endpoint}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dynamo", action="store_true",
                        help="join an NVIDIA Dynamo fleet as a worker: register the base model and one LoRA card "
                             "per stored adapter, serve the frontend's requests (needs the 'dynamo' extra)")
    parser.add_argument("--dynamo-discovery", choices=DISCOVERY_BACKENDS, default="etcd",
                        help="how Dynamo's frontend finds this worker: etcd (ETCD_ENDPOINTS), file (DYN_FILE_KV, "
                             "a folder shared with the frontend) or kubernetes (default: etcd)")
    parser.add_argument("--dynamo-namespace", metavar="NS", default=DEFAULT_NAMESPACE,
                        help=f"the Dynamo namespace to register in (default: {DEFAULT_NAMESPACE})")


def settings_from(args: argparse.Namespace) -> DynamoSettings:
    if not _NAMESPACE.match(args.dynamo_namespace):
        raise InvalidRequest(f"not a Dynamo namespace: {args.dynamo_namespace!r}",
                             "Use lowercase letters, digits, '-' and '_' (at most 63), e.g. --dynamo-namespace dynamo.")
    if args.dynamo and importlib.util.find_spec("dynamo") is None:
        # Before the engine starts: a missing runtime fails in a second, not after the engine's start-up.
        raise InvalidRequest("--dynamo needs the Dynamo runtime, which is not installed",
                             "Install the extra: pip install 'loractl[dynamo]' (the ai-dynamo-runtime wheel).")
    return DynamoSettings(enabled=bool(args.dynamo), discovery=args.dynamo_discovery, namespace=args.dynamo_namespace)
