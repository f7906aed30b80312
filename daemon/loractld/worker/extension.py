"""loractl's methods on vLLM's worker, reached by name through ``collective_rpc``.

vLLM keeps the two upper tiers itself — ``_registered_adapters`` (host LRU, ``max_cpu_loras``)
and ``_active_adapters`` (device slots, ``max_loras``) in ``LRUCacheLoRAModelManager`` — but
its public API reports only the host tier and cannot move an adapter off the device while
keeping it in host RAM, nor unpin. These methods read and steer the manager directly. They
are mixed into vLLM's worker by its ``worker_extension_cls`` engine argument
(:class:`WorkerMethods`), so the engine calls them by name and no pickled callable ever crosses the
process boundary (no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

Invariant: every method runs in the engine-core loop between steps (that is how vLLM serves
utility calls), so it never races a forward pass.

The change journal: every entry point through which vLLM's worker changes the two tiers
(each step's ``set_active_adapters``, ``add_adapter``, ``remove_adapter``, ``pin_adapter``,
and loractl's own methods here) is wrapped (by the ``vllm.general_plugins`` entry point,
``vllm_plugin``; every vLLM name wrapped or read here is listed in ``vllm_seam``) to append
what changed — a numbered ``(seq, tier, "in"|"out", id)`` record — to a bounded journal kept on the manager. A step can
load and evict adapters that no two reads of the state would catch (load then evict between
them), so the daemon reads the journal, not a diff of snapshots, and can read as seldom as it
likes (see ``tiers``): every change is still reported, in order. Comparing two sets of a few
ids costs about a microsecond per step.

Loads that cannot end the engine: ``_load_adapter``, which vLLM calls inside a step, is
wrapped (``_guarded_load``) so that a failure is journaled to a file and a harmless dummy
stands in; so is ``activate_adapter``, the copy into a device slot (``_guarded_activate``); ``loractl_preflight`` runs the unwrapped loader, whose exception is its answer.
It runs on a thread of its own (``loractl_preflight_start`` / ``_poll``), so no step waits for
it: the one exception to "between steps" above, safe because it changes nothing shared.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import time
from typing import Any

from loractld.worker import exchange_clock, hooks, kv_scrub, vllm_seam

JOURNAL_LIMIT = 4096  # records; a reader further behind than this falls back to a diff
# The file the worker appends a JSON line {"id", "error"} to for each adapter it failed to load
# in a step (see _guarded_load); the engine's client reads it (loractld.engine.client).
BROKEN_JOURNAL = "LORACTL_BROKEN_JOURNAL"
PREFLIGHT_LIMIT = 64  # preflight answers not yet collected (loractl_preflight_start)


def _manager(worker: Any):
    runner = getattr(worker, "model_runner", None)
    lora = getattr(runner, "lora_manager", None)
    return getattr(lora, "_adapter_manager", None)


def _record(mgr: Any) -> None:
    """Append to ``mgr``'s journal what changed in either tier since the last record."""
    host, device = set(mgr._registered_adapters.order), set(mgr._active_adapters.order)
    seen_host, seen_device = mgr.__dict__.get("_loractl_seen", (set(), set()))
    if host == seen_host and device == seen_device:
        return
    journal = mgr.__dict__.setdefault("_loractl_journal", collections.deque(maxlen=JOURNAL_LIMIT))
    seq = mgr.__dict__.get("_loractl_seq", 0)
    # Leaving before arriving: an eviction is what makes room for a load.
    for tier, direction, ids in (("device", "out", seen_device - device), ("host", "out", seen_host - host),
                                 ("host", "in", host - seen_host), ("device", "in", device - seen_device)):
        for lora_id in sorted(ids):
            seq += 1
            journal.append((seq, tier, direction, int(lora_id)))
    mgr._loractl_seq = seq
    mgr._loractl_seen = (host, device)


def _journaled(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            mgr = getattr(self, "_adapter_manager", None)
            if mgr is not None and hasattr(mgr, "_registered_adapters"):
                _record(mgr)

    wrapper._loractl_journaled = True  # type: ignore[attr-defined]
    return wrapper


def loractl_lora_state(self, since: int = -1) -> dict[str, Any]:
    """The true tier state: host and device ids in LRU order (oldest first), slots, pins;
    plus the journal's records after ``since`` (none when ``since`` < 0)."""
    mgr = _manager(self)
    if mgr is None:
        return {"enabled": False}
    _record(mgr)
    host, device = mgr._registered_adapters, mgr._active_adapters
    journal = mgr.__dict__.get("_loractl_journal", ())
    seq = mgr.__dict__.get("_loractl_seq", 0)
    oldest = journal[0][0] if journal else seq + 1
    sizes = mgr.__dict__.setdefault("_loractl_bytes", {})  # an id's weights never change size
    for lora_id in host.order:
        if lora_id not in sizes:
            sizes[lora_id] = _lora_bytes(host.cache[lora_id])
    return {
        "enabled": True,
        "host": list(host.order),
        "device": list(device.order),
        "slots": list(mgr.lora_index_to_id),
        "pinned_host": sorted(host.pinned_items),
        "pinned_device": sorted(device.pinned_items),
        "host_capacity": int(mgr.capacity),
        "device_capacity": int(mgr.lora_slots),
        "host_bytes": {int(i): sizes[i] for i in host.order},
        "seq": seq,
        "changes": [list(r) for r in journal if r[0] > since] if since >= 0 else [],
        "journal_complete": since < 0 or since + 1 >= oldest,
        "costs": exchange_clock.snapshot(),
    }


def _lora_bytes(lora_model: Any) -> int:
    total = 0
    for layer in getattr(lora_model, "loras", {}).values():
        for name in ("lora_a", "lora_b"):
            tensor = getattr(layer, name, None)
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            for t in tensors:
                if t is not None and hasattr(t, "element_size"):
                    total += t.element_size() * t.nelement()
    return total


def loractl_deactivate(self, lora_id: int) -> bool:
    """Move an adapter off the device, keeping its host copy. False if it was not on device."""
    mgr = _manager(self)
    if mgr is None:
        return False
    done = bool(mgr.deactivate_adapter(lora_id))
    _record(mgr)
    return done


def loractl_pin_host(self, lora_id: int) -> bool:
    """Pin an adapter in host RAM only; False if it is not loaded there. It stays one copy
    away from a slot, and never takes one from a step."""
    mgr = _manager(self)
    if mgr is None or lora_id not in mgr._registered_adapters:
        return False
    mgr._registered_adapters.pin(lora_id)
    return True


def loractl_pin_device(self, lora_id: int) -> bool:
    """Pin an adapter in host RAM and in a device slot (vLLM's own pin); False if it is not
    loaded.

    Safe only behind the daemon's admission gate (loractld.serving.admission): vLLM's scheduler takes
    up to max_loras distinct adapters into a step whatever is pinned, so with a slot held by
    a pin, a step of max_loras other adapters evicts one of its own adapters mid-step and the
    engine dies (KeyError in punica's convert_mapping). The gate never lets the engine hold
    requests for more adapters than the slots the pins leave free.
    """
    mgr = _manager(self)
    if mgr is None or lora_id not in mgr._registered_adapters:
        return False
    mgr.pin_adapter(lora_id)
    _record(mgr)
    return True


def loractl_unpin(self, lora_id: int, keep_host: bool = False) -> bool:
    """Unpin an adapter in both tiers (vLLM has pin_lora but no unpin), or (``keep_host``) in
    the device tier only: one call, so no step can evict it from host RAM between an unpin and
    a new host pin."""
    mgr = _manager(self)
    if mgr is None:
        return False
    changed = False
    caches = (mgr._active_adapters,) if keep_host else (mgr._registered_adapters, mgr._active_adapters)
    for cache in caches:
        if lora_id in cache.pinned_items:
            cache._unpin(lora_id)
            changed = True
    return changed


def loractl_preflight(self, request_kwargs: dict) -> str | None:
    """Load an adapter exactly as a step would, for this engine's model and LoRA config, and
    discard it: None if it would load and fit, else the loader's reason in one line.

    It runs the worker manager's own ``_load_adapter`` (vLLM's PEFTHelper checks against
    ``max_lora_rank``, the model's expected modules and weights mapper, the vocabulary), then
    packs it as ``add_adapter`` does and checks every layer against the device buffers it would
    be copied into. Nothing is registered or activated: the tiers are untouched, and whatever
    it raises ends here, never in a step.
    """
    worker_manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
    mgr = _manager(self)
    if worker_manager is None or mgr is None:
        return None
    from vllm.lora.request import LoRARequest

    load = getattr(type(worker_manager)._load_adapter, "_loractl_unguarded", type(worker_manager)._load_adapter)
    try:
        lora = load(worker_manager, LoRARequest(**request_kwargs))
        mgr._create_merged_loras_inplace(lora)
        _check_fits(mgr, lora)
    except Exception as e:  # the answer, not a failure: the adapter is what failed
        return _one_line(e)
    return None


def loractl_preflight_start(self, token: str, request_kwargs: dict) -> bool:
    """Start ``loractl_preflight`` on the worker's preflight thread and return at once.

    Called between steps like every utility call; an inline preflight there held the next
    step for the whole load (disk read, dtype cast, ``pin_memory``, packing: 58 ms for a 78 MB
    adapter), stalling every stream. On its own thread the load overlaps the steps: it only
    reads the manager's configuration and the module buffers' shapes, and builds a LoRA model
    nobody else sees. The answer is collected with ``loractl_preflight_poll(token)``.
    Invariant: at most ``PREFLIGHT_LIMIT`` answers wait to be collected (the daemon polls
    each until done; an abandoned one is dropped oldest first)."""
    runs = self.__dict__.setdefault("_loractl_preflights", collections.OrderedDict())
    pool = self.__dict__.get("_loractl_preflight_pool")
    if pool is None:
        import concurrent.futures

        pool = self._loractl_preflight_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="loractl-preflight", initializer=_preflight_thread, initargs=(self,))
    while len(runs) >= PREFLIGHT_LIMIT:
        runs.popitem(last=False)
    runs[token] = pool.submit(loractl_preflight, self, request_kwargs)
    return True


def loractl_preflight_poll(self, token: str) -> dict[str, Any]:
    """``{"done": False}`` while the preflight ``token`` runs, then ``{"done": True, "reason":
    None or the loader's reason}`` once (the answer is forgotten); an unknown token is done with
    a reason."""
    runs = self.__dict__.get("_loractl_preflights", {})
    future = runs.get(token)
    if future is None:
        return {"done": True, "reason": "RuntimeError: the preflight was lost (too many at once)"}
    if not future.done():
        return {"done": False}
    del runs[token]
    try:
        return {"done": True, "reason": future.result()}
    except Exception as e:  # noqa: BLE001 - loractl_preflight answers its own errors; this is a last line
        return {"done": True, "reason": _one_line(e)}


def _preflight_thread(worker: Any) -> None:
    """Set up the preflight thread. On a GPU: the worker's device (a new thread starts on
    device 0). On the CPU: off the cores the step's OpenMP threads are bound to (a new thread
    inherits the engine thread's binding, and shared a core with the step: a 2 s stall was
    measured so), and one OpenMP thread (a team of its own would spin on the step's cores)."""
    device = getattr(worker, "device", None)
    import torch

    if getattr(device, "type", None) == "cuda":
        torch.cuda.set_device(device)
        return
    torch.set_num_threads(1)  # this thread's OpenMP setting; the engine thread's is already made
    try:
        bound = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - bound
        if others:
            os.sched_setaffinity(0, others)  # 0: this thread
    except OSError:
        pass  # a container that forbids it: the thread shares the step's cores


def _check_fits(mgr: Any, lora: Any) -> None:
    """Raise if a layer of ``lora`` does not match the buffers ``activate_adapter`` copies it
    into. vLLM copies into a slice sized by the adapter, so a smaller layer (an adapter for a
    smaller model) would be served silently wrong and a larger one fails inside a step."""
    for module_name, module in mgr.modules.items():
        weights = mgr._get_lora_layer_weights(lora, module_name)
        stacked_a, stacked_b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if weights is None or not isinstance(stacked_a, (tuple, list)) or getattr(module, "tp_size", 1) != 1:
            continue
        lora_a = weights.lora_a if isinstance(weights.lora_a, (list, tuple)) else [weights.lora_a]
        lora_b = weights.lora_b if isinstance(weights.lora_b, (list, tuple)) else [weights.lora_b]
        for a, b, buffer_a, buffer_b in zip(lora_a, lora_b, stacked_a, stacked_b):
            if a is None or b is None or buffer_a.dim() != 4 or buffer_b.dim() != 4:
                continue
            rank, fan_in, fan_out, max_rank = a.shape[0], buffer_a.shape[-1], buffer_b.shape[-2], buffer_a.shape[-2]
            if a.shape[1] != fan_in or b.shape[0] != fan_out or b.shape[1] != rank or rank > max_rank:
                raise ValueError(f"module {module_name!r}: the adapter's layer is {b.shape[0]}x{a.shape[1]} at rank "
                                 f"{rank}, the model's is {fan_out}x{fan_in} (max rank {max_rank})")


def _guarded_load(load):
    """``_load_adapter`` that cannot end the engine: vLLM calls it inside a step, where an
    exception kills the engine core for every client. A failure is journaled (the adapter
    id and the reason) and a zero dummy of vLLM's own making (its warm-up LoRA) is returned
    in its place, so the step completes; the daemon reads the journal, fails the requests
    that asked for the adapter before any of their tokens are sent, and refuses it after."""
    @functools.wraps(load)
    def wrapper(self, lora_request):
        try:
            began = time.perf_counter()
            lora = load(self, lora_request)
            exchange_clock.charge("load", time.perf_counter() - began)
            hooks.reached("worker-loaded", lora_request, lora)  # a hook may fail or alter it here
            return lora
        except Exception as e:
            _journal_broken(lora_request.lora_int_id, e)
            mgr = self._adapter_manager
            rank = mgr.get_dummy_lora_warmup_rank(1) if hasattr(mgr, "get_dummy_lora_warmup_rank") else 1
            return mgr.create_dummy_lora(lora_request.lora_int_id, rank, self.embedding_modules)

    wrapper._loractl_unguarded = load  # type: ignore[attr-defined]  (preflight wants the raise)
    return wrapper


def _guarded_activate(activate):
    """``activate_adapter`` (the copy of a host adapter into a device slot, inside a step) that
    cannot end the engine either: a failure (``set_lora`` on a layer of the wrong size, say) is
    journaled like a failed load, the slot the adapter was given is zeroed (the base model's
    output, which no client sees: the daemon fails the requests that asked for it before their
    first token), and the step completes. A failure before a slot was given is re-raised: that
    is the scheduler's invariant (the admission gate keeps it), not the adapter's fault.

    Where the slot is: vLLM 0.26 and 0.32 record it (``lora_index_to_id``, ``_active_adapters``)
    before the copy, 0.33 only after it (vllm/lora/model_manager.py, ``activate_adapter``), so a
    failed copy there leaves no record. The slot it was copying into is its first free one, found
    here before the call; after such a failure the adapter is recorded in it as 0.32 would have
    left it, so the step's mapping finds it (else the step itself raises, ending the engine)."""
    @functools.wraps(activate)
    def wrapper(self, lora_id):
        free = None if lora_id in self._active_adapters else next(
            (i for i, held in enumerate(self.lora_index_to_id) if held is None), None)
        try:
            began = time.perf_counter()
            result = activate(self, lora_id)
            if result:   # False: it was in a slot already, nothing was copied
                exchange_clock.charge("exchange", time.perf_counter() - began)
            hooks.reached("worker-activated", lora_id)  # a raise here: as a set_lora failing would
            return result
        except Exception as e:
            if lora_id in self.lora_index_to_id:   # recorded before the copy (0.32), or the raise came after it
                index = self.lora_index_to_id.index(lora_id)
            elif free is not None and self.lora_index_to_id[free] is None and lora_id in self._registered_adapters:
                index = free   # 0.33: the copy into slot ``free`` failed before vLLM recorded it
                self._active_adapters[lora_id] = None
                self.lora_index_to_id[index] = lora_id
            else:
                raise
            _journal_broken(lora_id, e)
            for module in self.modules.values():
                reset = getattr(module, "reset_lora", None)
                if reset is not None:
                    reset(index)
            return True

    wrapper._loractl_guarded = True  # type: ignore[attr-defined]
    return wrapper


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip() or type(error).__name__).splitlines()[0]}"


def _journal_broken(lora_id: int, error: Exception) -> None:
    path = os.environ.get(BROKEN_JOURNAL)
    if not path:
        return
    try:
        with open(path, "a") as f:  # one short write: a line is never seen half-written
            f.write(json.dumps({"id": int(lora_id), "error": _one_line(error)}) + "\n")
    except OSError:
        pass  # the request then runs on the dummy; it must not end the engine either


def loractl_hook_report(self) -> Any:
    """What the installed hook (``hooks``) reports from the engine's process; None without one.
    The engine runs in a child process of the daemon: this is how a hook's records get out."""
    return hooks.report()


METHODS = {f.__name__: f for f in (loractl_lora_state, loractl_deactivate, loractl_pin_host, loractl_pin_device,
                                   loractl_unpin, loractl_preflight, loractl_preflight_start, loractl_preflight_poll,
                                   loractl_hook_report)}


class WorkerMethods:
    """loractl's methods, mixed into vLLM's worker class by vLLM's public hook for this: the
    engine argument ``worker_extension_cls`` (:data:`EXTENSION_CLS`; vLLM refuses a name its
    worker already has). ``collective_rpc`` calls them by name."""


for _name, _method in METHODS.items():
    setattr(WorkerMethods, _name, hooks.wrap(f"worker-call:{_name}", _method))
EXTENSION_CLS = f"{__name__}.WorkerMethods"


def install() -> None:
    """Wrap what vLLM has no hook for. The targets are the seam's (``vllm_seam``), which the
    daemon checked against this vLLM before it started the engine. Idempotent."""
    for owner, name in vllm_seam.targets("journaled"):
        method = getattr(owner, name)
        if not getattr(method, "_loractl_journaled", False):
            setattr(owner, name, _journaled(method))
    for owner, name in vllm_seam.targets("guarded_load"):
        if not hasattr(getattr(owner, name), "_loractl_unguarded"):
            setattr(owner, name, _guarded_load(getattr(owner, name)))
    for owner, name in vllm_seam.targets("guarded_activate"):
        if not getattr(getattr(owner, name), "_loractl_guarded", False):
            setattr(owner, name, _guarded_activate(getattr(owner, name)))
    for owner, name in vllm_seam.targets("scrubbed_steps"):
        if not getattr(getattr(owner, name), "_loractl_scrubbed", False):
            step = hooks.wrap("worker-step", exchange_clock.timed_steps(kv_scrub.scrubbed_steps(getattr(owner, name))))
            step._loractl_scrubbed = True  # type: ignore[attr-defined]  (whatever wraps it: installed once)
            setattr(owner, name, step)
