"""A small in-process stand-in for the Hugging Face Hub, for tests.

It speaks just enough of the Hub's HTTP API for the real ``huggingface_hub`` client (2.4) to work against it
when given ``endpoint=stub.endpoint``: ``snapshot_download``, ``hf_hub_download``, ``HfApi.model_info`` /
``repo_info`` and ``HfApi.list_repo_tree``, for model repos.

Routes (``{repo}`` is ``org/name`` or ``name``; ``{rev}`` is a branch name or a 40-hex commit sha, URL-quoted
as the client quotes it, so ``refs%2Fpr%2F1`` is one segment):

* ``GET  /api/models/{repo}``                            model info at the default branch (``main``)
* ``GET  /api/models/{repo}/revision/{rev}[?blobs=true]`` model info at ``rev``; ``blobs`` adds size/blobId/lfs
* ``GET  /api/models/{repo}/tree/{rev}[/{path}][?recursive=..&expand=..&cursor=..]``
  the tree listing, paginated with a GitHub-style ``Link: <...>; rel="next"`` header (``tree_page_size``)
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``              file metadata / content; ``Range: bytes=a-b`` -> 206

What it mimics, and what it leaves out on purpose:

* ``X-Repo-Commit`` on every resolve answer (the client refuses a file without it); ``ETag`` is the quoted git
  blob sha1 of a regular file, the quoted sha256 of an LFS file, which also gets ``X-Linked-Etag`` and
  ``X-Linked-Size`` (the client prefers those).
* LFS files are served directly (200) from ``/resolve``, not through a 302 to a CDN: the client follows
  same-origin redirects and would then need the metadata on the final answer anyway.
* No ``X-Xet-*`` headers and no ``xetHash``/``xet-auth`` link anywhere, so the client never tries Xet, even with
  ``hf_xet`` installed: every download is a plain HTTP GET.
* Errors carry ``X-Error-Code`` / ``X-Error-Message`` and a JSON ``{"error": ...}`` body, which is what
  ``huggingface_hub.utils.hf_raise_for_status`` keys on: ``RepoNotFound`` -> ``RepositoryNotFoundError``,
  ``RevisionNotFound`` -> ``RevisionNotFoundError``, ``EntryNotFound`` -> ``RemoteEntryNotFoundError`` (a
  subclass of ``EntryNotFoundError``).
* With ``token`` set, a request without ``Authorization: Bearer ...`` gets 401 + ``X-Error-Code: RepoNotFound``
  (as the Hub answers for a private repo: the client raises ``RepositoryNotFoundError`` with status 401); a
  request with a wrong token gets 401 + ``X-Error-Message: Invalid credentials in Authorization header`` (the
  client raises a plain ``HfHubHTTPError`` with status 401). Over ``http://`` the client never maps a bare 401 to
  ``RepositoryNotFoundError`` by itself (its URL regex wants ``https://``), hence the explicit header.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import pathlib
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["HubStub"]

_SHA1 = re.compile(r"[0-9a-f]{40}")
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_ROUTE_INFO = re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?/?$")
_ROUTE_TREE = re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_ROUTE_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CHUNK = 64 * 1024
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


@dataclass(frozen=True)
class _Blob:
    data: bytes
    oid: str  # git blob sha1: of the content, or of the LFS pointer for an LFS file
    sha256: str
    lfs: bool
    pointer_size: int

    @classmethod
    def make(cls, data: bytes, lfs: bool) -> _Blob:
        sha256 = hashlib.sha256(data).hexdigest()
        if lfs:
            pointer = _LFS_POINTER.format(sha256=sha256, size=len(data)).encode()
            return cls(data, _git_blob_sha1(pointer), sha256, True, len(pointer))
        return cls(data, _git_blob_sha1(data), sha256, False, 0)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid


@dataclass
class _Commit:
    sha: str
    parent: str | None
    files: dict[str, _Blob]
    title: str
    date: float


@dataclass
class _Repo:
    commits: dict[str, _Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    created: float = field(default_factory=time.time)


@dataclass
class _Stall:
    filename: str
    after_bytes: int
    event: threading.Event
    repo: str | None = None


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class _Aborted(Exception):
    """The stub is stopping (or the client went away): drop the connection."""


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or path.endswith("/"):
        raise ValueError(f"bad repo path: {path!r}")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"bad repo path: {path!r}")
    return path


class HubStub:
    """A threaded HTTP server on 127.0.0.1 (ephemeral port) that the real huggingface_hub client can talk to.

    ``with HubStub() as hub: sha = hub.add_commit("org/repo", {...}); hf_hub_download(..., endpoint=hub.endpoint)``
    """

    #: Entries per page of a tree listing (the Hub uses 1000); lower it to exercise the ``Link`` pagination.
    tree_page_size: int = 1000

    def __init__(self, *, token: str | None = None, lfs_threshold: int = 1024, host: str = "127.0.0.1") -> None:
        self.token = token
        self.host = host  # another address for clients in other network namespaces (tests/fleet_rig.py)
        self.lfs_threshold = lfs_threshold
        #: (method, path) of every request received, in order; the path is as sent (still URL-quoted, so a
        #: revision like ``refs/pr/1`` shows as ``refs%2Fpr%2F1``), without the query string.
        self.requests: list[tuple[str, str]] = []
        #: The Authorization header of each request (None when absent), in the same order.
        self.authorizations: list[str | None] = []
        self._repos: dict[str, _Repo] = {}
        self._stalls: list[_Stall] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._endpoint: str | None = None

    # ----------------------------------------------------------------------------------------- repo content

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """Commit a tree that is exactly ``files`` on ``branch`` (creating repo and branch if needed); return its sha."""
        if not repo_id or repo_id.count("/") > 1 or any(not p for p in repo_id.split("/")):
            raise ValueError(f"bad repo id: {repo_id!r}")
        if not branch or _SHA1.fullmatch(branch):
            raise ValueError(f"bad branch name: {branch!r}")
        tree = {}
        for path, data in sorted(files.items()):
            tree[_check_path(path)] = _Blob.make(bytes(data), len(data) > self.lfs_threshold)
        for path in tree:  # a path cannot be both a file and a folder
            parts = path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in tree:
                    raise ValueError(f"{'/'.join(parts[:i])!r} is both a file and a folder")
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            parent = repo.branches.get(branch)
            h = hashlib.sha1(f"commit\0{repo_id}\0{branch}\0{parent or ''}\0{len(repo.commits)}\0".encode())
            for path, blob in tree.items():
                h.update(f"{path}\0{blob.oid}\n".encode())
            sha = h.hexdigest()
            repo.commits[sha] = _Commit(sha, parent, tree, f"Commit {len(repo.commits) + 1} on {branch}", time.time())
            repo.branches[branch] = sha
        return sha

    def add_folder(self, repo_id: str, folder: pathlib.Path, *, branch: str = "main", prefix: str = "") -> str:
        """``add_commit`` with every file under ``folder`` (relative paths, under ``prefix/`` if given)."""
        folder = pathlib.Path(folder)
        prefix = prefix.strip("/")
        files = {}
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                rel = p.relative_to(folder).as_posix()
                files[f"{prefix}/{rel}" if prefix else rel] = p.read_bytes()
        return self.add_commit(repo_id, files, branch=branch)

    def stall(self, filename: str, after_bytes: int, *, repo: str | None = None) -> threading.Event:
        """Hold future GETs of any repo file whose path ends with ``filename`` after ``after_bytes`` bytes.

        ``repo``: only that repo's files (a stall a failed test never released then leaves the
        other tests' pulls alone).

        ``after_bytes`` is an offset in the file: a ranged GET that starts past it, or a file no longer than
        it, is not held. The
        response blocks until the returned Event is set, then sends the rest. Once set, the stall is inert.
        ``stop()`` drops held responses (the client sees a broken connection).
        """
        stall = _Stall(filename, max(0, int(after_bytes)), threading.Event(), repo)
        with self._lock:
            self._stalls.append(stall)
        return stall.event

    # ----------------------------------------------------------------------------------------- lifecycle

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("HubStub is not started")
        return self._endpoint

    def start(self) -> HubStub:
        if self._server is not None:
            return self
        stub = self

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request, client_address):
                if isinstance(sys.exc_info()[1], (ConnectionError, _Aborted)):
                    return  # a client that went away (or stop()) is not an error
                super().handle_error(request, client_address)

        class Handler(_Handler):
            hub = stub

        self._stopping.clear()
        self._server = Server((self.host, 0), Handler)
        self._endpoint = f"http://{self.host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-stub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # releases held (stalled) responses: they abort
        server.shutdown()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # idle keep-alive connections: wake their threads up
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> HubStub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------------- lookups

    def _repo(self, repo_id: str) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _commit(self, repo_id: str, rev: str) -> _Commit:
        with self._lock:
            repo = self._repo(repo_id)
            sha = repo.branches.get(rev) or (rev if rev in repo.commits else None)
            if sha is None:
                raise _HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            return repo.commits[sha]

    def _last_commit(self, repo_id: str, commit: _Commit, path: str) -> _Commit:
        """The oldest ancestor of ``commit`` through which ``path`` kept the same content."""
        with self._lock:
            commits = self._repos[repo_id].commits
            oid = commit.files[path].oid
            while commit.parent is not None:
                parent = commits[commit.parent]
                if getattr(parent.files.get(path), "oid", None) != oid:
                    break
                commit = parent
            return commit

    def _stall_for(self, repo_id: str, path: str, start: int, size: int) -> _Stall | None:
        with self._lock:
            for stall in self._stalls:
                if stall.repo not in (None, repo_id):
                    continue
                if path.endswith(stall.filename) and not stall.event.is_set() and start <= stall.after_bytes < size:
                    return stall
        return None


class _Handler(http.server.BaseHTTPRequestHandler):
    hub: HubStub
    protocol_version = "HTTP/1.1"
    server_version = "HubStub/1.0"
    timeout = 60

    # -------------------------------------------------------------------------------- plumbing

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._conns.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        with self.hub._lock:
            self.hub._conns.discard(self.connection)

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def _other(self) -> None:
        self._record()
        self.close_connection = True
        self._send_json(405, {"error": "Method not allowed"}, head=False)

    do_POST = do_PUT = do_DELETE = do_PATCH = _other

    def _record(self) -> None:
        with self.hub._lock:
            self.hub.requests.append((self.command, urlsplit(self.path).path))
            self.hub.authorizations.append(self.headers.get("Authorization"))

    def _dispatch(self, head: bool) -> None:
        self._record()
        try:
            self._authorize()
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if m := _ROUTE_TREE.match(url.path):
                self._tree(unquote(m["repo"]), unquote(m["rev"]), unquote(m["path"] or "").strip("/"), query, head)
            elif m := _ROUTE_INFO.match(url.path):
                self._info(unquote(m["repo"]), unquote(m["rev"] or "main"), query, head)
            elif m := _ROUTE_RESOLVE.match(url.path):
                self._resolve(unquote(m["repo"]), unquote(m["rev"]), unquote(m["path"]), head)
            else:
                raise _HubError(404, "Not Found")
        except _HubError as e:
            headers = dict(e.headers)
            if e.code:
                headers["X-Error-Code"] = e.code
            headers["X-Error-Message"] = e.message
            self._send_json(e.status, {"error": e.message}, head=head, headers=headers)
        except (_Aborted, OSError):
            self.close_connection = True

    def _authorize(self) -> None:
        token = self.hub.token
        if token is None:
            return
        auth = self.headers.get("Authorization")
        if not auth:
            raise _HubError(401, "Invalid username or password.", "RepoNotFound")
        if auth != f"Bearer {token}":
            raise _HubError(401, "Invalid credentials in Authorization header")

    def _send_json(self, status: int, payload, *, head: bool, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    # -------------------------------------------------------------------------------- routes

    def _info(self, repo_id: str, rev: str, query: dict[str, str], head: bool) -> None:
        commit = self.hub._commit(repo_id, rev)
        blobs = query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path, blob in commit.files.items():
            sibling: dict = {"rfilename": path}
            if blobs:
                sibling.update(size=len(blob.data), blobId=blob.oid)
                if blob.lfs:
                    sibling["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": blob.pointer_size}
            siblings.append(sibling)
        with self.hub._lock:
            created = self.hub._repos[repo_id].created
        payload = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0] if "/" in repo_id else None,
            "sha": commit.sha,
            "lastModified": _iso(commit.date),
            "createdAt": _iso(created),
            "private": self.hub.token is not None,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "library_name": "peft",
            "siblings": siblings,
        }
        self._send_json(200, payload, head=head)

    def _tree(self, repo_id: str, rev: str, path: str, query: dict[str, str], head: bool) -> None:
        commit = self.hub._commit(repo_id, rev)
        recursive = query.get("recursive", "").lower() in ("1", "true")
        expand = query.get("expand", "").lower() in ("1", "true")
        base = f"{path}/" if path else ""
        files = {p: b for p, b in commit.files.items() if p.startswith(base)}
        if path and not files:
            raise _HubError(404, f"{path} does not exist on {rev}", "EntryNotFound",
                            {"X-Repo-Commit": commit.sha})
        dirs: dict[str, list[str]] = {}  # folder -> the file paths under it
        entries_files = []
        for p in files:
            rest = p[len(base):].split("/")
            for i in range(1, len(rest) if recursive else min(len(rest), 2)):
                dirs.setdefault(base + "/".join(rest[:i]), []).append(p)
            if recursive or len(rest) == 1:
                entries_files.append(p)
        entries = []
        for d, under in dirs.items():
            tree_oid = hashlib.sha1("".join(f"{p}\0{files[p].oid}\n" for p in sorted(under)).encode()).hexdigest()
            entries.append({"type": "directory", "oid": tree_oid, "size": 0, "path": d})
        for p in entries_files:
            blob = files[p]
            entry = {"type": "file", "oid": blob.oid, "size": len(blob.data), "path": p}
            if blob.lfs:
                entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data), "pointerSize": blob.pointer_size}
            entries.append(entry)
        entries.sort(key=lambda e: e["path"])
        if expand:
            for entry in entries:
                if entry["type"] == "file":
                    last = self.hub._last_commit(repo_id, commit, entry["path"])
                    entry["lastCommit"] = {"id": last.sha, "title": last.title, "date": _iso(last.date)}
        try:
            cursor = max(0, int(query.get("cursor", "0")))
        except ValueError:
            raise _HubError(400, "Invalid cursor") from None
        size = max(1, int(self.hub.tree_page_size))
        page = entries[cursor : cursor + size]
        headers = {}
        if cursor + size < len(entries):
            tail = "/" + quote(path, safe="") if path else ""
            nxt = (f"{self.hub.endpoint}/api/models/{repo_id}/tree/{quote(rev, safe='')}{tail}"
                   f"?recursive={str(recursive).lower()}&expand={str(expand).lower()}&cursor={cursor + size}")
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send_json(200, page, head=head, headers=headers)

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        commit = self.hub._commit(repo_id, rev)
        blob = commit.files.get(path)
        if blob is None:
            raise _HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        size = len(blob.data)
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and not head:
            m = _RANGE.match(rng.strip())
            if m and (m[1] or m[2]):
                if m[1]:
                    start = int(m[1])
                    end = min(int(m[2]), size - 1) if m[2] else size - 1
                else:  # suffix range: the last N bytes
                    start = max(0, size - int(m[2]))
                if start >= size or start > end:
                    raise _HubError(416, "Range Not Satisfiable", None, {"Content-Range": f"bytes */{size}"})
                status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1 if size else 0))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{blob.etag}"')
        self.send_header("X-Repo-Commit", commit.sha)
        if blob.lfs:
            self.send_header("X-Linked-Etag", f'"{blob.sha256}"')
            self.send_header("X-Linked-Size", str(size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head or not size:
            return
        pos = start
        stall = self.hub._stall_for(repo_id, path, start, size)
        if stall is not None:  # send up to the stall offset, then hold
            pos = self._send_body(blob.data, pos, min(stall.after_bytes, end + 1))
            while not stall.event.wait(0.05):
                if self.hub._stopping.is_set():
                    raise _Aborted
        self._send_body(blob.data, pos, end + 1)

    def _send_body(self, data: bytes, pos: int, stop: int) -> int:
        while pos < stop:
            n = min(_CHUNK, stop - pos)
            self.wfile.write(data[pos : pos + n])
            pos += n
        return pos
