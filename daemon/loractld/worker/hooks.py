"""Named extension points: places in the daemon and its worker where an installed hook may act.

Production code marks a point and knows nothing of who, if anyone, listens:

    hooks.reached("engine-add")                         # a step is done (sync)
    await hooks.reached_async("pin-claimed")            # likewise, on the event loop
    hooks.reached("worker-loaded", lora_request, lora)  # with what the point has in hand
    Worker.execute_model = hooks.wrap("worker-step", Worker.execute_model)

With no hook installed (always, in a daemon as shipped) ``reached`` is one test of a module
global, ``reached_async`` that and an await, and ``wrap`` gives the function back unchanged, so
nothing is wrapped and a step pays nothing.

Installing a hook: a module registered under the entry-point group ``loractld.hooks`` (one at
most), found once, when this module is first imported, in each process that imports it (the
daemon, and vLLM's engine process when it is a child). The module provides
``reached(point, *subjects)``, ``async reached_async(point, *subjects)`` and
``wrap(point, fn) -> fn``; it may hold the calling thread or coroutine there, kill the
process, raise (as the step itself could have), or change the subjects in place. loractl
registers no such module: the test suite's does (tests/hooks_plugin), which is how the crash,
race and fault tests reach into a running daemon without production code reading a test's
setting. This module lives at the worker floor so that every floor may import it.

Points (the subjects in brackets):

    resolved            a generation resolved its adapter (and took its lease), before it runs
    preflighted         a generation's adapter passed the engine's preflight, before admission
    pin-claimed         a pin checked the caps and claimed its place, before it asks the engine
    engine-add          vLLM added the adapter (disk -> host -> device), before the reply
    engine-deactivate   the adapter left its device slot (load --to host, evict --from device)
    engine-pin          the worker pinned the adapter; state.json does not record it yet
    engine-remove       vLLM dropped the adapter (evict --from host, rm)
    store-installed     a pull's object is renamed into .objects/; the name's link is not swapped
    store-unlink        rm unlinked the name; the adapter's folder and any pin are still there
    merge-step          a merge, in its thread, is about to read a source or merge a module (or,
                        the last time, to write its files): its caller may have left
    write:NAME          a JSON file NAME (e.g. state.json) is written beside it, not yet renamed
    worker-loaded       (lora_request, lora) the worker loaded an adapter inside a step; a raise
                        here is journaled as that adapter's load failure
    worker-activated    (lora_id) the worker copied an adapter into its device slot in a step; a
                        raise here is journaled likewise

Wrapped functions: ``worker-step`` (the worker's ``execute_model``) and ``worker-call:NAME``
(each of loractl's worker methods, NAME its name).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Callable

GROUP = "loractld.hooks"


def _installed() -> Any:
    found = sorted(entry_points(group=GROUP), key=lambda e: e.name)
    if len(found) > 1:
        raise RuntimeError(f"more than one {GROUP} hook installed: {[e.value for e in found]}")
    return found[0].load() if found else None


_hook = _installed()


def reached(point: str, *subjects: Any) -> None:
    """Mark ``point`` (see the module's list); the installed hook, if any, acts here."""
    if _hook is not None:
        _hook.reached(point, *subjects)


async def reached_async(point: str, *subjects: Any) -> None:
    """:func:`reached`, on the event loop: a hook holds the coroutine here, never the loop."""
    if _hook is not None:
        await _hook.reached_async(point, *subjects)


def wrap(point: str, fn: Callable) -> Callable:
    """``fn``, or the installed hook's wrapper of it (which calls it)."""
    return fn if _hook is None else _hook.wrap(point, fn)


def report() -> Any:
    """What the installed hook reports of this process (its ``report()``), or None: read from
    the engine's process through the worker method ``loractl_hook_report``."""
    return getattr(_hook, "report", lambda: None)() if _hook is not None else None
