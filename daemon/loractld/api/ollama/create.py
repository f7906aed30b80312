"""``HEAD``/``POST /api/blobs/sha256:<hex>``, ``POST /api/create`` and ``POST /api/copy``: Ollama's
way of making a model, as loractl's profiles (``core.profiles``).

- blobs: an upload verified against its digest while it streams, bounded and counted against a
  quota, written atomically (``store.blobs``); HEAD says whether one is stored (200) or not (404);
- create: ``from`` (the base model, a stored adapter or a profile), ``adapters`` (a PEFT
  adapter's files, ``adapter_config.json`` and ``adapter_model.safetensors``, by blob digest:
  assembled into a folder and pulled from it as ``loractl pull FOLDER`` does — validated, loaded
  once by the engine's own loader — under the name ``<model>-adapter``, and removed again when
  the create then fails: a refused create leaves no adapter behind), ``system``,
  ``template`` (Jinja), ``parameters``, ``messages``, ``license``: one profile, as ``loractl
  create`` makes it. Its status lines are Ollama's (``using existing layer sha256:...``, ...,
  ``writing manifest``, ``success``). ``quantize`` and ``files`` (a GGUF or safetensors base
  model) are refused by name: the daemon serves the one base model it started with;
- copy: ``loractl cp`` (a profile or an adapter under a new name).

Who may upload, create and copy: the one policy (``core.policy.authorized``, the rule pull
follows on this door), each call one audit line, allowed or refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from loractl.errors import InvalidRequest
from starlette.requests import Request
from starlette.responses import Response

from loractld.api.http.errors import HttpError
from loractld.api.ollama.generation import checked_name, not_found
from loractld.api.ollama.names import LATEST, resolve
from loractld.api.ollama.options import refusal
from loractld.api.ollama.pulls import progress_line
from loractld.core import policy
from loractld.core.profile_sources import CreatePulls, undone_on_failure
from loractld.core.profiles import ADAPTER_FILES, CONFIG_FILE, Blobs, Modelfile, blob_hex, combined

if TYPE_CHECKING:
    from loractld.core import Core

CREATE_FIELDS = {"model", "name", "from", "files", "adapters", "system", "template", "parameters", "messages",
                 "license", "stream", "quantize", "modelfile", "path"}
BLOB_RATE_FLOOR = 16 << 20   # bytes/s an upload keeps above past its first --http-body-timeout
_SIMPLE_TYPES = ("text/plain", "multipart/form-data", "application/x-www-form-urlencoded")
_HINT = ("Send the daemon's API key (--api-key-file), or call as root, the daemon's user or a member of its "
         "socket group (as loractl pull/create would).")


def store_name(name: str) -> str:
    """An Ollama model name as loractl names a profile: ``x:latest`` -> ``x``, ``x:v1`` -> ``x/v1``,
    ``org/m:v1`` -> ``org/m-v1`` (a name has one ``/``: the tag is kept, ``names.candidates`` maps it back)."""
    name = name.strip().lower()
    model, colon, tag = name.rpartition(":")
    if not colon:
        return name
    if tag == LATEST:
        return model
    return f"{model}-{tag}" if "/" in model else f"{model}/{tag}"


def listed_as(name: str) -> str:
    """The Ollama name a namespaced model is listed under (``org/m`` -> ``org/m:latest``); "" for
    one whose store name lists it already (``x:v1``, stored as ``x/v1``)."""
    name = name.strip().lower()
    model, colon, tag = name.rpartition(":")
    if not colon:
        model, tag = name, LATEST
    return f"{model}:{tag}" if "/" in model else ""


class CreateDoor:
    """The three routes' work, for one app (the blobs are opened at the first upload)."""

    def __init__(self, core: Core, body_timeout_s: float) -> None:
        self.core = core
        self.body_timeout_s = body_timeout_s
        # One assembly of a set of files at a time: its folder is named by their content, and
        # creates that send the same blobs at once would otherwise empty it under each other.
        self._assembling: dict[Path, asyncio.Lock] = {}

    async def blobs(self) -> Blobs:
        return await self.core.blob_store()

    # -- blobs -----------------------------------------------------------------------------
    async def has_blob(self, digest: str) -> Response:
        blobs = await self.blobs()
        return Response(status_code=200 if await asyncio.to_thread(blobs.has, f"sha256:{_hex(digest)}") else 404)

    async def upload(self, request: Request, caller: policy.Caller, digest: str) -> Response:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind in _SIMPLE_TYPES:
            # A web page may send these cross-origin without asking (no CORS preflight): a blob is
            # raw bytes, sent with no type or application/octet-stream, as the ollama client does.
            raise HttpError(415, f"a blob is not sent as {kind}", "Send the file's bytes with no Content-Type or "
                            "Content-Type: application/octet-stream.", code="unsupported_media_type")
        blobs = await self.blobs()
        hex_ = _hex(digest)
        declared = request.headers.get("content-length", "")
        async with policy.authorized(caller, self.core.socket_gid, "upload", f"sha256:{hex_}",
                                     refusal="upload blobs over HTTP", hint=_HINT):
            size = int(declared) if declared.isdigit() else None
            created = await blobs.write(f"sha256:{hex_}", self._chunks(request, size), size)
        return Response(status_code=201 if created else 200)

    async def _chunks(self, request: Request, declared: int | None = None) -> AsyncIterator[bytes]:
        """The body, whole within its deadline: ``--http-body-timeout``, plus the time its size
        (declared, else what has arrived) takes at :data:`BLOB_RATE_FLOOR`. A deadline per body,
        not per piece: a trickle of a byte every few seconds is cut (408) and gives back the
        quota its declared size holds, while a 2 GiB adapter sent at disk speed arrives whole."""
        loop = asyncio.get_running_loop()
        started, received = loop.time(), 0
        stream = request.stream()
        while True:
            allowed = self.body_timeout_s + (declared if declared is not None else received) / BLOB_RATE_FLOOR
            try:
                async with asyncio.timeout_at(started + allowed):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError as e:
                raise HttpError(408, f"the upload did not arrive within {allowed:.3g} s (--http-body-timeout "
                                f"{self.body_timeout_s:g} s, plus its size at {BLOB_RATE_FLOOR >> 20} MiB/s)",
                                "Send the file at once, or raise loractld --http-body-timeout.", code="body_timeout",
                                headers={"Connection": "close"}) from e
            if chunk:
                received += len(chunk)
                yield chunk

    # -- copy ------------------------------------------------------------------------------
    async def copy(self, caller: policy.Caller, req: dict) -> Response:
        source, destination = req.get("source"), req.get("destination")
        if not isinstance(source, str) or not source or not isinstance(destination, str) or not destination:
            raise refusal("source and destination are required", "Send {\"source\": ..., \"destination\": ...}.")
        checked_name(self.core, source, "source")   # before the store is asked (a 300-character name)
        checked_name(self.core, destination, "destination")
        target = await self._target(source)
        if target is None:
            raise refusal(f"{source!r} is the base model: it cannot be copied", "Copy an adapter or a profile; or "
                          f"create a profile from the base model (POST /api/create with from {source!r}).",
                          param="source")
        async with policy.authorized(caller, self.core.socket_gid, "copy", f"{target} to {store_name(destination)}",
                                     refusal="copy models over HTTP", hint=_HINT):
            await self.core.copy(target, store_name(destination), listed_as=listed_as(destination))
        return Response(status_code=200)

    async def _target(self, name: str) -> str | None:
        """The store name an Ollama name means (None: the base model); 404 when none."""
        catalog = await self.core._wait_catalog()
        target = resolve(name, self.core.base_model_names(),
                         lambda n: catalog.store.has(n) or self.core.profile_of(n) is not None)
        if target is None:
            raise await not_found(self.core, name)
        return target.adapter

    # -- create ----------------------------------------------------------------------------
    async def create(self, caller: policy.Caller, req: dict) -> AsyncIterator[dict]:
        """The create's status lines (its refusals before the first: a 4xx, not a 200 with an error line)."""
        name, modelfile, files = await self._checked(req)
        if files:   # held after every check (a refusal has nothing to give back), released by the lines
            blobs = await self.blobs()
            try:
                await asyncio.to_thread(blobs.hold, files.values())
            except InvalidRequest as e:
                raise refusal(e.message, e.hint, status=400, param="adapters") from None
        return self._create_lines(caller, name, modelfile, files, listed_as(req.get("model") or req.get("name")))

    async def _checked(self, req: dict) -> tuple[str, Modelfile, dict[str, str]]:
        """(profile name, its Modelfile, the adapter's files by blob digest), or a 4xx before any line."""
        model = req.get("model") or req.get("name")
        if not isinstance(model, str) or not model.strip():
            raise refusal("model is required", "Name the model to create.", param="model")
        checked_name(self.core, model)   # before the store is asked (a 300-character name)
        if req.get("quantize"):
            raise refusal("quantize is not served: loractl serves its base model as the daemon loaded it",
                          "Leave quantize out (loractld --dtype and --quantization choose the engine's weights).",
                          param="quantize")
        if req.get("files"):
            raise refusal("files (a GGUF or safetensors model) are not served: the daemon serves the one base model "
                          "it started with", "Create from it (from: the base model's name, GET /api/tags) and give "
                          "a PEFT adapter's files in adapters; or restart loractld --model with that model.",
                          param="files")
        if req.get("modelfile") or req.get("path"):
            raise refusal("modelfile and path are the API's old fields", "Send from, adapters, system, parameters "
                          "..., as the ollama client does; or run loractl create NAME -f Modelfile.", param="modelfile")
        adapters = req.get("adapters") or {}
        if not isinstance(adapters, dict) or not all(isinstance(v, str) for v in adapters.values()):
            raise refusal("adapters must map file names to blob digests", "Upload each file with POST /api/blobs/"
                          "sha256:<hex>, then send {\"adapter_config.json\": \"sha256:...\", ...}.", param="adapters")
        files = {k.rsplit("/", 1)[-1]: v for k, v in adapters.items()}
        unknown = sorted(set(files) - set(ADAPTER_FILES))
        if unknown or (files and CONFIG_FILE not in files) or len(files) != len(adapters):
            raise refusal(f"adapters must be a PEFT LoRA adapter's {' and '.join(ADAPTER_FILES)}"
                          + (f", not {', '.join(unknown)}" if unknown else ""),
                          "Upload adapter_config.json and adapter_model.safetensors as blobs and name them.",
                          param="adapters")
        blobs = await self.blobs()
        for file, digest in files.items():
            if not await asyncio.to_thread(blobs.has, f"sha256:{_hex(digest)}"):
                raise refusal(f"blob {digest} ({file}) is not uploaded", f"POST /api/blobs/{digest} first.",
                              status=400, param="adapters")
        source = req.get("from")
        if source is None and not files:
            raise refusal("from is required", "Name the base model, an adapter or a profile (GET /api/tags).",
                          param="from")
        base = await self._target(checked_name(self.core, source, "from")) if source else None
        name = store_name(model)
        catalog = await self.core._wait_catalog()
        if await asyncio.to_thread(catalog.store.has, name):
            raise refusal(f"{model!r} is an adapter in the store", "Create the model under another name (adapters "
                          "and models made of them share one name space).", param="model")
        if files:   # what an earlier create of this model pulled from other files is not replaced unasked
            held = await asyncio.to_thread(_pulled_from, catalog.store, f"{name}-adapter")
            if held is not None and held != str(blobs.assembled_path(files)):
                raise refusal(f"{model!r} is taken: its adapter {name}-adapter holds other files",
                              f"Create the model under another name, or delete it first (DELETE /api/delete, "
                              f"loractl rm {name}; then loractl rm {name}-adapter).", param="model")
        parameters, messages, license = req.get("parameters") or {}, req.get("messages") or [], req.get("license") or []
        if not isinstance(parameters, dict) or not isinstance(messages, list) or \
                not all(isinstance(m, dict) for m in messages):
            raise refusal("parameters must be an object and messages a list of messages",
                          "Send e.g. {\"parameters\": {\"temperature\": 0}, \"messages\": [{\"role\": \"user\", "
                          "\"content\": \"...\"}]}.")
        settings = [f"{key}={v}" for key, value in parameters.items()
                    for v in (value if isinstance(value, list) else [value])]
        # The whole Modelfile is checked (template, parameters, messages) before anything is installed.
        modelfile = combined(base=base or self.core.served_model_name, adapters=[f"{name}-adapter"] if files else [],
                             system=req.get("system"), template=req.get("template"), parameters=settings,
                             messages=messages, license=[license] if isinstance(license, str) else list(license))
        await self.core.check_create(name, modelfile)   # a taken name: a 400, before the first status line
        return name, modelfile, files

    async def _create_lines(self, caller: policy.Caller, name: str, modelfile: Modelfile,
                            files: dict[str, str], listed: str = "") -> AsyncIterator[dict]:
        installed = False
        try:
            async with policy.authorized(caller, self.core.socket_gid, "create", name,
                                         refusal="create models over HTTP", hint=_HINT):
                # The create that fails after the blobs' adapter was installed takes it back out.
                async with undone_on_failure(self.core) as pulls:
                    if files:
                        async for line in self._install(pulls, modelfile.adapters[-1][0], files):
                            yield line
                    yield {"status": "writing manifest"}
                    await self.core.create(name, modelfile, caller=caller, listed_as=listed)
                installed = True
        finally:
            if files:   # their content is in the store now: removed once no other create holds them
                (await self.blobs()).release(files.values(), used=installed)
        yield {"status": "success"}

    async def _install(self, pulls: CreatePulls, adapter: str, files: dict[str, str]) -> AsyncIterator[dict]:
        """Pull the adapter assembled from ``files``' blobs, as ``loractl pull FOLDER`` would
        (by ``pulls``: removed again if the create then fails)."""
        blobs = await self.blobs()
        for file, digest in files.items():
            yield {"status": f"using existing layer sha256:{_hex(digest)}", "digest": digest}
        key = blobs.assembled_path(files)
        lock = self._assembling.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                folder = await asyncio.to_thread(blobs.assemble, files)
                try:
                    async with contextlib.aclosing(pulls.pull(str(folder), adapter)) as events:
                        async for event in events:
                            line = progress_line(event.stage, event.file, event.done, event.total)
                            if line is not None and line["status"] not in ("success", "writing manifest"):
                                yield line
                finally:
                    await asyncio.to_thread(shutil.rmtree, folder, True)
        finally:
            if not lock.locked() and self._assembling.get(key) is lock:
                del self._assembling[key]


def _hex(digest: str) -> str:
    try:
        return blob_hex(digest)
    except Exception as e:  # noqa: BLE001 - InvalidRequest, in Ollama's words
        raise refusal(str(e.args[0] if e.args else e), "Name a blob as sha256:<64 hex digits>.",
                      param="digest") from None



def _pulled_from(store, name: str) -> str | None:
    """The ref the adapter ``name`` was pulled from; None when no adapter has that name."""
    if not store.has(name):
        return None
    try:
        return str(store.get(name).manifest.get("ref", ""))
    except Exception:  # noqa: BLE001 - damaged: taken all the same
        return ""
