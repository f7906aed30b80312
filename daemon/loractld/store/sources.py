"""Where adapters come from: the Hugging Face Hub, a local folder, and plugins.

A source turns a reference (``org/repo``, ``hf://org/repo@rev/sub``, ``/abs/folder``) into a
:class:`Resolved` listing — a pinned revision and the files with their sizes and checksums —
and downloads those files to a folder. The store does the rest (verify, validate, install),
so a source never writes into the store itself.

Third-party sources register a subclass of :class:`AdapterSource` under the entry-point group
``loractl.sources``; they are tried, in name order, after the built-in local-folder source
and before the Hub, which takes any ``org/repo``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from loractl.errors import AdapterNotFound, Cancelled, InvalidAdapter, InvalidRequest, LoractlError, SourceUnavailable
from loractl.names import default_name
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE

_log = logging.getLogger("loractld.sources")
ENTRY_POINT_GROUP = "loractl.sources"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)

# progress(file, done_bytes, total_bytes)
ProgressFn = Callable[[str, int, int], None]


class PullCancelled(Cancelled):
    default_hint = "Pull again to restart it."


@dataclass(frozen=True)
class RemoteFile:
    name: str                  # file name inside the adapter folder
    size: int
    sha256: str | None = None  # LFS files: the Hub reports their sha256
    git_sha1: str | None = None  # regular files: the git blob id


@dataclass
class Resolved:
    source: str                 # the source's name: "hf", "local", or a plugin's
    ref: str                    # canonical reference, e.g. hf://org/repo/sub
    revision: str               # pinned: a commit sha, or sha256:<digest> for a folder
    files: list[RemoteFile]
    default_name: str
    extra: dict = field(default_factory=dict)  # source-private data for download()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class AdapterSource(ABC):
    """A place adapters are downloaded from (after the seeds' ``LoraDownloaderBase``)."""

    name: str = "?"

    @abstractmethod
    def accepts(self, ref: str) -> bool:
        """Whether this source handles ``ref``."""

    @abstractmethod
    def resolve(self, ref: str, revision: str | None, *, token: str | None, endpoint: str | None) -> Resolved:
        """Pin ``ref`` at ``revision`` and list its adapter files, without downloading them."""

    @abstractmethod
    def download_to_disk(self, resolved: Resolved, dest: Path, progress: ProgressFn, cancel: threading.Event,
                         *, token: str | None, endpoint: str | None) -> None:
        """Write every file of ``resolved`` into ``dest`` (flat), reporting progress.

        Must stop promptly with :class:`PullCancelled` once ``cancel`` is set.
        """


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class LocalFolderSource(AdapterSource):
    """An adapter folder on this machine (an absolute path; the CLI makes relative ones absolute)."""

    name = "local"

    def accepts(self, ref: str) -> bool:
        return os.path.isabs(ref) or ref.startswith("file://")

    def resolve(self, ref, revision, *, token, endpoint):
        folder = Path(ref.removeprefix("file://"))
        if not folder.is_dir():
            raise AdapterNotFound(f"no adapter folder at {folder}", "Check the path; pull takes a folder, a Hub id or hf://.")
        if revision:
            raise InvalidRequest("--revision does not apply to a local folder", "Drop --revision.")
        files = []
        for name in ADAPTER_FILES:
            path = folder / name
            if path.is_file():
                files.append(RemoteFile(name, path.stat().st_size, sha256=sha256_file(path)))
        if not any(f.name == CONFIG_FILE for f in files):
            raise InvalidAdapter(f"not a PEFT LoRA adapter: {CONFIG_FILE} is missing in {folder}",
                                 "Point pull at the folder that holds adapter_config.json.")
        _require_safetensors(files, (folder / "adapter_model.bin").exists())
        digest = hashlib.sha256("".join(f.sha256 or "" for f in files).encode()).hexdigest()
        name = default_name(folder.parent.name, folder.name) if folder.parent.name else default_name(folder.name)
        return Resolved(self.name, str(folder), f"sha256:{digest}", files, name, {"folder": str(folder)})

    def download_to_disk(self, resolved, dest, progress, cancel, *, token, endpoint):
        for f in resolved.files:
            if cancel.is_set():
                raise PullCancelled("the pull was cancelled")
            src = Path(resolved.extra["folder"]) / f.name
            with open(src, "rb") as fin, open(dest / f.name, "wb") as fout:
                done = 0
                while chunk := fin.read(4 << 20):
                    fout.write(chunk)
                    done += len(chunk)
                    progress(f.name, done, f.size)
                    if cancel.is_set():
                        raise PullCancelled("the pull was cancelled")


_HF_REF = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^/]+))?(?:/(?P<sub>.+?))?/?$")


def parse_hub_ref(ref: str) -> tuple[str, str | None, str]:
    """``hf://org/repo@rev/sub`` -> (repo, rev, sub); a bare ``org/repo`` has no rev or sub."""
    match = _HF_REF.match(ref)
    if not match or (not ref.startswith("hf://") and (match["rev"] or match["sub"])):
        raise InvalidRequest(f"not an adapter reference: {ref!r}",
                             "Use org/repo, hf://org/repo[@revision][/subfolder], or a local folder.")
    return match["repo"], match["rev"], match["sub"] or ""


class HubSource(AdapterSource):
    """The Hugging Face Hub (or any endpoint that speaks its API: HF_ENDPOINT)."""

    name = "hf"

    def accepts(self, ref: str) -> bool:
        return ref.startswith("hf://") or bool(_HF_REF.match(ref))

    @staticmethod
    def _endpoint(endpoint: str | None) -> str | None:
        chosen = endpoint or os.environ.get("HF_ENDPOINT") or None
        if chosen is not None:
            from urllib.parse import urlsplit

            try:
                parts = urlsplit(chosen)
                ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            except ValueError:  # an unclosed [ipv6 bracket, a bad port
                ok = False
            if not ok:  # found by tests/test_fuzz_grpc.py: httpx's refusal surfaced as an internal error
                raise InvalidRequest(f"the Hub endpoint {chosen!r} is not an http(s) URL",
                                     "Set HF_ENDPOINT to the Hub's base URL, e.g. http://HOST:PORT, or unset it.")
        return chosen

    @classmethod
    def _token(cls, token: str | None, endpoint: str | None) -> str | bool | None:
        """The caller's token; else the daemon's own (None: huggingface_hub reads HF_TOKEN or its
        stored token), but only for the daemon's own endpoint. A caller who names another
        endpoint gets no token of the daemon's (False stops huggingface_hub looking for one):
        credentials stay with their endpoint."""
        if token:
            return token
        if endpoint and _normalized(endpoint) != _normalized(own_endpoint()):
            return False
        return None

    def resolve(self, ref, revision, *, token, endpoint):
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        repo, ref_rev, sub = parse_hub_ref(ref)
        if ref_rev and revision and ref_rev != revision:
            raise InvalidRequest(f"two revisions given: @{ref_rev} in the reference and --revision {revision}",
                                 "Give the revision once.")
        revision = revision or ref_rev or "main"
        api = HfApi(endpoint=self._endpoint(endpoint), token=self._token(token, endpoint))
        with _hub_errors(repo, revision, self._endpoint(endpoint), sub):
            info = api.model_info(repo, revision=revision)
            entries = [e for e in api.list_repo_tree(repo, path_in_repo=sub or None, revision=info.sha,
                                                     recursive=False)
                       if isinstance(e, RepoFile)]
        by_name = {e.path.rsplit("/", 1)[-1]: e for e in entries}
        files = []
        for name in ADAPTER_FILES:
            entry = by_name.get(name)
            if entry is not None:
                files.append(RemoteFile(name, int(entry.size), sha256=entry.lfs.sha256 if entry.lfs else None,
                                        git_sha1=None if entry.lfs else entry.blob_id))
        where = f"{repo}/{sub}" if sub else repo
        if not any(f.name == CONFIG_FILE for f in files):
            raise InvalidAdapter(f"not a PEFT LoRA adapter: {where} has no {CONFIG_FILE} at {revision}",
                                 "Check the repo id and subfolder (hf://org/repo/subfolder).")
        _require_safetensors(files, "adapter_model.bin" in by_name)
        canonical = f"hf://{repo}/{sub}" if sub else f"hf://{repo}"
        return Resolved(self.name, canonical, info.sha, files, default_name(repo, sub),
                        {"repo": repo, "sub": sub})

    def download_to_disk(self, resolved, dest, progress, cancel, *, token, endpoint):
        from huggingface_hub import hf_hub_download

        repo, sub = resolved.extra["repo"], resolved.extra["sub"]
        for f in resolved.files:
            if cancel.is_set():
                raise PullCancelled("the pull was cancelled")
            with _hub_errors(repo, resolved.revision, self._endpoint(endpoint)):
                path = hf_hub_download(
                    repo, f.name, subfolder=sub or None, revision=resolved.revision, local_dir=dest / ".hub",
                    endpoint=self._endpoint(endpoint), token=self._token(token, endpoint),
                    tqdm_class=_progress_class(f.name, progress, cancel),
                )
            os.replace(path, dest / f.name)
        shutil.rmtree(dest / ".hub", ignore_errors=True)


def own_endpoint() -> str:
    """The Hub the daemon itself was configured for: its HF_ENDPOINT, else huggingface.co."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _normalized(url: str) -> str:
    return url.strip().rstrip("/").lower()


def _progress_class(file: str, progress: ProgressFn, cancel: threading.Event):
    """A tqdm stand-in for huggingface_hub that reports bytes and honours cancellation."""

    class Bar:
        def __init__(self, *, total=None, initial=0, **_):
            self.total, self.n = int(total or 0), int(initial or 0)
            progress(file, self.n, self.total)

        def update(self, n=1):
            self.n += n
            progress(file, self.n, self.total)
            if cancel.is_set():
                raise PullCancelled("the pull was cancelled")

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return Bar


class _hub_errors:
    """Map huggingface_hub's exceptions to domain errors with hints."""

    def __init__(self, repo: str, revision: str, endpoint: str | None, sub: str = "") -> None:
        self.repo, self.revision, self.endpoint = repo, revision, endpoint or "https://huggingface.co"
        self.sub = sub

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, LoractlError):
            return False
        from huggingface_hub import errors as hf

        if isinstance(exc, hf.GatedRepoError):
            raise AdapterNotFound(f"{self.repo} is gated on the Hub", "Accept its terms on the Hub and set HF_TOKEN.") from exc
        if isinstance(exc, hf.RepositoryNotFoundError):
            raise AdapterNotFound(f"no repo {self.repo!r} on the Hub ({self.endpoint}), or it is private",
                                  "Check the id; for a private repo set HF_TOKEN.") from exc
        if isinstance(exc, hf.RevisionNotFoundError):
            raise AdapterNotFound(f"{self.repo} has no revision {self.revision!r}",
                                  "Check --revision: a branch, tag or commit sha.") from exc
        if isinstance(exc, hf.EntryNotFoundError):
            what = f"no folder {self.sub!r}" if self.sub else "a file it listed no longer"
            raise AdapterNotFound(f"{self.repo} has {what} at {self.revision}",
                                  "Check the subfolder: hf://org/repo[@revision]/subfolder.") from exc
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, hf.HfHubHTTPError) and status in (401, 403):
            raise SourceUnavailable(f"the Hub refused the credentials for {self.repo} (HTTP {status})",
                                    "Check HF_TOKEN: it must be valid and allowed to read this repo.") from exc
        if isinstance(exc, hf.HfHubHTTPError) and status is not None:
            raise SourceUnavailable(f"the Hub answered HTTP {status} for {self.repo}: {exc}") from exc
        # The HTTP stack's own errors (huggingface_hub 2.x uses httpx2, 1.x httpx, 0.x requests):
        # a timeout, a reset, a protocol it refuses are all "cannot reach", never internal errors.
        stack = type(exc).__module__.split(".")[0].rstrip("0123456789")
        transport = stack in ("httpx", "httpcore", "requests", "urllib3")
        if isinstance(exc, (hf.LocalEntryNotFoundError, hf.HfHubHTTPError, OSError)) or transport:
            raise SourceUnavailable(f"cannot reach the Hub at {self.endpoint}: {exc}") from exc
        return False


def _require_safetensors(files: list[RemoteFile], has_bin: bool) -> None:
    if not any(f.name == WEIGHTS_FILE for f in files):
        if has_bin:
            raise InvalidAdapter(
                "the adapter's weights are only in pickle format (adapter_model.bin), which loractl never loads",
                "Ask for a safetensors export (PEFT save_pretrained(safe_serialization=True)).",
            )
        raise InvalidAdapter(f"{WEIGHTS_FILE} is missing", "Check the reference: it must hold a complete adapter.")


def load_sources() -> list[AdapterSource]:
    """Local folder first, then plugins (by entry-point name), then the Hub."""
    plugins: list[AdapterSource] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            cls = ep.load()
            plugins.append(cls())
        except Exception:
            _log.exception("could not load adapter source plugin %s", ep.name)
    return [LocalFolderSource(), *plugins, HubSource()]


def pick_source(sources: list[AdapterSource], ref: str) -> AdapterSource:
    for source in sources:
        if source.accepts(ref):
            return source
    raise InvalidRequest(f"no source understands {ref!r}",
                         "Use org/repo, hf://org/repo[@revision][/subfolder], or a local folder.")
