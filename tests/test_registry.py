"""The file-based service registry: no daemon, no engine, a second or two in all."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from loractl.registry import ServiceDiscovery, ServiceRegistry

REPO = Path(__file__).resolve().parent.parent
NS, COMP = "loractl", "worker"


@pytest.fixture
def root():
    d = Path(tempfile.mkdtemp(prefix="lct-reg-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def ids(disc: ServiceDiscovery) -> list[str]:
    return [i.instance_id for i in disc.list_instances(NS, COMP)]


def test_register_list_update_close(root):
    reg, disc = ServiceRegistry(root), ServiceDiscovery(root)
    assert disc.list_instances(NS, COMP) == []  # folder not even created yet
    h = reg.register_instance(NS, COMP, instance_id="w1", metadata={"port": 1})
    [inst] = disc.list_instances(NS, COMP)
    assert (inst.instance_id, inst.status, inst.pid) == ("w1", "not_ready", os.getpid())
    assert inst.metadata() == {"port": 1} and inst.path == root / NS / COMP / "w1.json"
    assert h.instance_id() == "w1"

    h.set_metadata({"port": 2, "models": ["a", "b"]})
    h.set_ready(True)
    [inst] = disc.list_instances(NS, COMP)
    assert inst.metadata() == {"port": 2, "models": ["a", "b"]} and inst.status == "ready"
    h.set_ready("not_ready")
    assert disc.list_instances(NS, COMP)[0].status == "not_ready"
    with pytest.raises(ValueError):
        h.set_ready("maybe")
    with pytest.raises(TypeError):
        h.set_metadata({"x": object()})

    h.close()
    h.close()  # idempotent
    assert ids(disc) == []
    assert sorted(os.listdir(root / NS / COMP)) == []  # json and lock both gone


def test_default_id_context_manager_and_live_duplicate(root):
    reg, disc = ServiceRegistry(root), ServiceDiscovery(root)
    with reg.register_instance(NS, COMP) as h:
        assert f"-{os.getpid()}-" in h.instance_id()
        assert ids(disc) == [h.instance_id()]
        with pytest.raises(FileExistsError):
            reg.register_instance(NS, COMP, instance_id=h.instance_id())
        assert ids(disc) == [h.instance_id()]  # the failed twin did not disturb it
    assert ids(disc) == []


def test_sigkilled_holder_reads_as_gone_without_cleanup(root):
    code = (
        "import sys, time\n"
        "from loractl.registry import ServiceRegistry\n"
        f"h = ServiceRegistry({str(root)!r}).register_instance({NS!r}, {COMP!r}, instance_id='victim')\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        disc = ServiceDiscovery(root)
        assert ids(disc) == ["victim"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # Nothing cleaned up: the files are still there, yet the entry reads as gone.
        assert (root / NS / COMP / "victim.json").exists()
        assert ids(disc) == []
        # ... and the reader opportunistically removed the dead files.
        assert os.listdir(root / NS / COMP) == []
        # The id is free again.
        with ServiceRegistry(root).register_instance(NS, COMP, instance_id="victim"):
            assert ids(disc) == ["victim"]
    finally:
        proc.kill()
        proc.wait()


def test_stale_heartbeat_hides_hung_instance_and_updates_refresh_it(root):
    reg = ServiceRegistry(root, heartbeat_s=60)
    # 2 s: the fresh reads right after a heartbeat must not read stale on a loaded machine.
    disc = ServiceDiscovery(root, stale_after_s=2)
    with reg.register_instance(NS, COMP, instance_id="hung") as h:
        assert ids(disc) == ["hung"]
        time.sleep(2.2)
        assert ids(disc) == []  # lock held, heartbeat old: hung-but-alive
        assert (root / NS / COMP / "hung.json").exists()  # stale is never deleted
        h.set_metadata({"k": "v"})
        assert ids(disc) == ["hung"]


def test_heartbeat_thread_keeps_it_fresh(root):
    # Stale only after 10 s: the point is the heartbeat moving on, and a loaded machine can
    # hold the heartbeat thread back for longer than a fraction of a second.
    disc = ServiceDiscovery(root, stale_after_s=10)
    with ServiceRegistry(root, heartbeat_s=0.05).register_instance(NS, COMP, instance_id="beat"):
        first = disc.list_instances(NS, COMP)[0].heartbeat
        time.sleep(0.5)
        [inst] = disc.list_instances(NS, COMP)
        assert inst.heartbeat > first


def test_watch_in_a_thread(root):
    reg, disc = ServiceRegistry(root), ServiceDiscovery(root)
    early = reg.register_instance(NS, COMP, instance_id="early")
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def consume():
        for ev in disc.watch(NS, COMP, poll_s=0.02, stop=stop):
            events.put((ev.kind, ev.instance.instance_id))

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    try:
        assert events.get(timeout=5) == ("added", "early")  # the initial set
        late = reg.register_instance(NS, COMP, instance_id="late")
        assert events.get(timeout=5) == ("added", "late")
        late.close()
        assert events.get(timeout=5) == ("removed", "late")
        early.close()
        assert events.get(timeout=5) == ("removed", "early")
    finally:
        stop.set()
        t.join(timeout=5)
        early.close()
    assert not t.is_alive()


def test_atomic_writes_leave_no_temp_files_and_garbage_is_ignored(root):
    reg, disc = ServiceRegistry(root), ServiceDiscovery(root)
    with reg.register_instance(NS, COMP, instance_id="good") as h:
        for i in range(20):
            h.set_metadata({"i": i})
        folder = root / NS / COMP
        assert sorted(os.listdir(folder)) == ["good.json", "good.lock"]
        doc = json.loads((folder / "good.json").read_text())
        assert set(doc) == {"format", "namespace", "component", "instance_id", "pid", "host",
                            "status", "heartbeat", "started", "metadata"}

        # A half-written file, a foreign temp file, a json pointing at another id, an empty file.
        (folder / "half.json").write_text('{"namespace": "loractl", "compo')
        (folder / "half.lock").touch()
        (folder / ".good.json.abc.tmp").write_text("{")
        (folder / "empty.json").write_text("")
        (folder / "liar.json").write_text(json.dumps({**doc, "instance_id": "good"}))
        (folder / "Bad Name.json").write_text("{}")
        [inst] = disc.list_instances(NS, COMP)
        assert inst.instance_id == "good" and inst.metadata() == {"i": 19}


@pytest.mark.parametrize("bad", ["../x", "A", "a/b", "", ".hidden", "-x", "a b", "x" * 200])
def test_invalid_names_raise(root, bad):
    reg, disc = ServiceRegistry(root), ServiceDiscovery(root)
    with pytest.raises(ValueError):
        reg.register_instance(bad, COMP)
    with pytest.raises(ValueError):
        reg.register_instance(NS, bad)
    with pytest.raises(ValueError):
        reg.register_instance(NS, COMP, instance_id=bad)
    with pytest.raises(ValueError):
        disc.list_instances(bad, COMP)
    assert not any(root.rglob("*"))  # nothing created anywhere


def test_default_root_follows_home(root):
    assert ServiceRegistry(home=str(root)).root == root / "registry"
    assert ServiceDiscovery(home=str(root)).root == root / "registry"


def test_module_stays_light():
    code = "import sys, loractl.registry; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "[]"
