"""Dynamo's LoRA management (``POST /v1/loras``, ``GET /v1/loras``, ``DELETE /v1/loras/NAME`` on the
worker's system port; the ``load_lora``, ``list_loras`` and ``unload_lora`` endpoints behind them).

Load is a pull into the store under ``lora_name`` (a Hub reference or a folder, with the store's
checks: digests, validation against the base model, size caps), then its card; loading a name the
store already holds answers success without pulling again, as Dynamo's own worker does unless
hot swap is on. Unload withdraws the card first (no request is routed here for it any more),
then removes the adapter from the store; a refusal (pinned, in use) puts the card back.
Every answer is Dynamo's ``{"status": "success" | "error", "message", ...}``.

Who calls cannot be known here (the runtime serves the system port and the request plane; no
peer, no key reaches the handler): each load and unload is audited as ``dynamo=system-port``
(``core.policy``), the port listens on loopback unless ``--dynamo-system-host`` says otherwise,
and a ``file://`` source (a folder the daemon would read with its own rights) is refused unless
``--dynamo-allow-folders``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlparse

from loractl.errors import AdapterNotFound, InvalidRequest, LoractlError

from loractld.trust.audit import audited
from loractld.api.dynamo.protocol import described
from loractld.core import policy

# Dynamo's LoRA management: the fleet's operations, by a caller nobody can name.
FLEET_ADMIN = policy.Caller("dynamo", peer="dynamo=system-port", fleet=True)

if TYPE_CHECKING:
    from loractld.api.dynamo.settings import DynamoSettings
    from loractld.core import Core

_log = logging.getLogger("loractld.dynamo")
_HUB_SCHEMES = ("hf", "huggingface")


def pull_ref(uri: str) -> str:
    """What ``loractl pull`` takes for a Dynamo source URI: ``file:///abs`` -> the folder;
    ``hf://org/repo`` and ``org/repo`` as they are; other schemes (s3://, gs://) are refused."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = unquote(parsed.path)
        if parsed.netloc not in ("", "localhost") or not os.path.isabs(path):
            raise InvalidRequest(f"not a local folder URI: {uri!r}", "Use file:///absolute/path.")
        return path
    if parsed.scheme in _HUB_SCHEMES or parsed.scheme == "" or os.path.isabs(uri):
        return uri
    raise InvalidRequest(f"loractl cannot pull from {parsed.scheme}:// sources ({uri})",
                         "Give a Hugging Face Hub id (org/repo or hf://org/repo) or file:///folder.")


class Worker(Protocol):
    """What LoRA management needs of the Dynamo worker (``api.dynamo.worker.DynamoWorker``, which
    builds it): said here so that this module does not import the worker that imports it."""

    core: Core
    settings: DynamoSettings

    async def stored_names(self) -> set[str]: ...

    def lora_id(self, name: str) -> int: ...

    async def publish(self, name: str) -> None: ...

    async def withdraw(self, name: str) -> None: ...


class LoraManagement:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.core = worker.core

    async def load(self, request: dict[str, Any], context=None):
        try:
            name, uri = _load_fields(request)
            ref = pull_ref(uri)
            folder = os.path.isabs(ref)
            async with policy.authorized(FLEET_ADMIN, None, "dynamo-load", f"{name} <- {uri}",
                                         also=not folder or self.worker.settings.allow_folders,
                                         refusal=f"install {name!r} from a folder on this host (file://)",
                                         hint="The daemon would read it with its own rights for a caller it cannot "
                                              "identify: pull it with loractl pull, give a Hub reference, or start "
                                              "loractld with --dynamo-allow-folders."):
                if name not in await self.worker.stored_names():
                    _log.info("dynamo: pulling %s as %s", ref, name)
                    async with contextlib.aclosing(self.core.pull(ref, name=name)) as events:
                        async for _ in events:
                            pass
                    message = f"LoRA adapter '{name}' loaded successfully"
                else:
                    message = f"LoRA adapter '{name}' already loaded"
                await self.worker.publish(name)
        except LoractlError as e:
            yield {"status": "error", "message": described(e), "lora_name": request.get("lora_name")}
            return
        yield {"status": "success", "message": message, "lora_name": name, "lora_id": self.worker.lora_id(name),
               "hot_swap": False}

    async def unload(self, request: dict[str, Any], context=None):
        name = (request or {}).get("lora_name")
        try:
            if not isinstance(name, str) or not name:
                raise InvalidRequest("unload_lora needs a lora_name")
            if name not in await self.worker.stored_names():
                raise AdapterNotFound(f"LoRA adapter '{name}' not found",
                                      "GET /v1/loras lists the adapters this worker holds.")
            lora_id = self.worker.lora_id(name)
            async with audited(FLEET_ADMIN.principal, "dynamo-unload", name):  # always allowed: audited only
                await self.worker.withdraw(name)
                try:
                    await self.core.remove(name)
                except LoractlError:
                    await self.worker.publish(name)  # still stored: still served
                    raise
        except LoractlError as e:
            yield {"status": "error", "message": described(e), "lora_name": name}
            return
        yield {"status": "success", "message": f"LoRA adapter '{name}' unloaded successfully", "lora_name": name,
               "lora_id": lora_id}

    async def list(self, request: dict[str, Any] | None = None, context=None):
        try:
            names = sorted(await self.worker.stored_names())
        except LoractlError as e:
            yield {"status": "error", "message": described(e)}
            return
        yield {"status": "success", "loras": {n: self.worker.lora_id(n) for n in names}, "count": len(names)}


def _load_fields(request: Any) -> tuple[str, str]:
    if not isinstance(request, dict):
        raise InvalidRequest("load_lora needs a JSON object")
    name, source = request.get("lora_name"), request.get("source")
    uri = source.get("uri") if isinstance(source, dict) else None
    if not isinstance(name, str) or not name or not isinstance(uri, str) or not uri:
        raise InvalidRequest("load_lora needs lora_name and source.uri",
                             'Send {"lora_name": "sql-expert/v1", "source": {"uri": "org/repo"}}.')
    return name, uri
