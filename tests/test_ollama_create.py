"""Ollama's way of making a model (issue 47): ``/api/blobs``, ``/api/create`` and ``/api/copy``
with the official ``ollama`` client, on the session's rig.

A demo adapter's two files are uploaded as blobs (``create_blob``), ``create`` makes a profile
over them with a system prompt and parameters, and the profile answers as gRPC does for the
adapter with that system prompt and those parameters; ``copy`` names it again; ``/api/tags``,
``/v1/models`` and ``/api/show`` (its Modelfile) list it; a blob with the wrong digest is
refused and leaves nothing; a base model by ``files`` and ``quantize`` are refused by name; the
profile survives a restart of the daemon.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import time

import httpx
import ollama
import pytest

from conftest import BIN, collect
from loractl.paths import layout
from test_ollama import NOBODY

SOURCE = "poet/v1"
SYSTEM = "You write one short line."
QUESTION = [{"role": "user", "content": "Describe the sea."}]


def _upload(blobs, content: bytes, *, declared: bool = True, digest: str | None = None) -> bool:
    async def chunks():
        for i in range(0, len(content), 7):
            yield content[i:i + 7]
    digest = digest or "sha256:" + hashlib.sha256(content).hexdigest()
    return asyncio.run(blobs.write(digest, chunks(), len(content) if declared else None))


def test_blob_bounds_quota_and_free_disk_refuse_and_leave_nothing(tmp_path, monkeypatch):
    from loractl.errors import DiskFull, InvalidRequest
    from loractld.store import blobs as blobs_module
    from loractld.store.blobs import Blobs

    monkeypatch.setattr(blobs_module, "FLUSH_BYTES", 8)   # the bounds are checked as an undeclared body streams
    free = {"bytes": 10_000}

    def check_free_space(needed: int) -> None:   # a disk whose free space the writes take
        if needed > free["bytes"]:
            raise DiskFull("full", "free some")
        free["bytes"] -= needed
    blobs = Blobs(tmp_path, max_blob_bytes=40, quota_bytes=60, check_free_space=check_free_space)
    assert _upload(blobs, b"a" * 30) and not _upload(blobs, b"a" * 30)   # stored, then already there
    for content, declared in ((b"b" * 41, True), (b"b" * 41, False), (b"c" * 31, True), (b"c" * 31, False)):
        with pytest.raises(InvalidRequest):    # one blob past 40 bytes; all past the quota of 60
            _upload(blobs, content, declared=declared)
    # An upload nobody used for an hour gives its room up when the quota needs it.
    old = blobs.path("sha256:" + hashlib.sha256(b"a" * 30).hexdigest())
    os.utime(old, (old.stat().st_atime, old.stat().st_mtime - blobs_module.UNUSED_TTL_S - 1))
    assert _upload(blobs, b"c" * 31) and not old.exists()
    blobs.remove(["sha256:" + hashlib.sha256(b"c" * 31).hexdigest()])
    free["bytes"] = 20
    with pytest.raises(DiskFull):
        _upload(blobs, b"d" * 30, declared=False)
    free["bytes"] = 10_000
    with pytest.raises(InvalidRequest, match="digest"):
        _upload(blobs, b"e" * 10, digest="sha256:" + "0" * 64)
    assert sorted(p.name for p in (tmp_path / ".blobs").iterdir()) == []
    (tmp_path / ".blobs" / ".part-left-by-a-kill").write_bytes(b"x")
    Blobs(tmp_path, max_blob_bytes=40, quota_bytes=60, check_free_space=check_free_space)
    assert not list((tmp_path / ".blobs").iterdir())


def test_held_blobs_outlive_another_creates_removal_and_leftovers_go_at_start(tmp_path):
    """Creates that send the same blobs hold them: the first one done removes nothing the
    others still need, the last one out removes what was installed; a kill's leftovers (part
    files, assembled folders of hard links) are cleared when the blobs are opened."""
    from loractl.errors import InvalidRequest
    from loractld.store.blobs import Blobs

    blobs = Blobs(tmp_path, max_blob_bytes=100, quota_bytes=200, check_free_space=lambda n: None)
    content = b"weights"
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    assert _upload(blobs, content)
    blobs.hold([digest])
    blobs.hold([digest])
    blobs.remove([digest])                       # another caller's removal: a create still holds it
    blobs.release([digest], used=True)           # the first create is done
    assert blobs.has(digest)
    folder = blobs.assemble({"adapter_model.safetensors": digest})
    assert (folder / "adapter_model.safetensors").read_bytes() == content
    blobs.release([digest], used=False)          # the last one out: one of them installed it
    assert not blobs.has(digest)
    with pytest.raises(InvalidRequest, match="not uploaded"):
        blobs.hold([digest])
    (tmp_path / ".blobs" / ".part-left-by-a-kill").write_bytes(b"x")
    assert folder.is_dir()                       # as a kill -9 mid-create leaves it
    Blobs(tmp_path, max_blob_bytes=100, quota_bytes=200, check_free_space=lambda n: None)
    assert not list((tmp_path / ".blobs").iterdir())


def test_a_trickled_upload_is_cut_at_its_deadline_and_gives_its_quota_back(tmp_path):
    """Issue 60, item 20: the body timeout is per body, not per piece. A declared 50-byte blob
    sent a byte every 0.1 s (each piece well within 0.5 s) is cut with 408 after about 0.5 s;
    until then it holds the quota, and another upload that needs that room is refused; after it,
    that upload goes through."""
    from loractl.errors import InvalidRequest
    from loractld.api.http.errors import HttpError
    from loractld.api.ollama.create import CreateDoor
    from loractld.store.blobs import Blobs

    blobs = Blobs(tmp_path, max_blob_bytes=100, quota_bytes=60, check_free_space=lambda n: None)
    door = CreateDoor(core=None, body_timeout_s=0.5)

    class Trickle:
        async def stream(self):
            for _ in range(50):
                await asyncio.sleep(0.1)
                yield b"x"

    other = b"y" * 20

    async def both():
        trickled = asyncio.create_task(blobs.write("sha256:" + hashlib.sha256(b"x" * 50).hexdigest(),
                                                   door._chunks(Trickle(), 50), 50))
        await asyncio.sleep(0.2)
        with pytest.raises(InvalidRequest, match="quota"):   # the trickle holds 50 of the 60 bytes
            await blobs.write("sha256:" + hashlib.sha256(other).hexdigest(), _pieces(other), len(other))
        started = time.monotonic()
        with pytest.raises(HttpError) as cut:
            await trickled
        return cut.value, time.monotonic() - started

    async def _pieces(content):
        yield content
    cut, waited = asyncio.run(both())
    assert cut.status == 408 and "--http-body-timeout" in cut.hint and waited < 1.0, (cut, waited)
    assert _upload(blobs, other)   # the quota it held is free again
    assert [p.name for p in (tmp_path / ".blobs").iterdir()] == ["sha256-" + hashlib.sha256(other).hexdigest()]


@pytest.fixture(scope="module")
def created(rig):
    client = ollama.Client(host=rig.http, timeout=300)
    folder = rig.root / "tiny" / "adapters" / SOURCE
    adapters = {name: client.create_blob(folder / name) for name in ("adapter_config.json",
                                                                     "adapter_model.safetensors")}
    for digest in adapters.values():
        assert httpx.head(f"{rig.http}/api/blobs/{digest}").status_code == 200
    lines = list(client.create(model="bard", adapters=adapters, system=SYSTEM,
                               parameters={"temperature": 0, "num_predict": 8, "stop": ["\n\n"]}, stream=True))
    statuses = [line.status for line in lines]
    assert statuses[-1] == "success" and "writing manifest" in statuses, statuses
    assert any(s.startswith("using existing layer sha256:") for s in statuses), statuses
    # The blobs' content is in the store now: they are not kept twice.
    assert httpx.head(f"{rig.http}/api/blobs/{adapters['adapter_config.json']}").status_code == 404
    return rig, client


def _grpc(rig, lora: str, messages: list[dict], **sampling) -> dict:
    async def go() -> dict:
        async with rig.daemon.client() as client:
            return await collect(client, messages=messages, lora=lora, **sampling)
    return asyncio.run(go())


def _plain(rig) -> dict:
    """The adapter the create installed, asked with the profile's system prompt and parameters."""
    return _grpc(rig, "bard-adapter", [{"role": "system", "content": SYSTEM}, *QUESTION], temperature=0.0,
                 max_tokens=8, stop=["\n\n"])


def test_the_created_model_answers_as_its_adapter_with_its_system_prompt(created):
    rig, client = created
    plain = _plain(rig)
    assert plain["ids"], plain
    assert client.chat(model="bard", messages=QUESTION).message.content == plain["text"]
    assert client.chat(model="bard:latest", messages=QUESTION).message.content == plain["text"]
    # Without the system prompt the adapter answers otherwise: the profile's reached the engine.
    bare = _grpc(rig, "bard-adapter", QUESTION, temperature=0.0, max_tokens=8, stop=["\n\n"])
    assert bare["ids"] != plain["ids"]


def test_copy_tags_models_and_show(created):
    rig, client = created
    assert client.copy("bard", "bard:copy").status == "success"
    assert client.chat(model="bard:copy", messages=QUESTION).message.content == _plain(rig)["text"]
    tags = {m.model: m for m in client.list().models}
    assert {"bard:latest", "bard:copy", "bard-adapter:latest"} <= set(tags), sorted(tags)
    assert tags["bard:latest"].details.parent_model.startswith(rig_base(rig))
    assert "lora" in tags["bard:latest"].details.families
    cards = {c["id"]: c for c in httpx.get(f"{rig.http}/v1/models").json()["data"]}
    assert cards["bard"]["parent"] == "bard-adapter" and cards["bard"]["loractl"]["system"] == SYSTEM
    assert httpx.get(f"{rig.http}/v1/models/bard").json() == cards["bard"]
    assert cards["bard/copy"]["loractl"]["kind"] == "profile"
    shown = client.show("bard")
    assert shown.modelfile == rig.ok("show", "bard", "--modelfile").stdout
    assert "\nADAPTER bard-adapter\n" in shown.modelfile and f"\nSYSTEM {SYSTEM}\n" in shown.modelfile
    assert "temperature" in shown.parameters and "num_predict" in shown.parameters
    raw = httpx.post(f"{rig.http}/api/show", json={"model": "bard"}).json()
    assert raw["system"] == SYSTEM
    with pytest.raises(ollama.ResponseError) as missing:
        client.copy("no-such-model", "other")
    assert missing.value.status_code == 404


def rig_base(rig) -> str:
    return httpx.get(f"{rig.http}/v1/models").json()["data"][0]["id"]


def test_a_blob_with_the_wrong_digest_is_refused_and_leaves_nothing(created):
    rig, _ = created
    content = b"not the adapter you are looking for"
    claimed = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    answer = httpx.post(f"{rig.http}/api/blobs/{claimed}", content=content)
    assert answer.status_code == 400 and "digest" in answer.json()["error"], answer.text
    assert httpx.head(f"{rig.http}/api/blobs/{claimed}").status_code == 404
    real = "sha256:" + hashlib.sha256(content).hexdigest()
    assert httpx.head(f"{rig.http}/api/blobs/{real}").status_code == 404
    assert not list(rig.root.rglob(".blobs/.part-*"))
    assert httpx.post(f"{rig.http}/api/blobs/sha256:xyz", content=content).status_code == 400
    # What a web page may send cross-origin without a preflight is refused, and stores nothing.
    for kind in ("text/plain", "application/x-www-form-urlencoded"):
        answer = httpx.post(f"{rig.http}/api/blobs/{real}", content=content, headers={"Content-Type": kind})
        assert answer.status_code == 415, answer.text
    assert httpx.head(f"{rig.http}/api/blobs/{real}").status_code == 404
    assert httpx.post(f"{rig.http}/api/blobs/{real}", content=content,
                      headers={"Content-Type": "application/octet-stream"}).status_code == 201
    assert httpx.head(f"{rig.http}/api/blobs/{real}").status_code == 200


def test_a_new_base_model_and_quantize_are_refused_by_name(created):
    rig, client = created
    for fields, word in (({"files": {"model.gguf": "sha256:" + "0" * 64}}, "files"), ({"quantize": "q4_K_M"},
                                                                                       "quantize")):
        answer = httpx.post(f"{rig.http}/api/create", json={"model": "nope", "from": "bard", **fields})
        assert answer.status_code == 400 and word in answer.json()["error"], answer.text
    missing = httpx.post(f"{rig.http}/api/create", json={"model": "nope", "adapters": {
        "adapter_config.json": "sha256:" + "1" * 64}})
    assert missing.status_code == 400 and "not uploaded" in missing.json()["error"], missing.text
    folder = rig.root / "tiny" / "adapters" / SOURCE
    adapters = {name: client.create_blob(folder / name) for name in ("adapter_config.json",
                                                                     "adapter_model.safetensors")}
    go = httpx.post(f"{rig.http}/api/create", json={"model": "nope", "adapters": adapters,
                                                     "template": "{{ .System }} {{ .Prompt }}"})
    assert go.status_code == 400 and "Go template" in go.json()["error"], go.text
    taken = httpx.post(f"{rig.http}/api/create", json={"model": "bard-adapter", "from": "bard"})
    assert taken.status_code == 400 and "adapter in the store" in taken.json()["error"], taken.text
    # Refused before anything was installed; the blobs wait for a create that uses them.
    assert not {"nope:latest", "nope-adapter:latest"} & {m.model for m in client.list().models}
    assert all(httpx.head(f"{rig.http}/api/blobs/{d}").status_code == 200 for d in adapters.values())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("curl"),
                    reason="needs root, setpriv and curl to call as another user")
def test_a_keyless_stranger_may_not_upload_create_or_copy(created, tmp_path):
    rig, client = created
    blob = tmp_path / "blob"
    blob.write_bytes(b"a stranger's blob")
    digest = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
    calls = [("/api/blobs/" + digest, ["--data-binary", f"@{blob}"], "upload"),
             ("/api/create", ["-d", json.dumps({"model": "stranger", "from": "bard"})], "create"),
             ("/api/copy", ["-d", json.dumps({"source": "bard", "destination": "stranger"})], "copy")]
    for path, data, operation in calls:
        out = subprocess.run([*NOBODY, "curl", "-s", "-m", "60", "-w", "\n%{http_code}", "-X", "POST",
                              "-H", "Content-Type: application/json", *data, rig.http + path],
                             capture_output=True, text=True).stdout
        text, _, code = out.rpartition("\n")
        assert code == "403" and "may not" in json.loads(text)["error"], (path, out)
        line = rf"audit uid=65534 http=127\.0\.0\.1:\d+ op={operation} target=\(request not read\) result=denied"
        assert re.search(line, rig.daemon.log.read_text(errors="replace")), operation
    assert httpx.head(f"{rig.http}/api/blobs/{digest}").status_code == 404
    assert "stranger:latest" not in {m.model for m in client.list().models}


def test_a_create_that_fails_after_its_blobs_were_installed_leaves_no_adapter(created):
    """The blobs' adapter is installed as <model>-adapter before the profile is made; when the
    profile then fails (FROM a profile whose adapter was removed since: its merge finds no
    source), that adapter is removed again and the blobs wait for another create."""
    rig, client = created
    rig.ok("cp", "bard-adapter", "fleeting/v1")
    rig.ok("create", "orphan", "--from", "fleeting/v1")
    rig.ok("rm", "fleeting/v1", "--force")
    folder = rig.root / "tiny" / "adapters" / SOURCE
    adapters = {name: client.create_blob(folder / name) for name in ("adapter_config.json",
                                                                     "adapter_model.safetensors")}
    with httpx.stream("POST", f"{rig.http}/api/create", json={"model": "late", "from": "orphan",
                                                              "adapters": adapters}, timeout=300) as answer:
        lines = [json.loads(line) for line in answer.iter_lines() if line.strip()]
    assert answer.status_code == 200 and "fleeting/v1" in lines[-1].get("error", ""), lines
    assert any(line.get("status", "").startswith("using existing layer") for line in lines), lines
    listed = {a["name"] for a in json.loads(rig.ok("ls", "--json").stdout)}
    assert not {"late", "late-adapter", "late-merged"} & listed, listed
    assert rig.cli("show", "late-adapter").returncode != 0
    assert all(httpx.head(f"{rig.http}/api/blobs/{d}").status_code == 200 for d in adapters.values())
    rig.ok("rm", "orphan")


def test_four_creates_at_once_from_the_same_blobs_all_succeed(created):
    """Issue 60, item 17: four parallel /api/create naming the same two blobs were one 200 and
    three 500s (the assembled folder emptied under each other, the blobs removed by the first)."""
    rig, client = created
    folder = rig.root / "tiny" / "adapters" / SOURCE
    adapters = {name: client.create_blob(folder / name) for name in ("adapter_config.json",
                                                                     "adapter_model.safetensors")}

    async def create(http: httpx.AsyncClient, model: str) -> tuple[int, list[dict]]:
        async with http.stream("POST", f"{rig.http}/api/create", json={"model": model, "adapters": adapters,
                                                                       "system": SYSTEM}) as answer:
            return answer.status_code, [json.loads(line) async for line in answer.aiter_lines() if line.strip()]

    async def all_at_once() -> list:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(create(http, f"quad{i}") for i in range(4)))
    answers = asyncio.run(all_at_once())
    assert [(status, lines[-1]) for status, lines in answers] == [(200, {"status": "success"})] * 4, answers
    models = {m.model for m in client.list().models}
    assert {f"quad{i}:latest" for i in range(4)} <= models, models
    answered = {client.chat(model=f"quad{i}", messages=QUESTION, options={"temperature": 0, "num_predict": 6})
                .message.content for i in range(4)}
    assert len(answered) == 1 and answered != {""}, answered   # one adapter, one system prompt: one answer
    assert all(httpx.head(f"{rig.http}/api/blobs/{d}").status_code == 404 for d in adapters.values())
    assert not list((layout(rig.root).store_dir / ".blobs").glob(".assembled-*"))
    for i in range(4):
        rig.ok("rm", f"quad{i}")
        rig.ok("rm", f"quad{i}-adapter")


def _many_adapters(rig, folder, count: int) -> Path:
    """A Modelfile of ``count`` distinct folder ADAPTERs (same weights, other configs), each pulled."""
    source = rig.root / "tiny" / "adapters" / SOURCE
    lines = ["FROM tiny"]
    for i in range(count):
        copy = folder / f"a{i}"
        shutil.copytree(source, copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        config["lora_dropout"] = i / 100
        config["rank_pattern"] = {module: config["r"] for module in config["target_modules"]}
        (copy / "adapter_config.json").write_text(json.dumps(config))
        lines.append(f"ADAPTER {copy}=0.1")
    (folder / "M").write_text("\n".join(lines) + "\n")
    return folder / "M"


def test_a_kill_mid_create_is_undone_at_start_and_the_profile_survives(created, tmp_path):
    """Issue 60, items 16 and 19: ``kill -9`` of the daemon mid-create left the adapters it had
    pulled (240 of 1,000) and ``.blobs/.assembled-*`` for good. Killed after its 2nd pull's
    install, the next start removes what that create pulled, and the leftovers; the profile made
    before answers as it did."""
    rig, _ = created
    before = _plain(rig)["text"]
    modelfile = _many_adapters(rig, tmp_path, 12)
    log_at = rig.daemon.log.stat().st_size
    create = subprocess.Popen([str(BIN / "loractl"), "create", "kx", "-f", str(modelfile), "--socket",
                               str(rig.daemon.socket)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while rig.daemon.log.read_bytes()[log_at:].count(b"DOWNLOADED_TO_DISK kx-adapter") < 2:
        assert create.poll() is None and time.monotonic() < deadline, (create.communicate(), rig.daemon.log_tail())
        time.sleep(0.02)
    rig.arm.write_text("store-installed")   # the next install kills the daemon, as kill -9 would
    assert rig.daemon.proc.wait(120) == -9, rig.daemon.log_tail()
    create.communicate(timeout=60)
    pulled = {p.name for p in layout(rig.root).store_dir.iterdir() if p.is_symlink() and p.name.startswith("kx")}
    assert len(pulled) >= 2, pulled     # what the kill left, before the restart
    leftover = layout(rig.root).store_dir / ".blobs" / ".assembled-0123456789abcdef"
    leftover.mkdir(parents=True)
    (leftover / "adapter_model.safetensors").write_bytes(b"left by kill -9 mid-create")
    rig.start()
    listed = {a["name"] for a in json.loads(rig.ok("ls", "--json").stdout)}
    assert not {n for n in listed if n.startswith("kx")}, sorted(listed)
    assert "a create the last run never finished had pulled it" in rig.daemon.log.read_text(errors="replace")
    assert not leftover.exists()
    client = ollama.Client(host=rig.http, timeout=300)
    assert "bard:latest" in {m.model for m in client.list().models}
    assert client.chat(model="bard", messages=QUESTION).message.content == before
    assert not list((layout(rig.root).store_dir / ".creates").glob("*"))
