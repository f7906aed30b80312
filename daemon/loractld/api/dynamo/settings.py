"""The Dynamo door's flags. Standard library only: a daemon without ``--dynamo`` never imports
the Dynamo runtime."""

from __future__ import annotations

import argparse
import importlib.util
import os
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
    # The runtime's system port (/health, /v1/loras) listens here. Dynamo's own default is every
    # interface, and its LoRA routes cannot tell who calls (no key, no peer): loopback unless told.
    system_host: str = "127.0.0.1"
    # Whether Dynamo's load_lora may name a folder on this host (file://): the daemon reads it with
    # its own rights, for a caller it cannot identify. Hub references are always allowed.
    allow_folders: bool = False

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
    parser.add_argument("--dynamo-system-host", metavar="HOST", default=None,
                        help="the address of the runtime's system port (/health, /v1/loras) (default: "
                             "DYN_SYSTEM_HOST if set, else 127.0.0.1; Dynamo's own default is every interface)")
    parser.add_argument("--dynamo-allow-folders", action="store_true",
                        help="let Dynamo's load_lora (POST /v1/loras) install from a folder on this host "
                             "(file://): the daemon reads it with its own rights (default: Hub references only)")


def settings_from(args: argparse.Namespace) -> DynamoSettings:
    if not _NAMESPACE.match(args.dynamo_namespace):
        raise InvalidRequest(f"not a Dynamo namespace: {args.dynamo_namespace!r}",
                             "Use lowercase letters, digits, '-' and '_' (at most 63), e.g. --dynamo-namespace dynamo.")
    if args.dynamo and importlib.util.find_spec("dynamo") is None:
        # Before the engine starts: a missing runtime fails in a second, not after the engine's start-up.
        raise InvalidRequest("--dynamo needs the Dynamo runtime, which is not installed",
                             "Install the extra: pip install 'loractl[dynamo]' (the ai-dynamo-runtime wheel).")
    host = args.dynamo_system_host or os.environ.get("DYN_SYSTEM_HOST") or "127.0.0.1"
    return DynamoSettings(enabled=bool(args.dynamo), discovery=args.dynamo_discovery, namespace=args.dynamo_namespace,
                          system_host=host, allow_folders=bool(args.dynamo_allow_folders))
