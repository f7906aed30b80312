"""A daemon you can trust under faults and bad input: SIGKILL and restart, a dead engine,
peer credentials, the registry, and 64 concurrent clients while the tiers churn."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from conftest import BIN, ENGINE_FLAGS, collect, run_cli, start_daemon, sub_home
from loractl.errors import EngineUnavailable, LoractlError
from loractl.registry import ServiceDiscovery
from test_errors import assert_one_error


def live_instances(home) -> list:
    return ServiceDiscovery(home=str(home)).list_instances("loractl", "loractld")


def test_registry_publishes_the_lora_schema(daemon, demo):
    assert run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", "reg-poet/v1",
                   "--socket", str(daemon.socket)).returncode == 0
    assert run_cli("load", "reg-poet/v1", "--socket", str(daemon.socket)).returncode == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = [i for i in live_instances(daemon.home) if i.metadata().get("socket") == str(daemon.socket)]
        if mine and "reg-poet/v1" in mine[0].metadata()["lora"].get("loaded_loras", []):
            break
        time.sleep(0.1)
    (instance,) = mine
    lora = instance.metadata()["lora"]
    assert instance.status == "ready" and instance.pid == daemon.proc.pid
    assert lora["enabled"] and lora["max_loras"] == 2 and lora["max_lora_rank"] == 16
    assert {"name": "reg-poet/v1", "state": "device", "pinned": False, "pinned_to": ""} in lora["available_loras"]
    assert lora["capacity"]["loaded_count"] + lora["capacity"]["available_slots"] == 2
    listed = json.loads(run_cli("instances", "--json", "--home", str(daemon.home)).stdout)
    assert instance.instance_id in {i["instance_id"] for i in listed}
    # Into an 80-column pipe: one whole line per instance, names never split.
    table = run_cli("instances", "--home", str(daemon.home), env={"COLUMNS": "80"}).stdout.splitlines()
    assert table[0].split() == ["INSTANCE", "STATUS", "MODEL", "ON", "DEVICE", "SINCE"]
    row = next(line for line in table if line.startswith(instance.instance_id))
    assert "reg-poet/v1" in row and "ready" in row, table


def test_sigkill_mid_generation_then_restart(home, demo, reference):
    """SIGKILL while a generation streams: after a restart the store, the pin and the preload
    are as before, the registry shows one live instance, and nothing half-written is visible."""
    sub = home / "faults"
    sub.mkdir(exist_ok=True)
    if not (sub / "tiny").exists():
        (sub / "tiny").symlink_to(home / "tiny")
    # The whole context the tiny model has (1024), so the reply killed mid-stream runs ~1000
    # steps: it cannot end while the test reads its first byte and kills, however loaded the machine.
    flags = [*ENGINE_FLAGS]
    flags[flags.index("--max-model-len") + 1] = "1024"
    d = start_daemon(sub, name="f", engine_flags=flags)
    for name in ("sql-expert/v1", "poet/v1"):
        assert run_cli("pull", str(demo / "adapters" / name), "--name", name, "--socket", str(d.socket)).returncode == 0
    assert run_cli("pin", "sql-expert/v1", "--socket", str(d.socket)).returncode == 0
    before = json.loads(run_cli("ls", "--json", "--socket", str(d.socket)).stdout)
    proc = subprocess.Popen([str(BIN / "loractl"), "run", "-t", "0", "-n", "1000", "--lora", "poet/v1", "Once",
                             "--socket", str(d.socket)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Kill once text streams (the CLI flushes every chunk): 200 tokens took under half a
    # second on an idle machine, so neither a fixed sleep nor a short reply is safe.
    assert proc.stdout.read(1), proc.stderr.read()
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait(30)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "Traceback" not in err, err
    assert not live_instances(sub), "a SIGKILLed daemon must read as gone without any cleanup"

    d2 = start_daemon(sub, "--preload", "poet/v1", name="f")
    try:
        after = {a["name"]: a for a in json.loads(run_cli("ls", "--json", "--socket", str(d2.socket)).stdout)}
        assert {a["name"]: a["revision"] for a in before} == {n: a["revision"] for n, a in after.items()}
        assert after["sql-expert/v1"]["pinned"] and after["sql-expert/v1"]["tier"] == "device"
        assert after["poet/v1"]["tier"] == "device"
        assert len(live_instances(sub)) == 1
        assert not any((sub / "adapters" / ".tmp").iterdir())
        out = run_cli("run", "-t", "0", "-n", "8", "--lora", "poet/v1", "hi", "--socket", str(d2.socket))
        expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / "poet" / "v1", 8)
        assert out.stdout == reference.text(expected) + "\n"

        # The engine dies (its process killed): not ready, requests fail clearly, the
        # daemon exits non-zero so that systemd's Restart=on-failure starts it afresh.
        engine_procs = psutil.Process(d2.proc.pid).children(recursive=True)
        core = [p for p in engine_procs if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM")]
        assert core, [p.cmdline() for p in engine_procs]
        core[0].kill()
        result = run_cli("run", "-t", "0", "-n", "4", "hi", "--socket", str(d2.socket))
        assert result.returncode in (3, 6), result.stderr
        assert "engine" in result.stderr or "daemon" in result.stderr
        assert d2.proc.wait(60) == 1, d2.log_tail()
        assert "the engine died" in d2.log_tail(200)
        assert not live_instances(sub)
    finally:
        if d2.proc.poll() is None:
            d2.stop()


def test_non_owners_may_read_but_not_change(daemon, demo):
    """SO_PEERCRED: with the socket opened up, another uid can list but not mutate; every
    mutation lands in the audit log with the caller's uid."""
    assert run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", "audit/v1",
                   "--socket", str(daemon.socket)).returncode == 0
    home_mode = os.stat(daemon.home).st_mode & 0o777
    os.chmod(daemon.home, 0o711)  # let another uid reach the socket at all
    os.chmod(daemon.socket, 0o666)
    try:
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env = {**os.environ, "NO_COLOR": "1", "HOME": "/tmp"}
        listing = subprocess.run([*as_nobody, str(BIN / "loractl"), "ls", "--json", "--socket", str(daemon.socket)],
                                 capture_output=True, text=True, env=env)
        assert listing.returncode == 0, listing.stderr
        change = subprocess.run([*as_nobody, str(BIN / "loractl"), "load", "audit/v1", "--socket",
                                 str(daemon.socket)], capture_output=True, text=True, env=env)
        assert_one_error(change, 9, "uid 65534 may not load")
    finally:
        os.chmod(daemon.socket, 0o600)
        os.chmod(daemon.home, home_mode)
    log = daemon.log_tail(2000)
    assert "audit uid=65534" in log and "op=load target=audit/v1 result=denied" in log
    assert f"audit uid={os.getuid()}" in log and "op=pull target=" in log and "as audit/v1 result=ok" in log


def test_the_socket_is_private_by_default(daemon):
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o600"
    home_mode = os.stat(daemon.home).st_mode & 0o777
    os.chmod(daemon.home, 0o711)  # so that only the socket's own mode stands in the way
    env = {**os.environ, "NO_COLOR": "1", "HOME": "/tmp"}
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(BIN / "loractl"),
                             "status", "--socket", str(daemon.socket)], capture_output=True, text=True, env=env)
    os.chmod(daemon.home, home_mode)
    assert_one_error(result, 9, "no permission to use the daemon's socket")


def test_64_clients_while_tiers_churn(daemon, demo, reference):
    """64 concurrent streams (base and four adapters) while loads and evictions churn, for a
    bounded time: no crash, and every output equals its reference."""
    names = ["sql-expert/v1", "python-expert/v1", "poet/v1", "translator/v1"]
    for name in names:
        run_cli("pull", str(demo / "adapters" / name), "--name", f"churn-{name}", "--socket", str(daemon.socket))
    prompts = ["hi", "Write a query", "Once upon a time", "How do I reverse a list in Python?"]
    n = 16

    async def go():
        async with daemon.client() as control:
            stop = asyncio.Event()

            async def churn():
                ops = 0
                while not stop.is_set():
                    name = f"churn-{names[ops % 4]}"
                    try:
                        await (control.load(name) if ops % 3 else control.evict(name, source="host"))
                    except LoractlError:
                        pass  # an adapter in use may refuse; what matters is outputs and liveness
                    ops += 1
                    await asyncio.sleep(0.02)
                return ops

            async def client(i):
                async with daemon.client() as c:
                    name = None if i % 5 == 4 else f"churn-{names[i % 5]}"
                    return i, await collect(c, messages=[{"role": "user", "content": prompts[i % 4]}], lora=name,
                                            max_tokens=n, min_tokens=n, temperature=0.0)

            churner = asyncio.create_task(churn())
            began = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(64))), timeout=300)
            elapsed = time.monotonic() - began
            stop.set()
            return results, await churner, elapsed

    results, churn_ops, elapsed = asyncio.run(go())
    for i, got in results:
        adapter = None if i % 5 == 4 else demo / "adapters" / names[i % 5]
        assert got["ids"] == reference.greedy(reference.chat_ids(["hi", "Write a query", "Once upon a time",
                                                                   "How do I reverse a list in Python?"][i % 4]),
                                              adapter, n, n), i
    print(f"\n64 clients x {n} tokens in {elapsed:.2f} s ({64 * n / elapsed:.0f} tok/s) with {churn_ops} tier ops")
    assert run_cli("status", "--json", "--socket", str(daemon.socket)).returncode == 0


def test_the_cli_routes_to_the_daemon_holding_the_adapter(daemon, home, demo, reference):
    """Two ready daemons in one registry: plain commands ask which one, --instance picks,
    and run/chat go to the daemon that already holds the adapter on device. One daemon per
    home, so the second has its own and joins the first's registry through LORACTL_REGISTRY."""
    other = start_daemon(sub_home(home, "routed"), name="r", env={"LORACTL_REGISTRY": str(home / "registry")})
    try:
        name = "routed/v1"
        assert run_cli("pull", str(demo / "adapters" / "translator" / "v1"), "--name", name,
                       "--socket", str(other.socket)).returncode == 0
        assert run_cli("load", name, "--socket", str(other.socket)).returncode == 0
        env = {"LORACTL_HOME": str(home)}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the registry entry follows the load within ~50 ms
            metas = [i.metadata() for i in live_instances(home) if i.status == "ready"]
            if any(name in m.get("lora", {}).get("loaded_loras", []) for m in metas):
                break
            time.sleep(0.1)
        assert_one_error(run_cli("status", env=env), 2, "daemons are running", "--instance")
        ours = next(i.instance_id for i in live_instances(home) if i.metadata().get("socket") == str(other.socket))
        status = run_cli("--instance", ours, "status", "--json", env=env)
        assert status.returncode == 0 and json.loads(status.stdout)["socket"] == str(other.socket)
        out = run_cli("run", "--lora", name, "-t", "0", "-n", "8", "hi", env=env)
        assert out.returncode == 0, out.stderr
        expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / "translator" / "v1", 8)
        assert out.stdout == reference.text(expected) + "\n"
    finally:
        other.stop()
