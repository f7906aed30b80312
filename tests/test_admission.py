"""The admission gate's policies, driven with a fake clock (no engine: the gate only counts and
chooses; tests/test_tiers.py runs it in front of the real engine).

After every change, the invariant is checked: active unpinned adapters + device pins <= places.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from loractld.serving.admission import AdapterBatching, AdaptiveBatching, FirstCome, Gate
from loractld.serving.exchange_price import ExchangePrice
from loractld.serving.policies import PolicyContext, make_policy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def checked(gate: Gate) -> Gate:
    """Assert the gate's invariant after each admission."""
    def on_admit(ticket):
        assert gate.used <= gate.places, (gate.running, gate.pinned)
        admitted.append(ticket)

    admitted: list = []
    gate.on_admit = on_admit
    gate.admitted_log = admitted  # type: ignore[attr-defined]
    return gate


async def arrive(gate: Gate, key, label=None):
    """Start a request; return its task (done when admitted) after letting the loop run."""
    task = asyncio.ensure_future(gate.enter(key, label or f"a{key}"))
    await settle()
    return task


async def settle():
    """Let every task that can run, run (a grant takes a turn or two to reach its waiter)."""
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


def test_base_requests_and_device_pinned_adapters_never_wait():
    async def go():
        gate = checked(Gate(2, FirstCome()))
        await gate.reserve(7)                       # a device pin: one place for good
        a = await arrive(gate, 1)
        b = await arrive(gate, 2)                   # no place left for a second unpinned adapter
        base = await arrive(gate, None)
        pinned = await arrive(gate, 7)
        assert a.done() and not b.done() and base.done() and pinned.done()
        assert gate.position(gate.queue[0]) == 1 and gate.queue[0].key == 2
        gate.finish(a.result())
        await settle()
        assert b.done()
    run(go())


@pytest.mark.parametrize("policy", ["first-come", "batching", "adaptive"])
def test_never_more_adapters_than_places_under_random_traffic(policy):
    """Random arrivals, ends, cancellations, pins and unpins: the invariant holds after each,
    and every request that was not cancelled is admitted in the end."""
    async def go():
        rng = random.Random(7)
        clock = Clock()
        gate = checked(Gate(3, make_policy(policy, 0.5), clock=clock))
        live, done = [], 0
        for _ in range(400):
            clock.now += rng.random() * 0.2
            op = rng.random()
            if op < 0.45:
                live.append(await arrive(gate, rng.choice([None, 1, 2, 3, 4, 5, 6])))
            elif op < 0.8 and any(t.done() for t in live):
                task = rng.choice([t for t in live if t.done()])
                live.remove(task)
                gate.finish(task.result())
                done += 1
            elif op < 0.88 and live:
                task = rng.choice(live)
                live.remove(task)
                if task.done():
                    gate.finish(task.result())
                else:
                    task.cancel()
                await settle()
            elif op < 0.94 and len(gate.pinned) < 2:
                pin = asyncio.ensure_future(gate.reserve(rng.choice([1, 2, 3, 4, 5, 6])))
                await settle()
                if not pin.done():
                    pin.cancel()
                    await settle()
            elif gate.pinned:
                gate.unreserve(rng.choice(sorted(gate.pinned)))
            await settle()
            assert gate.used <= gate.places
        # Drain: end everything admitted until the line is empty.
        while live:
            clock.now += 1.0
            ready = [t for t in live if t.done()]
            assert ready, "requests wait while nothing runs"
            for task in ready:
                live.remove(task)
                gate.finish(task.result())
            await settle()
        assert not gate.queue and not gate.running and not gate.tickets
        return done
    assert run(go()) > 50


def test_a_cancelled_waiter_leaves_the_line_and_a_granted_place_moves_on():
    async def go():
        gate = checked(Gate(1, FirstCome()))
        a = await arrive(gate, 1)
        b = await arrive(gate, 2)
        c = await arrive(gate, 3)
        b.cancel()
        await settle()
        assert [t.key for t in gate.queue] == [3]
        # Granted, then cancelled before it resumed: the place goes on to the next at once.
        d = await arrive(gate, 4)
        gate.finish(a.result())          # grants c
        c.cancel()
        await settle()
        assert d.done() and gate.running == {4: 1}
    run(go())


def test_first_come_keeps_arrival_order_even_for_a_running_adapter():
    async def go():
        gate = checked(Gate(1, FirstCome()))
        a1 = await arrive(gate, 1)
        b = await arrive(gate, 2)
        a2 = await arrive(gate, 1)      # adapter 1 runs, but b came first
        assert not a2.done()
        gate.finish(a1.result())
        await settle()
        assert b.done() and not a2.done()
    run(go())


def test_batching_joins_a_running_adapter_until_another_waited_too_long():
    async def go():
        clock = Clock()
        gate = checked(Gate(1, AdapterBatching(max_wait_s=1.0), clock=clock))
        hot = [await arrive(gate, 1)]
        cold = await arrive(gate, 2)
        clock.now = 0.5
        hot.append(await arrive(gate, 1))       # joins: the cold one has not waited long
        assert hot[-1].done() and not cold.done()
        clock.now = 1.5
        late = await arrive(gate, 1)            # the cold one starves: adapter 1 hands over
        assert not late.done()
        for task in hot:
            gate.finish(task.result())
        await settle()
        assert cold.done() and not late.done()  # the place went to the starving adapter
        assert cold.result().wait_s == pytest.approx(1.5)
    run(go())


def test_adaptive_bounds_the_wait_by_the_measured_drain_never_above_max_wait():
    """Before a hand-over was measured, 'adaptive' is 'batching'; after one, a waiter starves
    once it has waited as long as that drain took, and never later than max_wait_s."""
    async def go():
        clock = Clock()
        policy = AdaptiveBatching(max_wait_s=1.0)
        gate = checked(Gate(1, policy, clock=clock))
        hot = await arrive(gate, 1)
        cold = await arrive(gate, 2)
        clock.now = 0.9
        joined = await arrive(gate, 1)
        assert joined.done() and policy.bound() == 1.0      # nothing measured: the fixed bound
        clock.now = 1.2                                     # starved at 1.0; the place frees at 1.2
        gate.finish(hot.result())
        gate.finish(joined.result())
        await settle()
        assert cold.done() and policy.drain_s == pytest.approx(0.2) and policy.bound() == pytest.approx(0.2)

        late = await arrive(gate, 3)                        # adapter 2 holds the place now
        clock.now = 1.2 + 0.3                               # 0.3 s: past the measured drain
        refused = await arrive(gate, 2)
        assert not refused.done() and not late.done()       # adapter 2 hands over, as batching would not yet
        gate.finish(cold.result())
        await settle()
        assert late.done()                                  # starved at 1.4, placed at 1.5: a 0.1 s drain
        assert policy.drain_s == pytest.approx(0.2 + 0.2 * (0.1 - 0.2))

        policy.drain_s = 30.0                               # a long drain: the fixed bound is in charge
        assert policy.bound() == 1.0
    run(go())


def test_batching_gives_a_free_place_to_the_biggest_batch_and_admits_it_whole():
    async def go():
        clock = Clock()
        gate = checked(Gate(1, AdapterBatching(max_wait_s=10.0), clock=clock))
        running = await arrive(gate, 9)
        first = await arrive(gate, 1)           # came first, alone
        clock.now = 0.1
        many = [await arrive(gate, 2) for _ in range(3)]
        gate.finish(running.result())
        await settle()
        assert all(t.done() for t in many) and not first.done()
        assert gate.running == {2: 3}
    run(go())


def test_a_device_pin_waits_for_a_place_and_goes_before_queued_requests():
    async def go():
        gate = checked(Gate(2, AdapterBatching(max_wait_s=10.0)))
        a = await arrive(gate, 1)
        b = await arrive(gate, 2)
        pin = asyncio.ensure_future(gate.reserve(3))
        await settle()
        c = await arrive(gate, 4)
        more_a = await arrive(gate, 1)          # a's adapter stops taking requests: a pin waits
        assert not pin.done() and not c.done() and not more_a.done()
        gate.finish(a.result())
        await settle()
        assert pin.done() and gate.pinned == {3} and not c.done()
        # A pinned adapter's requests go straight in; a request of an adapter pinned while it
        # ran keeps its place as the pin's.
        assert (await arrive(gate, 3)).done()
        await gate.reserve(2)
        assert gate.used == 2 and gate.free == 0
        gate.unreserve(2)
        gate.finish(b.result())
        await settle()
        assert c.done() or more_a.done()
    run(go())


@pytest.mark.parametrize("order", ["cancel-then-free", "free-then-cancel"])
def test_a_cancelled_device_pin_gives_its_place_back(order):
    """Ctrl-C on ``pin --to device`` while the only place is busy, in the same loop turn as the
    request holding it ends (either order): the pin never keeps the place, and the next request
    for an unpinned adapter goes in. Before the fix: ``pinned={2}``, ``free=0`` for good, and
    the cancel handler failed with ``list.remove(x): x not in list``."""
    async def go():
        gate = checked(Gate(1, FirstCome()))
        a = await arrive(gate, 1)
        pin = asyncio.ensure_future(gate.reserve(2))
        await settle()
        assert not pin.done()
        if order == "cancel-then-free":
            pin.cancel()
            gate.finish(a.result())
        else:
            gate.finish(a.result())     # grants the pin ...
            pin.cancel()                # ... whose caller goes away before it resumes
        await settle()
        assert pin.cancelled()
        assert gate.pinned == set() and gate.free == 1 and not gate.pins_waiting
        later = await arrive(gate, 3)
        assert later.done() and gate.running == {3: 1}
    run(go())


def test_a_queued_request_of_an_adapter_pinned_meanwhile_goes_in_while_another_pin_waits():
    """Adapter 3's request waits for a full gate; 3 is then pinned (granted the first free
    place) while a pin of 4 still waits. The pinned adapter's request takes no place, so it goes
    in at once (before the fix it waited for the other pin, i.e. for the running adapters to
    drain: 'a request for a device-pinned adapter never waits')."""
    async def go():
        gate = checked(Gate(2, AdapterBatching(max_wait_s=10.0)))
        a, b = await arrive(gate, 1), await arrive(gate, 2)
        queued = await arrive(gate, 3)
        pin3 = asyncio.ensure_future(gate.reserve(3))
        await settle()
        pin4 = asyncio.ensure_future(gate.reserve(4))
        await settle()
        gate.finish(a.result())
        await settle()
        assert pin3.done() and not pin4.done() and gate.pinned == {3}
        assert queued.done() and gate.running == {2: 1, 3: 1} and gate.used == 2
        gate.finish(b.result())
        await settle()
        assert pin4.done() and gate.pinned == {3, 4}
    run(go())


def test_the_gate_refuses_nonsense():
    with pytest.raises(ValueError, match="at least one place"):
        Gate(0, FirstCome())
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_policy("lifo")


def test_the_gate_measures_hand_overs_and_service_and_shows_each_adapters_oldest_wait():
    """A turn's first request that waited: grant to first token is a hand-over; a request with a
    first token: grant to end is its service. ``adapter_queues`` lists the longest-waiting
    adapter first, with its oldest request's wait."""
    async def go():
        clock = Clock()
        gate = checked(Gate(1, make_policy("measured", 1.0), clock=clock))
        first = await arrive(gate, 1)
        gate.first_token(first.result())                 # no wait, no hand-over: not a sample
        second = await arrive(gate, 2)
        clock.now = 0.4
        third = await arrive(gate, 3)
        clock.now = 1.0
        assert [(q.label, q.running, q.queued, q.oldest_wait_s) for q in gate.adapter_queues()] == [
            ("a2", 0, 1, 1.0), ("a3", 0, 1, pytest.approx(0.6)), ("a1", 1, 0, 0.0)]
        gate.finish(first.result())
        assert gate.measured.service_s == 1.0 and gate.measured.handover_s is None
        await settle()
        assert second.done() and second.result().opened_turn
        clock.now = 1.05
        gate.first_token(second.result())
        gate.first_token(second.result())                # once only
        assert gate.measured.handover_s == pytest.approx(0.05) and gate.measured.handovers == 1
        assert gate.drain_s(2, clock.now) == pytest.approx(0.95)   # 1.0 of service, 0.05 run
        assert gate.drain_s(3, clock.now) == 0.0         # nothing in the engine
        gate.finish(second.result())
        await settle()
        gate.finish(third.result())
    run(go())


def test_measured_waits_as_long_as_a_hand_over_costs_and_breaks_closing_ties_by_the_drain():
    """Before anything is measured, 'measured' is 'batching' (the max_wait_s bound). Once a
    hand-over cost H was measured, a waiter starves after H. The adapter that closes has the
    fewest requests in the engine, as in batching; between equals, the one whose requests end
    first by the measured service time (batching: the oldest turn)."""
    async def go():
        clock = Clock()
        policy = make_policy("measured", 1.0)
        gate = checked(Gate(2, policy, clock=clock))
        batching = checked(Gate(2, make_policy("batching", 1.0), clock=clock))
        assert policy.bound() == 1.0
        gate.measured.note("handover_s", 0.05)
        gate.measured.note("service_s", 1.0)
        assert policy.bound() == 0.05
        for g in (gate, batching):
            first = await arrive(g, 1)                  # adapter 1's turn begins at 0
            clock.now = 0.1
            await arrive(g, 2)                          # adapter 2's at 0.1
            clock.now = 0.55
            await arrive(g, 1)                          # adapter 1 takes a new request...
            g.finish(first.result())                    # ...and its first one ends: one each
            clock.now = 0.0
        clock.now = 0.7
        assert policy.closing(gate, clock.now) == 2     # 0.4 s left against 0.85 s
        assert batching.policy.closing(batching, clock.now) == 1   # the oldest turn
        waiter = await arrive(gate, 3)
        clock.now = 0.76                                # waited 0.06 > H: adapter 2 closes
        assert (await arrive(gate, 1)).done() and not (await arrive(gate, 2)).done() and not waiter.done()
    run(go())


def test_measured_closes_one_adapter_per_starving_adapter_keeping_the_busiest_open():
    """Three places held by adapters with 3, 2 and 1 requests; two other adapters starve. Under
    'measured' both quieter adapters stop taking requests at once (two drains in parallel,
    each waiter waits about one); the busiest keeps taking them. Under 'batching' only the
    quietest closes (the second waiter waits a drain more)."""
    async def go():
        clock = Clock()
        gates = {name: checked(Gate(3, make_policy(name, 0.1), clock=clock)) for name in ("measured", "batching")}
        for gate in gates.values():
            for key, count in ((1, 3), (2, 2), (3, 1)):
                for _ in range(count):
                    await arrive(gate, key)
            await arrive(gate, 4)
            await arrive(gate, 5)
        clock.now = 0.2                                   # both waiters past the bound (0.1)
        joined = {name: [(await arrive(gate, key)).done() for key in (1, 2, 3)] for name, gate in gates.items()}
        assert joined == {"measured": [True, False, False], "batching": [True, True, False]}
        assert gates["measured"].policy.closing_set(gates["measured"], clock.now, 5) == [3, 2]   # never the last
    run(go())


def test_passthrough_admits_every_adapter_at_once_while_nothing_is_pinned():
    """Issue 58: vLLM's scheduler keeps each step within max_loras, so passthrough lets more
    adapters into the engine than there are places; it still counts and times each request."""
    async def go():
        gate = Gate(2, make_policy("passthrough"), clock=Clock())
        tasks = [await arrive(gate, key) for key in (1, 2, 3, 4, 1)]
        assert all(t.done() for t in tasks) and not gate.queue
        assert gate.running == {1: 2, 2: 1, 3: 1, 4: 1} and gate.used == 4 > gate.places
        assert gate.mode() == ("passthrough", "vLLM's scheduler keeps each step within max_loras")
        assert all(t.result().wait_s == 0 for t in tasks)
    run(go())


def test_a_device_pin_makes_passthrough_hold_until_the_adapters_drain_to_a_free_place():
    """A pin under passthrough waits until the adapters let in drain below the places (vLLM
    admits max_loras adapters per step whatever is pinned); meanwhile new adapters wait and the
    invariant holds from the pin on; the last unpin lets the held requests in, in order."""
    async def go():
        gate = Gate(2, make_policy("passthrough", 10.0))
        a, b, c = [await arrive(gate, key) for key in (1, 2, 3)]
        pin = asyncio.ensure_future(gate.reserve(1))   # running, but 3 adapters hold 2 places
        await settle()
        assert not pin.done() and gate.mode()[0] == "holding"
        assert gate.mode()[1] == "a device pin waiting for a place: vLLM alone would evict it mid-step"
        d = await arrive(gate, 4)
        assert not d.done()                             # held: a pin waits
        gate.finish(b.result())
        await settle()
        assert pin.done() and gate.pinned == {1} and gate.used == 2   # 1 (now a pin) and 3
        assert gate.mode() == ("holding", "1 device pin: vLLM alone would evict it mid-step")
        gate.finish(c.result())
        await settle()
        assert d.done() and gate.used == 2              # 4 took the place 3 left: held as batching
        e = await arrive(gate, 5)
        assert not e.done()
        gate.unreserve(1)
        await settle()
        assert e.done() and gate.mode()[0] == "passthrough"
        gate.finish(a.result())
    run(go())


def test_a_pin_of_an_idle_adapter_under_passthrough_waits_for_a_free_place():
    async def go():
        gate = Gate(1, make_policy("passthrough"))
        a, b = await arrive(gate, 1), await arrive(gate, 2)
        pin = asyncio.ensure_future(gate.reserve(9))
        await settle()
        gate.finish(a.result())
        await settle()
        assert not pin.done()                           # 2 still holds the only place
        gate.finish(b.result())
        await settle()
        assert pin.done() and gate.pinned == {9} and gate.free == 0
        later = await arrive(gate, 3)
        assert not later.done()                         # no place left: the pin holds the gate
    run(go())


def test_a_policy_changed_while_serving_holds_new_adapters_until_the_active_ones_drain():
    """``loractl admission measured`` after passthrough let 3 adapters into 2 places: the ones
    running stay; a new adapter waits until they drain below the places; back to passthrough,
    what waits goes in at once."""
    async def go():
        gate = Gate(2, make_policy("passthrough"))
        a, b, c = [await arrive(gate, key) for key in (1, 2, 3)]
        gate.set_policy(make_policy("measured", 0.1))
        assert gate.mode() == ("holding", "policy measured: at most 2 adapters in the engine, pins included")
        d = await arrive(gate, 4)
        gate.finish(a.result())
        await settle()
        assert not d.done()                             # 2 and 3 still fill both places
        gate.finish(b.result())
        await settle()
        assert d.done() and gate.used == 2
        e = await arrive(gate, 5)
        assert not e.done()
        gate.set_policy(make_policy("passthrough"))
        await settle()
        assert e.done() and not gate.queue
    run(go())


def test_auto_passes_where_mixing_is_free_whatever_the_price_and_a_pin_still_holds():
    """``auto`` off loractl's CPU ops is passthrough (the exchange sweep: holding never paid);
    the measured price is shown, not acted on; a device pin makes it hold as the gate requires."""
    async def go():
        context = PolicyContext()
        gate = Gate(2, make_policy("auto", 10.0, context))
        a, b, c = [await arrive(gate, key) for key in (1, 2, 3)]
        assert a.done() and b.done() and c.done()
        assert gate.mode() == ("passthrough", "auto: mixing adapters in a step costs nothing extra here; an "
                                              "exchange costs not measured yet")
        context.price = lambda: 9.5
        d = await arrive(gate, 4)
        assert d.done() and gate.mode()[1].endswith("an exchange costs 9.50 steps")
        pin = asyncio.ensure_future(gate.reserve(1))
        await settle()
        assert not pin.done() and gate.mode()[0] == "holding"
        for t in (b, c, d):
            gate.finish(t.result())
        await settle()
        assert pin.done() and gate.pinned == {1}
    run(go())


def test_auto_holds_for_good_where_a_mixed_step_costs_more():
    async def go():
        gate = checked(Gate(1, make_policy("auto", 10.0, PolicyContext(mixing_costly=True, price=lambda: 0.01))))
        a, b = await arrive(gate, 1), await arrive(gate, 2)
        assert a.done() and not b.done()
        assert gate.mode() == ("holding", "auto: loractl's CPU LoRA ops make a mixed step cost more than one of "
                                          "one adapter")
    run(go())


def test_the_exchange_price_is_copy_and_load_time_per_copy_over_a_steps_own_time():
    price = ExchangePrice()
    clocks = {"steps": 0, "step_s": 0.0, "exchanges": 0, "exchange_s": 0.0, "loads": 0, "load_s": 0.0, "in_step_s": 0.0}
    price.observe(clocks)
    assert price.price is None
    # 10 steps of 1.2 s, of which 0.2 s per step was 4 copies (0.1 s each) and 2 loads (0.3 s each)
    later = {"steps": 10, "step_s": 12.0, "exchanges": 4, "exchange_s": 0.4, "loads": 2, "load_s": 0.6, "in_step_s": 1.0}
    price.observe(later)
    assert price.price == pytest.approx((0.4 + 0.6) / 4 / ((12.0 - 1.0) / 10))
    assert price.step_s == pytest.approx(1.1)
    price.observe({**later, "steps": 12, "step_s": 14.0})   # no copy since: no new window
    assert price.windows == 1
    price.observe({k: 0 for k in later})                    # a restarted engine: its clocks start over
    assert price.windows == 1 and price._base == {k: 0 for k in later}


def test_the_clis_policy_list_is_the_daemons():
    from loractl.cli.status import ADMISSION_POLICIES
    from loractld.serving.admission import POLICIES

    assert ADMISSION_POLICIES == POLICIES
