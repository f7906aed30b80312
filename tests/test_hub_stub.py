"""The Hub stub (tests/hub_stub.py) against the real huggingface_hub client: no network, no engine."""

from __future__ import annotations

import hashlib
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tqdm.auto import tqdm

from hub_stub import HubStub

hf = pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub import errors as hf_errors  # noqa: E402
from huggingface_hub.file_download import http_get  # noqa: E402

CONFIG = b'{"peft_type": "LORA", "r": 8}'
WEIGHTS_V1 = bytes(range(256)) * 12  # 3072 bytes: LFS with the default threshold (1024)
WEIGHTS_V2 = b"\x01\x02" * 2000
README = b"# adapter\n"


class Quiet(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(autouse=True)
def hf_env(tmp_path, monkeypatch):
    """A private HF_HOME/cache, online, no ambient token or endpoint."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    # Read once at import by huggingface_hub: patch the module too.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    return home


@pytest.fixture
def hub():
    with HubStub() as stub:
        yield stub


@pytest.fixture
def cache(hf_env) -> str:
    return str(hf_env / "hub")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".cache" not in p.relative_to(root).parts}


def test_snapshot_download_allow_patterns_and_revisions(hub, tmp_path, cache):
    v1 = hub.add_commit("org/adapter", {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS_V1,
                                        "README.md": README, "sub/adapter_config.json": b"{}"})
    v2 = hub.add_commit("org/adapter", {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS_V2})
    assert len(v1) == len(v2) == 40 and v1 != v2
    kw = dict(endpoint=hub.endpoint, token=False, cache_dir=cache, tqdm_class=Quiet)

    out = snapshot_download("org/adapter", allow_patterns=["adapter_*"], local_dir=tmp_path / "main", **kw)
    assert _files(Path(out)) == {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS_V2}
    assert ("GET", "/api/models/org/adapter/revision/main") in hub.requests

    out = snapshot_download("org/adapter", revision=v1, allow_patterns=["adapter_*", "*.md"],
                            local_dir=tmp_path / "old", **kw)
    assert _files(Path(out)) == {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS_V1,
                                 "README.md": README}

    # Into the (temporary) cache, no local_dir: blobs are named by ETag (sha256 for LFS, git sha1 otherwise).
    out = snapshot_download("org/adapter", revision=v1, **kw)
    assert Path(out).name == v1 and (Path(out) / "adapter_model.safetensors").read_bytes() == WEIGHTS_V1
    blobs = {p.name for p in (Path(out).parents[1] / "blobs").iterdir()}
    assert hashlib.sha256(WEIGHTS_V1).hexdigest() in blobs and git_blob_sha1(CONFIG) in blobs

    # Nothing ever asks for Xet.
    assert all("xet" not in path.lower() for _, path in hub.requests)


def test_branch_subfolder_and_hf_hub_download(hub, tmp_path, cache):
    hub.add_commit("org/multi", {"README.md": README})
    pr = hub.add_commit("org/multi", {"README.md": b"pr"}, branch="refs/pr/1")
    dev = hub.add_commit("org/multi", {"one/adapter_config.json": CONFIG, "one/adapter_model.safetensors": WEIGHTS_V1,
                                       "two/adapter_config.json": b"{}"}, branch="dev")
    kw = dict(endpoint=hub.endpoint, token=False)
    assert HfApi(**kw).model_info("org/multi", revision="dev").sha == dev
    assert HfApi(**kw).model_info("org/multi", revision="refs/pr/1").sha == pr
    readme = hf_hub_download("org/multi", "README.md", revision="refs/pr/1", cache_dir=cache, **kw)
    assert Path(readme).read_bytes() == b"pr"

    out = snapshot_download("org/multi", revision="dev", allow_patterns=["one/*"], local_dir=tmp_path / "s",
                            cache_dir=cache, tqdm_class=Quiet, **kw)
    assert _files(Path(out)) == {"one/adapter_config.json": CONFIG, "one/adapter_model.safetensors": WEIGHTS_V1}

    seen = []

    class Bar:  # the kind of tqdm stand-in loractld passes
        def __init__(self, *, total=None, initial=0, **_):
            self.total = total

        def update(self, n=1):
            seen.append(n)

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    path = hf_hub_download("org/multi", "adapter_model.safetensors", subfolder="one", revision=dev,
                           local_dir=tmp_path / "f", cache_dir=cache, tqdm_class=Bar, **kw)
    assert Path(path) == tmp_path / "f" / "one" / "adapter_model.safetensors"
    assert Path(path).read_bytes() == WEIGHTS_V1 and sum(seen) == len(WEIGHTS_V1)
    assert ("HEAD", f"/org/multi/resolve/{dev}/one/adapter_model.safetensors") in hub.requests


def test_model_info_and_tree(hub):
    sha = hub.add_commit("org/info", {"adapter_config.json": CONFIG, "sub/adapter_model.safetensors": WEIGHTS_V1,
                                      "sub/deeper/x.txt": b"x"})
    api = HfApi(endpoint=hub.endpoint, token=False)

    info = api.model_info("org/info", files_metadata=True)
    assert info.sha == sha and info.id == "org/info"
    sib = {s.rfilename: s for s in info.siblings}
    assert set(sib) == {"adapter_config.json", "sub/adapter_model.safetensors", "sub/deeper/x.txt"}
    assert sib["adapter_config.json"].size == len(CONFIG) and sib["adapter_config.json"].lfs is None
    assert sib["adapter_config.json"].blob_id == git_blob_sha1(CONFIG)
    lfs = sib["sub/adapter_model.safetensors"].lfs
    assert lfs.sha256 == hashlib.sha256(WEIGHTS_V1).hexdigest() and lfs.size == len(WEIGHTS_V1)
    assert sib["sub/adapter_model.safetensors"].size == len(WEIGHTS_V1)
    assert api.model_info("org/info").siblings[0].size is None  # no blobs=True: names only

    tree = list(api.list_repo_tree("org/info", recursive=True, revision=sha))
    files = {e.path: e for e in tree if isinstance(e, hf.hf_api.RepoFile)}
    folders = {e.path for e in tree if isinstance(e, hf.hf_api.RepoFolder)}
    assert set(files) == set(sib) and folders == {"sub", "sub/deeper"}
    w = files["sub/adapter_model.safetensors"]
    assert w.size == len(WEIGHTS_V1) and w.lfs.sha256 == lfs.sha256 and w.blob_id == sib[w.path].blob_id
    assert files["adapter_config.json"].blob_id == git_blob_sha1(CONFIG) and files["adapter_config.json"].lfs is None

    # Non-recursive, on a subfolder (what loractld's resolve does).
    sub = list(api.list_repo_tree("org/info", path_in_repo="sub", revision=sha, expand=False))
    assert [(type(e).__name__, e.path) for e in sub] == [("RepoFile", "sub/adapter_model.safetensors"),
                                                          ("RepoFolder", "sub/deeper")]
    assert ("GET", f"/api/models/org/info/tree/{sha}/sub") in hub.requests

    # Pagination through the Link header.
    hub.tree_page_size = 2
    before = len(hub.requests)
    assert {e.path for e in api.list_repo_tree("org/info", recursive=True)} == set(files) | folders
    assert len(hub.requests) - before == 3  # 5 entries, 2 a page

    # expand=True: the commit that last changed each file.
    sha2 = hub.add_commit("org/info", {"adapter_config.json": b"{}", "sub/adapter_model.safetensors": WEIGHTS_V1})
    expanded = {e.path: e for e in api.list_repo_tree("org/info", recursive=True, expand=True)
                if isinstance(e, hf.hf_api.RepoFile)}
    assert expanded["adapter_config.json"].last_commit.oid == sha2
    assert expanded["sub/adapter_model.safetensors"].last_commit.oid == sha


def test_add_folder(hub, tmp_path):
    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    (src / "adapter_config.json").write_bytes(CONFIG)
    (src / "nested" / "w.bin").write_bytes(WEIGHTS_V2)
    sha = hub.add_folder("solo", src, prefix="pre")
    info = HfApi(endpoint=hub.endpoint, token=False).model_info("solo", revision=sha, files_metadata=True)
    assert {s.rfilename: s.size for s in info.siblings} == {"pre/adapter_config.json": len(CONFIG),
                                                            "pre/nested/w.bin": len(WEIGHTS_V2)}


def test_resolve_headers_and_ranges(hub):
    sha = hub.add_commit("org/raw", {"small.json": CONFIG, "big.bin": WEIGHTS_V1})
    host, port = hub.endpoint.removeprefix("http://").split(":")

    def ask(method, path, headers=None):
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        return resp, body

    resp, _ = ask("HEAD", "/org/raw/resolve/main/small.json")
    assert resp.status == 200 and resp.getheader("ETag") == f'"{git_blob_sha1(CONFIG)}"'
    assert resp.getheader("X-Repo-Commit") == sha and resp.getheader("X-Linked-Etag") is None
    assert int(resp.getheader("Content-Length")) == len(CONFIG)
    assert not any(h.lower().startswith("x-xet") for h in resp.headers)

    resp, _ = ask("HEAD", "/org/raw/resolve/main/big.bin")
    assert resp.getheader("X-Linked-Etag") == resp.getheader("ETag") == f'"{hashlib.sha256(WEIGHTS_V1).hexdigest()}"'
    assert int(resp.getheader("X-Linked-Size")) == len(WEIGHTS_V1)

    resp, body = ask("GET", f"/org/raw/resolve/{sha}/big.bin", {"Range": "bytes=1000-"})
    assert resp.status == 206 and body == WEIGHTS_V1[1000:]
    assert resp.getheader("Content-Range") == f"bytes 1000-{len(WEIGHTS_V1) - 1}/{len(WEIGHTS_V1)}"
    resp, body = ask("GET", "/org/raw/resolve/main/big.bin", {"Range": "bytes=10-19"})
    assert resp.status == 206 and body == WEIGHTS_V1[10:20]
    resp, body = ask("GET", "/org/raw/resolve/main/big.bin", {"Range": "bytes=-5"})
    assert resp.status == 206 and body == WEIGHTS_V1[-5:]
    resp, _ = ask("GET", "/org/raw/resolve/main/big.bin", {"Range": f"bytes={len(WEIGHTS_V1)}-"})
    assert resp.status == 416

    # The client's own resume path (http_get with resume_size sends `Range: bytes=N-`).
    class Sink:
        data = bytearray(WEIGHTS_V1[:500])

        def write(self, b):
            self.data += b

        def tell(self):
            return len(self.data)

    sink = Sink()
    http_get(f"{hub.endpoint}/org/raw/resolve/main/big.bin", sink, resume_size=500, expected_size=len(WEIGHTS_V1))
    assert bytes(sink.data) == WEIGHTS_V1


def test_token(tmp_path, cache):
    with HubStub(token="s3cret") as hub:
        sha = hub.add_commit("org/private", {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS_V1})

        # No token: 401, which the client reports as RepositoryNotFoundError (as for a private repo on the Hub).
        with pytest.raises(hf_errors.RepositoryNotFoundError) as err:
            HfApi(endpoint=hub.endpoint, token=False).model_info("org/private")
        assert err.value.response.status_code == 401
        with pytest.raises(hf_errors.RepositoryNotFoundError):
            hf_hub_download("org/private", "adapter_config.json", local_dir=tmp_path / "x", cache_dir=cache,
                            endpoint=hub.endpoint, token=False)
        # Wrong token: a plain 401 HfHubHTTPError.
        with pytest.raises(hf_errors.HfHubHTTPError) as err:
            hf_hub_download("org/private", "adapter_config.json", local_dir=tmp_path / "y", cache_dir=cache,
                            endpoint=hub.endpoint, token="nope")
        assert err.value.response.status_code == 401
        assert not isinstance(err.value, hf_errors.RepositoryNotFoundError)
        with pytest.raises(hf_errors.HfHubHTTPError) as err:
            snapshot_download("org/private", local_dir=tmp_path / "z", cache_dir=cache, endpoint=hub.endpoint,
                              token="nope", tqdm_class=Quiet)
        assert err.value.response.status_code == 401

        out = snapshot_download("org/private", local_dir=tmp_path / "ok", cache_dir=cache, endpoint=hub.endpoint,
                                token="s3cret", tqdm_class=Quiet)
        assert _files(Path(out)) == {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS_V1}
        assert HfApi(endpoint=hub.endpoint, token="s3cret").model_info("org/private").sha == sha


def test_not_found_errors(hub, tmp_path, cache):
    hub.add_commit("org/there", {"adapter_config.json": CONFIG})
    api = HfApi(endpoint=hub.endpoint, token=False)
    kw = dict(endpoint=hub.endpoint, token=False, cache_dir=cache)

    with pytest.raises(hf_errors.RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(hf_errors.RepositoryNotFoundError):
        hf_hub_download("org/missing", "adapter_config.json", local_dir=tmp_path / "a", **kw)
    with pytest.raises(hf_errors.RepositoryNotFoundError):
        snapshot_download("org/missing", local_dir=tmp_path / "b", tqdm_class=Quiet, **kw)

    with pytest.raises(hf_errors.RevisionNotFoundError):
        api.model_info("org/there", revision="nope")
    with pytest.raises(hf_errors.RevisionNotFoundError):
        list(api.list_repo_tree("org/there", revision="f" * 40))
    with pytest.raises(hf_errors.RevisionNotFoundError):
        hf_hub_download("org/there", "adapter_config.json", revision="nope", local_dir=tmp_path / "c", **kw)
    with pytest.raises(hf_errors.RevisionNotFoundError):
        snapshot_download("org/there", revision="nope", local_dir=tmp_path / "d", tqdm_class=Quiet, **kw)

    with pytest.raises(hf_errors.RemoteEntryNotFoundError) as err:
        hf_hub_download("org/there", "adapter_model.safetensors", local_dir=tmp_path / "e", **kw)
    assert isinstance(err.value, hf_errors.EntryNotFoundError) and err.value.response.status_code == 404
    with pytest.raises(hf_errors.RemoteEntryNotFoundError):
        list(api.list_repo_tree("org/there", path_in_repo="nosuchdir"))


def test_stall_holds_a_download_mid_file(hub, tmp_path, cache):
    # The client writes to disk in DOWNLOAD_CHUNK_SIZE (10 MiB) pieces: stall past the first one so that the
    # partial file holds bytes, not just a name.
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    weights = os.urandom(chunk + 300_000)
    sha = hub.add_commit("org/big", {"adapter_config.json": CONFIG, "sub/adapter_model.safetensors": weights})
    release = hub.stall("adapter_model.safetensors", chunk + 1000)
    dest = tmp_path / "dl"
    result: dict = {}

    def download():
        try:
            result["path"] = hf_hub_download("org/big", "adapter_model.safetensors", subfolder="sub", revision=sha,
                                             local_dir=dest, cache_dir=cache, endpoint=hub.endpoint, token=False)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=download, daemon=True)
    t.start()
    partial = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = [p for p in dest.rglob("*.incomplete") if p.stat().st_size >= chunk]
        if found:
            partial = found[0]
            break
        time.sleep(0.02)
    assert partial is not None, "no partial download showed up"
    assert partial.read_bytes() == weights[:chunk]
    # Held: the server answers other requests meanwhile, and the file is not there yet.
    assert HfApi(endpoint=hub.endpoint, token=False).model_info("org/big").sha == sha
    time.sleep(0.2)
    assert t.is_alive() and not (dest / "sub" / "adapter_model.safetensors").exists()

    release.set()
    t.join(timeout=5)
    assert not t.is_alive() and "error" not in result, result
    assert Path(result["path"]).read_bytes() == weights and not partial.exists()
    # Once released, the stall is inert.
    again = hf_hub_download("org/big", "adapter_model.safetensors", subfolder="sub", revision=sha,
                            local_dir=tmp_path / "again", cache_dir=cache, endpoint=hub.endpoint, token=False,
                            force_download=True)
    assert Path(again).read_bytes() == weights


def test_stop_does_not_hang_on_a_stalled_response(tmp_path):
    hub = HubStub().start()
    hub.add_commit("org/s", {"w.bin": WEIGHTS_V1})
    hub.stall("w.bin", 100)
    host, port = hub.endpoint.removeprefix("http://").split(":")
    got: dict = {}

    def fetch():
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("GET", "/org/s/resolve/main/w.bin")
            got["body"] = conn.getresponse().read()
        except http.client.IncompleteRead as e:
            got["partial"] = e.partial
        finally:
            conn.close()

    idle = http.client.HTTPConnection(host, int(port), timeout=5)  # an idle keep-alive connection too
    idle.request("GET", "/api/models/org/s")
    idle.getresponse().read()

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    start = time.monotonic()
    hub.stop()
    assert time.monotonic() - start < 2
    t.join(timeout=3)
    assert not t.is_alive() and got.get("partial") == WEIGHTS_V1[:100]
    idle.close()


def test_stall_then_sigkill_leaves_a_partial_file(hub, tmp_path, cache, hf_env):
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    weights = os.urandom(chunk + 100_000)
    sha = hub.add_commit("org/kill", {"adapter_model.safetensors": weights})
    release = hub.stall("adapter_model.safetensors", chunk + 10)
    dest = tmp_path / "dl"
    code = (
        "import sys; from huggingface_hub import hf_hub_download; "
        "hf_hub_download('org/kill', 'adapter_model.safetensors', revision=sys.argv[1], local_dir=sys.argv[2], "
        "cache_dir=sys.argv[3], endpoint=sys.argv[4], token=False)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT")}
    env.update(HF_HOME=str(hf_env), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.Popen([sys.executable, "-c", code, sha, str(dest), cache, hub.endpoint], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 8
        partial = []
        while time.monotonic() < deadline and not partial and proc.poll() is None:
            partial = [p for p in dest.rglob("*.incomplete") if p.stat().st_size >= chunk]
            time.sleep(0.02)
        assert partial, f"no partial download showed up (exit code {proc.poll()})"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert partial[0].exists() and partial[0].read_bytes() == weights[:chunk]
    assert not (dest / "adapter_model.safetensors").exists()

    release.set()  # the held server thread now writes into a dead socket: it must shrug that off
    path = hf_hub_download("org/kill", "adapter_model.safetensors", revision=sha, local_dir=dest, cache_dir=cache,
                           endpoint=hub.endpoint, token=False)
    assert Path(path).read_bytes() == weights
