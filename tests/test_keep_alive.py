"""``--keep-alive``: after that long idle the engine sleeps and gives its memory back; the next
request wakes it, with the pins where they were and the tokens unchanged (issue 56, item 3).

On the CPU a sleep is a full engine stop and a wake a fresh start (a real engine here); the
CUDA path (vLLM's sleep mode, levels 1 and 2) is driven by a test double of the engine's
sleep and wake calls only, in the same KeepAlive and tier code.
"""

from __future__ import annotations

import asyncio
import json
import time

import psutil
import pytest

from conftest import collect, own_daemon, run_cli
from loractld.serving import keep_alive as ka

KEEP_ALIVE_S = 5.0
NAMES = ["sql-expert/v1", "python-expert/v1"]
PROMPT = "Write a query that lists every user"
TOKENS = 12
WAKE_TIMEOUT_S = 400


def tree_rss(pid: int) -> int:
    """The resident memory of the daemon and every process below it."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def status(d) -> dict:
    result = run_cli("status", "--json", "--socket", str(d.socket))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def listing(d) -> dict[str, dict]:
    result = run_cli("ls", "--json", "--socket", str(d.socket))
    assert result.returncode == 0, result.stderr
    return {a["name"]: a for a in json.loads(result.stdout)}


def wait_state(d, want: str, timeout: float = 60) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if status(d)["state"] == want:
            return time.monotonic() - began
        time.sleep(0.2)
    raise AssertionError(f"state never became {want!r}; last: {status(d)['state']}\n{d.log_tail()}")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def sleepy(home):
    d = own_daemon(home, "keepalive", NAMES, "--keep-alive", f"{KEEP_ALIVE_S:g}s", name="k")
    for name, to in ((NAMES[0], "device"), (NAMES[1], "host")):
        # A pin may wake the engine (a full start on the CPU: tens of seconds on a busy machine).
        result = run_cli("pin", name, "--to", to, "--socket", str(d.socket), timeout=WAKE_TIMEOUT_S)
        assert result.returncode == 0, result.stderr
    yield d
    d.stop()


def generate(d, lora: str | None) -> dict:
    async def go():
        async with d.client() as client:
            return await collect(client, messages=[{"role": "user", "content": PROMPT}], lora=lora,
                                 max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0)
    return asyncio.run(go())


def test_idle_engine_stops_and_the_next_request_wakes_it(sleepy, demo, reference):
    d = sleepy
    expected = {name: reference.greedy(reference.chat_ids(PROMPT), demo / "adapters" / name, TOKENS, TOKENS)
                for name in NAMES}
    expected[None] = reference.greedy(reference.chat_ids(PROMPT), None, TOKENS, TOKENS)
    cli_expected = reference.greedy(reference.chat_ids(PROMPT), demo / "adapters" / NAMES[1], 24)  # to EOS, as vLLM
    assert generate(d, NAMES[0])["ids"] == expected[NAMES[0]]
    idle_from = time.monotonic()
    awake = status(d)
    assert awake["state"] == "ready"
    before_ls = listing(d)
    assert (before_ls[NAMES[0]]["tier"], before_ls[NAMES[0]]["pin"]) == ("device", "device")
    assert before_ls[NAMES[1]]["pin"] == "host"
    rss_awake = tree_rss(d.proc.pid)
    engine_cores = [c for c in psutil.Process(d.proc.pid).children(recursive=True) if "EngineCore" in c.name()]
    assert engine_cores, "the engine core runs in a child process"
    before = run_cli("metrics", "--socket", str(d.socket)).stdout
    sleeps, wakes = metric(before, "loractl_engine_sleeps_total"), metric(before, "loractl_engine_wakes_total")

    wait_state(d, "asleep", timeout=KEEP_ALIVE_S + 60)
    fell = time.monotonic() - idle_from
    # The engine core's process exits: wait for the metric that says this sleep ended.
    deadline = time.monotonic() + 120
    while metric(run_cli("metrics", "--socket", str(d.socket)).stdout, "loractl_engine_sleeps_total") <= sleeps:
        assert time.monotonic() < deadline, d.log_tail()
        time.sleep(0.2)
    asleep_after = time.monotonic() - idle_from
    time.sleep(0.5)
    rss_asleep = tree_rss(d.proc.pid)
    print(f"falling asleep {fell:.1f} s and asleep {asleep_after:.1f} s after the last request; RSS of the "
          f"process tree: awake {rss_awake / 2**20:.0f} MiB, asleep {rss_asleep / 2**20:.0f} MiB")
    assert not [c for c in engine_cores if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert rss_asleep < rss_awake - 150 * 2**20, (rss_awake, rss_asleep)

    # Whatever needs no engine answers at its usual speed, from the state last read.
    began = time.monotonic()
    asleep_ls = listing(d)
    info = status(d)
    metrics = run_cli("metrics", "--socket", str(d.socket)).stdout
    answered = time.monotonic() - began
    assert answered < 10, answered   # three CLI processes; an engine start takes longer
    assert info["state"] == "asleep" and info["ready"]
    assert {n: (a["pin"]) for n, a in asleep_ls.items()} == {n: a["pin"] for n, a in before_ls.items()}
    assert metric(metrics, "loractl_engine_asleep") == 1
    human = run_cli("status", "--socket", str(d.socket)).stdout
    assert "asleep" in human
    # pull and rm need no engine either (the preflight waits for the first use once awake).
    began = time.monotonic()
    pulled = run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", "poet/v1", "--socket", str(d.socket))
    assert pulled.returncode == 0, pulled.stderr
    removed = run_cli("rm", "poet/v1", "--socket", str(d.socket))
    assert removed.returncode == 0, removed.stderr
    assert time.monotonic() - began < 20
    assert status(d)["state"] == "asleep"   # none of those woke it

    # The next request wakes it, waits, and is served exactly; the pins are where they were.
    # `loractl run` says on stderr that it waits for the wake (a live line on a terminal).
    began = time.monotonic()
    ran = run_cli("run", "--lora", NAMES[1], "-t", "0", "-n", "24", "--socket", str(d.socket), PROMPT,
                  timeout=WAKE_TIMEOUT_S)
    woke = time.monotonic() - began
    print(f"the request that woke the engine took {woke:.1f} s")
    assert ran.returncode == 0, ran.stderr
    assert "waking the engine" in ran.stderr
    assert ran.stdout == reference.text(cli_expected) + "\n"
    assert generate(d, NAMES[1])["ids"] == expected[NAMES[1]]
    assert generate(d, None)["ids"] == expected[None]
    assert generate(d, NAMES[0])["ids"] == expected[NAMES[0]]
    assert tree_rss(d.proc.pid) > rss_asleep + 150 * 2**20   # the engine core is back
    assert status(d)["state"] == "ready"
    after = listing(d)
    assert (after[NAMES[0]]["tier"], after[NAMES[0]]["pin"]) == ("device", "device")
    assert after[NAMES[1]]["pin"] == "host" and after[NAMES[1]]["tier"] in ("host", "device")
    metrics = run_cli("metrics", "--socket", str(d.socket)).stdout
    assert metric(metrics, "loractl_engine_asleep") == 0
    # At least this wake (on a loaded machine the engine may have slept and woken again since).
    assert metric(metrics, "loractl_engine_wakes_total") >= wakes + 1


def test_request_arriving_while_falling_asleep_is_served(sleepy, demo, reference):
    """The request is sent the moment the engine starts falling asleep (its event): it waits for
    the sleep to end, wakes the engine and gets the reference tokens."""
    d = sleepy
    expected = reference.greedy(reference.chat_ids(PROMPT), demo / "adapters" / NAMES[0], TOKENS, TOKENS)
    if status(d)["state"] != "ready":
        generate(d, None)

    async def go():
        async with d.client() as client:
            kinds = []
            async for event in client.events():
                kinds.append(event["kind"])
                if event["kind"] == "ENGINE_FALLING_ASLEEP":
                    break
            got = await collect(client, messages=[{"role": "user", "content": PROMPT}], lora=NAMES[0],
                                max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0)
            return got
    got = asyncio.run(asyncio.wait_for(go(), timeout=2 * WAKE_TIMEOUT_S))
    assert got["ids"] == expected
    log = d.log.read_text()
    tail = log[log.rindex("ENGINE_FALLING_ASLEEP"):]
    order = [tail.index(k) for k in ("ENGINE_FALLING_ASLEEP", "ENGINE_ASLEEP", "ENGINE_WAKING", "ENGINE_AWAKE")]
    assert order == sorted(order), tail[-3000:]
    assert status(d)["state"] == "ready"


def test_keep_alive_durations():
    assert [ka.parse_duration(t) for t in ("5m", "300s", "300", "1h", "1h30m", "2.5s")] == \
        [300, 300, 300, 3600, 5400, 2.5]
    assert ka.parse_duration("0") == ka.parse_duration("forever") == 0
    with pytest.raises(Exception):
        ka.parse_duration("soon")
    assert ka.resolve_idle(None, "cuda") == 300 and ka.resolve_idle(None, "cpu") is None
    assert ka.resolve_idle(0.0, "cuda") is None and ka.resolve_idle(3.0, "cpu") == 3.0


# -- the CUDA path: vLLM's sleep mode, through a double of AsyncLLM's sleep/wake calls only ----

class SleepModeLLM:
    """What :class:`Engine` calls of ``AsyncLLM`` on a sleep-mode wake: recorded."""

    def __init__(self) -> None:
        self.calls: list = []
        self.host = [7, 9]

    async def sleep(self, level):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up",))
        return True

    async def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method))
        if method == "loractl_lora_state":
            return [{"host": list(self.host)}]
        return [True]

    async def remove_lora(self, engine_id):
        self.calls.append(("remove_lora", engine_id))
        self.host.remove(engine_id)
        return True

    async def reset_prefix_cache(self, *args):
        self.calls.append(("reset_prefix_cache",))
        return True


def cuda_engine(level_calls: SleepModeLLM):
    from loractld.engine.client import Engine, EngineSettings

    engine = Engine.__new__(Engine)   # a started engine's state, without vLLM: only the sleep calls are doubled
    engine._llm = level_calls
    engine.settings = EngineSettings(model="m", sleep_mode=True)
    engine.device = "cuda"
    return engine


@pytest.mark.parametrize("level", [1, 2])
def test_cuda_sleep_mode_calls(level):
    llm = SleepModeLLM()
    engine = cuda_engine(llm)
    assert engine.has_sleep_mode

    async def go():
        assert await engine.sleep(level) == f"level {level}"
        assert engine.asleep
        how = await engine.wake()
        return how
    how = asyncio.run(go())
    assert not engine.asleep and "sleep mode" in how
    if level == 1:
        assert llm.calls == [("sleep", 1), ("wake_up",), ("reset_prefix_cache",)]
        assert not engine.restarted_by_sleep   # weights and adapters kept: nothing to restore
    else:
        # Level 2 dropped the weights and the adapters' device copies: weights read again, every
        # adapter dropped (KeepAlive then pins the pinned ones again, as after a CPU restart).
        assert llm.calls[:3] == [("sleep", 2), ("wake_up",), ("rpc", "reload_weights")]
        assert ("remove_lora", 7) in llm.calls and ("remove_lora", 9) in llm.calls
        assert llm.calls[-1] == ("reset_prefix_cache",)
        assert engine.restarted_by_sleep


def test_cpu_engine_has_no_sleep_mode():
    llm = SleepModeLLM()
    engine = cuda_engine(llm)
    engine.device = "cpu"
    assert not engine.has_sleep_mode


class FakeGate:
    tickets: dict = {}


class FakeTiers:
    """The parts of Tiers KeepAlive uses, for the race test below."""

    def __init__(self) -> None:
        self.gate = FakeGate()
        self.lock = asyncio.Lock()
        self.reader = self
        self.following = True

    def stop_following(self):
        self.following = False

    def start_following(self):
        self.following = True

    async def settled(self):
        pass


class SlowEngine:
    def __init__(self) -> None:
        self.asleep = False
        self.restarted_by_sleep = False
        self.log: list[str] = []

    def unfinished_requests(self):
        return 0

    async def sleep(self, level):
        self.asleep = True
        self.log.append("sleep-begin")
        await asyncio.sleep(0.3)
        self.log.append("sleep-end")
        return "stopped"

    async def wake(self):
        self.log.append("wake-begin")
        await asyncio.sleep(0.1)
        self.asleep = False
        self.log.append("wake-end")
        return "woken"


def test_hold_during_fall_waits_then_wakes_and_holds_keep_it_up():
    from loractld.events import EventBus, Metrics

    async def go():
        engine, tiers = SlowEngine(), FakeTiers()
        keeper = ka.KeepAlive(engine, tiers, EventBus(), Metrics(), idle_s=0.2)
        keeper.start()
        async with keeper.hold():
            await asyncio.sleep(0.5)   # longer than idle_s: a holder keeps it up
            assert engine.log == []
        await asyncio.sleep(0.3)       # idle: it falls asleep (0.3 s to stop)
        assert keeper.state == ka.FALLING_ASLEEP
        async with keeper.hold():      # arrives while it falls asleep
            engine.log.append("served")
            assert keeper.state == ka.AWAKE and not engine.asleep
        keeper.stop()
        return engine.log
    assert asyncio.run(go()) == ["sleep-begin", "sleep-end", "wake-begin", "wake-end", "served"]


def test_a_caller_that_goes_away_does_not_cut_the_wake_short():
    """Ctrl-C during a wake: the wake goes on (a half-started engine would be left behind), and
    the next request waits for that same wake instead of starting a second engine."""
    from loractld.events import EventBus, Metrics

    async def go():
        engine, tiers = SlowEngine(), FakeTiers()
        keeper = ka.KeepAlive(engine, tiers, EventBus(), Metrics(), idle_s=0.1)
        keeper.start()
        await asyncio.sleep(0.6)   # asleep
        assert keeper.state == ka.ASLEEP
        first = asyncio.ensure_future(keeper.awake())
        await asyncio.sleep(0.02)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert keeper.state == ka.WAKING
        await keeper.awake()
        keeper.stop()
        return engine.log
    assert asyncio.run(go()).count("wake-begin") == 1
