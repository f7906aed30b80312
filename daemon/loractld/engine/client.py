"""The engine: vLLM's ``AsyncLLM`` with LoRA enabled, started and stopped, and its adapter tiers.

Generation does not go through this class: every door's request enters the engine through
vLLM's serving classes and ``openai_serving.AdmittedEngineClient`` (see ``vllm_requests``).
It applies the CPU fixes (see ``cpu_fixes``) when running on the CPU. Which of vLLM's internals
it reaches, and why, is listed in ``loractld.worker.vllm_seam``.

Invariants:
- ``vllm`` and ``torch`` are imported inside functions, never at module import, so the rest
  of the daemon (and anything that imports it for its types) stays cheap to import.
- Environment that vLLM reads at import or hands to its child processes is set in
  ``_prepare_environment`` before the first vllm import, and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from loractl.errors import EngineUnavailable
from loractld.engine import compat, device_defaults, engine_flags
from loractld.engine.device import kv_cache_bytes, resolve_device, settled_dtype
from loractld.engine.broken import BrokenJournal
from loractld.engine.openai_serving import ServeOptions
from loractld.worker import cpu_fixes, hooks, vllm_seam
from loractld.worker import plugin as vllm_plugin
from loractld.worker import extension as worker_ext
from loractld.engine.adapter import AdapterRef
from loractld.engine.broken import broken_adapter

_log = logging.getLogger("loractld.engine")

# Variables that belong to loractld's own process and must not leak into vLLM's children:
# systemd would otherwise accept their notifications, or they would try to reuse our sockets.
_PRIVATE_ENV = ("NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is started with; every field maps to a loractld flag."""

    model: str
    device: str = "auto"            # auto | cuda | cpu
    dtype: str = "auto"             # auto -> float32 on CPU, vLLM's choice on CUDA
    # None: chosen at start for the device (2 and 4 on the CPU; on CUDA from the memory and the
    # adapters' rank, engine.device_defaults); the started Engine's settings hold the values.
    max_loras: int | None = None    # device slots
    max_cpu_loras: int | None = None   # host cache entries
    max_lora_rank: int = 16         # the daemon passes 0 for "from the store" and resolves it before start
    # None: the model's own context length, lowered by vLLM only as far as the KV cache needs
    # (a fixed default killed the engine on a 512-token model and capped 128k models at 1k).
    max_model_len: int | None = None
    # None: vLLM's own default for a server (128 sequences per step on CPU, more on large
    # GPUs), the same as `vllm serve`. A smaller fixed cap queued requests in loractl that
    # vLLM's server would have batched: TTFT grew with every stream past it.
    max_num_seqs: int | None = None
    kv_cache_bytes: int | None = None   # required on CPU; None -> derived there (cpu_defaults)
    chat_template: str | None = None    # a Jinja template (the text) that replaces the model's own
    enable_prefix_caching: bool = True
    seed: int = 0
    # Off only to reproduce the upstream CPU bugs (tests, benchmarks); see cpu_fixes.
    cpu_fixes: bool = True
    # vLLM's OpenAI server flags (tools, reasoning, structured outputs, templates): the HTTP door's.
    openai: ServeOptions = field(default_factory=ServeOptions)
    # vLLM's own engine flags the user gave (AsyncEngineArgs field -> value; engine.engine_flags):
    # passed to the engine as they are, over loractld's choices.
    engine_args: dict[str, Any] = field(default_factory=dict)
    # --keep-alive on CUDA: vLLM's sleep mode, so that an idle engine can give the card back
    # (loractld.serving.keep_alive); the CPU has none (there a sleep stops the engine).
    sleep_mode: bool = False


# A preflight's answer is polled for after 1, 2, 4, ... ms, then every 20 ms: a small adapter's
# answer is back within a step or two, a large one's costs a few dozen utility calls.
PREFLIGHT_FIRST_POLL_S = 0.001
PREFLIGHT_MAX_POLL_S = 0.02

def _prepare_environment(device: str, apply_cpu_fixes: bool) -> None:
    for name in _PRIVATE_ENV:
        os.environ.pop(name, None)
    # One engine-core process that holds the worker, instead of core + worker processes:
    # faster start (7 s instead of 12-16 s on CPU), and one child to reap.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ[vllm_plugin.ENGINE_FLAG] = "1"  # our worker methods (worker_ext)
    # Where the worker journals an adapter it failed to load inside a step (worker_ext).
    fd, journal = tempfile.mkstemp(prefix="loractl-broken-", suffix=".jsonl")
    os.close(fd)
    os.environ[worker_ext.BROKEN_JOURNAL] = journal
    os.environ[vllm_plugin.DAEMON_PID] = str(os.getpid())  # the engine dies with us (vllm_plugin)
    if device == "cpu" and apply_cpu_fixes:
        os.environ[cpu_fixes.ENV_FLAG] = "1"
    else:
        os.environ.pop(cpu_fixes.ENV_FLAG, None)
    for name, value in compat.flashinfer_sampler_env(device, importlib.util.find_spec("flashinfer") is not None).items():
        os.environ.setdefault(name, value)


def _start_async_llm(async_llm: Any, args: Any, usage_context: Any, device: str) -> Any:
    """``AsyncLLM.from_engine_args``, with vLLM's own OpenMP placement for the worker on the CPU.

    vLLM binds its CPU worker's OpenMP threads (``OMP_NUM_THREADS`` and their cores, from
    ``VLLM_CPU_OMP_THREADS_BIND``, a core kept free for the scheduler) only when its
    multiprocessing executor starts a worker process. Our engine core holds its worker
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so without this the worker ran one spinning,
    unbound OpenMP thread per core: any other busy process on the machine stalled every
    parallel region, and tokens/s fell to a tenth of vLLM's own server beside the same
    job (docs/benchmarks.md, "CPU contention"). The engine core process is started inside
    this block and inherits the variables; they are restored here afterwards. As in vLLM's
    server, ``VLLM_CPU_OMP_THREADS_BIND`` is the knob (``nobind`` leaves OpenMP alone).
    """
    config = args.create_engine_config(usage_context)
    placement = contextlib.nullcontext()
    if device == "cpu":
        try:
            from vllm.utils.ompmultiprocessing import OMPProcessManager
        except ImportError:  # older vLLM: its CPU worker bound its own threads
            OMPProcessManager = None
        if OMPProcessManager is not None:
            placement = OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0)
    with placement:
        _log.info("engine OpenMP: %s threads on cores %s", os.environ.get("OMP_NUM_THREADS", "all"),
                  os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_PLACES") or "any")
        return async_llm.from_vllm_config(config, usage_context=usage_context,
                                          disable_log_stats=args.disable_log_stats)


CPU_MAX_LORAS, CPU_MAX_CPU_LORAS = 2, 4   # measured on the CPU (docs/benchmarks.md); CUDA's: device_defaults


def _cpu_moe_targets(settings: EngineSettings) -> list[device_defaults.Choice]:
    """On the CPU, LoRA on a mixture-of-experts base only where a CPU kernel runs it (models.moe)."""
    from loractld.models.moe import DENSE_LORA_TARGETS, folder_expert_count

    experts = folder_expert_count(settings.model)
    if not experts or "lora_target_modules" in settings.engine_args:
        return []
    choice = device_defaults.Choice(
        "lora_target_modules", DENSE_LORA_TARGETS,
        f"a mixture-of-experts base ({experts} experts a layer): on the CPU LoRA goes on the attention and dense "
        "layers only, as vLLM's fused-MoE LoRA kernels need Triton (a GPU); adapters that train experts are refused")
    _log.info("chosen for the CPU: lora_target_modules = %s (%s)", ", ".join(choice.value), choice.why)
    return [choice]


def _sized_for_cuda(settings: EngineSettings, kv_bytes: int | None) -> tuple[EngineSettings, int | None,
                                                                              list[device_defaults.Choice]]:
    """Fill what the user left out from the GPUs' free memory, the host's and the model's size
    (``device_defaults``); log each choice with its reason."""
    from loractld.models.defaults import available_memory

    given = {**settings.engine_args, "max_loras": settings.max_loras, "max_cpu_loras": settings.max_cpu_loras,
             "max_num_seqs": settings.max_num_seqs, "max_model_len": settings.max_model_len,
             "kv_cache_memory_bytes": kv_bytes}
    facts = device_defaults.model_facts(settings.model, settings.engine_args.get("kv_cache_dtype"), settings.dtype)
    choices = device_defaults.choose(given, device_defaults.gpu_memory(), available_memory(), facts,
                                     settings.max_lora_rank)
    for choice in choices:
        _log.info("chosen for this GPU: %s = %s (%s)", choice.name, choice.value, choice.why)
    chosen = {c.name: c.value for c in choices}
    settings = dataclasses.replace(settings, max_loras=settings.max_loras or chosen.get("max_loras", CPU_MAX_LORAS),
                                   max_cpu_loras=settings.max_cpu_loras or chosen.get("max_cpu_loras", CPU_MAX_CPU_LORAS))
    return settings, kv_bytes or chosen.get("kv_cache_memory_bytes"), choices


class Engine:
    """A running ``AsyncLLM`` with LoRA enabled. Create with :meth:`start`."""

    def __init__(self, llm: Any, settings: EngineSettings, device: str, dtype: str, start_seconds: float):
        self._llm = llm
        self.settings = settings
        self.device = device
        self.start_seconds = start_seconds
        self._generation_defaults: dict[str, Any] | None = None
        self._journal = BrokenJournal(os.environ.get(worker_ext.BROKEN_JOURNAL, ""))
        import vllm

        self.vllm_version = vllm.__version__
        config = llm.vllm_config
        # What vLLM settled on, which may differ from what was asked (None -> its default).
        self.max_model_len = int(config.model_config.max_model_len)
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        # On CUDA the start asks for dtype "auto" and no KV size: vLLM's choices are the facts.
        self.dtype = settled_dtype(config) or dtype
        self.kv_cache_bytes = kv_cache_bytes(config)   # what was asked, where it was (Engine.start)
        # Filled by Engine.start: what loractld chose for this device and why (device_defaults.Choice),
        # and the engine settings in effect under vLLM's names (engine_flags.settled).
        self.choices: list[device_defaults.Choice] = []
        self.engine_args: dict[str, Any] = {}

    @classmethod
    async def start(cls, settings: EngineSettings) -> Engine:
        began = time.monotonic()
        device = resolve_device(settings.device)
        compat.uncache_vllm_environment()  # this start's settings (below) must be the ones read
        _prepare_environment(device, settings.cpu_fixes)
        vllm_seam.check()  # a vLLM whose internals moved is refused here, naming what moved
        worker_ext.install()  # for a worker vLLM might run in this process
        if device == "cpu" and settings.cpu_fixes:
            cpu_fixes.install()  # likewise

        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        vllm_features = compat.features(vllm.__version__)
        _log.info("vLLM %s: prefix-cache keys include the adapter path: %s", vllm.__version__,
                  vllm_features.prefix_cache_key_has_path)

        dtype = settings.dtype
        kv_bytes = settings.kv_cache_bytes
        choices: list[device_defaults.Choice] = []
        if device == "cpu":
            # vLLM needs both on the CPU; derived from the model and the machine (cpu_defaults).
            from loractld.models import defaults as cpu_defaults

            chosen = cpu_defaults.for_model(settings.model, dtype, kv_bytes, settings.engine_args.get("quantization"))
            dtype, kv_bytes = chosen.dtype, chosen.kv_cache_bytes
            choices += _cpu_moe_targets(settings)
            settings = dataclasses.replace(settings, max_loras=settings.max_loras or CPU_MAX_LORAS,
                                           max_cpu_loras=settings.max_cpu_loras or max(CPU_MAX_CPU_LORAS,
                                                                                       settings.max_loras or 0))
        else:
            settings, kv_bytes, choices = _sized_for_cuda(settings, kv_bytes)
        if settings.max_cpu_loras < settings.max_loras:
            raise EngineUnavailable(f"max_cpu_loras ({settings.max_cpu_loras}) is below max_loras ({settings.max_loras})",
                                    f"Every adapter on the device is also cached on the host: use --max-cpu-loras "
                                    f"{settings.max_loras} or more.")
        engine_kwargs = dict(
            model=settings.model,
            dtype=dtype,
            enable_lora=True,
            max_loras=settings.max_loras,
            max_cpu_loras=settings.max_cpu_loras,
            max_lora_rank=settings.max_lora_rank,
            max_model_len=compat.max_model_len_arg(settings.max_model_len, vllm_features),
            max_num_seqs=settings.max_num_seqs,
            kv_cache_memory_bytes=kv_bytes,
            enable_prefix_caching=settings.enable_prefix_caching,
            enforce_eager=device == "cpu",
            seed=settings.seed,
            worker_extension_cls=worker_ext.EXTENSION_CLS,   # loractl's worker methods (collective_rpc)
            enable_sleep_mode=settings.sleep_mode and device == "cuda",   # --keep-alive (serving.keep_alive)
            **compat.structured_output_args(settings.openai.reasoning_parser, settings.openai.structured_outputs_config),
        )
        engine_kwargs.update({c.name: c.value for c in choices if c.name in ("gpu_memory_utilization",
                                                                             "lora_target_modules")})
        engine_kwargs.update(settings.engine_args)   # the user's vLLM flags win (engine_flags refused loractld's own)
        args = AsyncEngineArgs(**engine_kwargs)
        try:
            # Blocking for seconds; a thread keeps the daemon's loop (signals, Status) alive.
            # The server's usage context: the batch defaults users get from `vllm serve`.
            llm = await asyncio.to_thread(_start_async_llm, AsyncLLM, args, UsageContext.OPENAI_API_SERVER, device)
        except Exception as e:
            raise EngineUnavailable(
                f"the engine failed to start for model {settings.model!r}: {e}",
                "Check the model path and the flags; LORACTL_DEBUG=1 shows the traceback.",
            ) from e
        compat.cache_vllm_environment()
        engine = cls(llm, settings, device, dtype, time.monotonic() - began)
        engine.kv_cache_bytes = kv_bytes or engine.kv_cache_bytes
        engine.choices = choices
        engine.engine_args = engine_flags.settled(args, llm.vllm_config, settings.engine_args)
        _log.info("engine up in %.1f s (vllm %s, %s, %s); context %d tokens%s, up to %d sequences a step",
                  engine.start_seconds, engine.vllm_version, device, dtype, engine.max_model_len,
                  "" if settings.max_model_len else " (the model's own, fitted to the KV cache)", engine.max_num_seqs)
        return engine

    def _lora_request(self, adapter: AdapterRef):
        from vllm.lora.request import LoRARequest

        # Keyword arguments only: LoRARequest is serialized by position, and its fields moved
        # between vLLM releases (loractld.engine.compat).
        return LoRARequest(**compat.lora_request_kwargs(LoRARequest.__struct_fields__, name=adapter.engine_name,
                                                        engine_id=adapter.engine_id, path=str(adapter.path)))

    def _engine_request_ids(self, request_id: str) -> list[str]:
        """The engine core's own ids for ``request_id`` (vLLM 0.32 gives each request an internal
        id); [] where this vLLM keeps no such map (then the external id is the engine's)."""
        mapping = getattr(getattr(self._llm, "output_processor", None), "external_req_ids", None)
        if mapping is None:
            return [request_id]
        return list(mapping.get(request_id, ()))

    async def _abort_in_engine(self, engine_ids: list[str]) -> None:
        """A stop string ends a request in the front end, before the engine core knows: vLLM's
        output handler sends the core its abort only after it has handed the final output over
        and, past 128 outputs in a step, after yielding to the loop. Until then the core may
        schedule the request (and its adapter) again, while the admission gate, told the request
        ended, has given its place to another adapter: one step could then need a slot more than
        the device pins leave. Sending the abort here, before the final output goes on, orders it
        before any request the freed place admits (a second abort of an id is ignored)."""
        try:
            await self._llm.engine_core.abort_requests_async(engine_ids)
        except Exception:  # noqa: BLE001 - the handler's own abort follows; a dead engine reports itself
            _log.debug("abort of stopped request %s failed", engine_ids, exc_info=True)

    # -- the LoRA tiers (see loractld.worker.extension for the worker side) ------------------
    async def lora_state(self, since: int = -1) -> dict:
        """What the worker really holds: host and device ids (LRU order), slots, pins, and
        the tier changes journaled after ``since`` (see worker_ext)."""
        return (await self._llm.collective_rpc("loractl_lora_state", args=(since,)))[0]

    async def preflight(self, name: str, engine_id: int, path: str) -> str | None:
        """Load the adapter at ``path`` in the worker as a step would, and drop it: None if this engine can
        serve it, else vLLM's reason in one line (see worker_ext.loractl_preflight). The load runs on
        the worker's preflight thread, beside the steps (worker_ext.loractl_preflight_start); this
        polls for its answer, each poll a utility call between two steps (microseconds)."""
        from vllm.lora.request import LoRARequest

        kwargs = compat.lora_request_kwargs(LoRARequest.__struct_fields__, name=name, engine_id=engine_id, path=path)
        token = uuid.uuid4().hex
        await self._llm.collective_rpc("loractl_preflight_start", args=(token, kwargs))
        pause = PREFLIGHT_FIRST_POLL_S
        while True:
            answer = (await self._llm.collective_rpc("loractl_preflight_poll", args=(token,)))[0]
            if answer["done"]:
                return answer["reason"]
            await asyncio.sleep(pause)
            pause = min(pause * 2, PREFLIGHT_MAX_POLL_S)

    async def add_adapter(self, adapter: AdapterRef) -> bool:
        """Load disk -> host and activate into a device slot (vLLM does both in add_lora)."""
        added = bool(await self._llm.add_lora(self._lora_request(adapter)))
        hooks.reached("engine-add")
        self._refuse_if_broken(adapter)
        return added

    def _refuse_if_broken(self, adapter: AdapterRef) -> None:
        """Raise :class:`InvalidAdapter` if the worker failed to load ``adapter`` (its stand-in
        is a zero dummy: serving it would be the base model under the adapter's name)."""
        reason = self._journal.reason(adapter.engine_id)
        if reason is not None:
            raise broken_adapter(adapter.label, reason)

    @property
    def broken(self) -> dict[int, str]:
        """Engine id -> why the worker could not load it in a step (``BrokenJournal``)."""
        return self._journal.broken

    async def pin_adapter(self, engine_id: int, *, device: bool = False) -> bool:
        """Pin in host RAM, or (``device``) in host RAM and a device slot: only behind the
        admission gate's place for it (see worker_ext.loractl_pin_device)."""
        method = "loractl_pin_device" if device else "loractl_pin_host"
        pinned = bool((await self._llm.collective_rpc(method, args=(engine_id,)))[0])
        hooks.reached("engine-pin")
        return pinned

    async def unpin_adapter(self, engine_id: int, *, keep_host: bool = False) -> bool:
        """Unpin in both tiers, or (``keep_host``) leave a device pin for a host pin."""
        if self.stopped_asleep:
            return True   # a stopped engine holds no pin (keep-alive)
        return bool((await self._llm.collective_rpc("loractl_unpin", args=(engine_id, keep_host)))[0])

    async def deactivate_adapter(self, engine_id: int) -> bool:
        """Leave the device slot, keep the host copy."""
        if self.stopped_asleep:
            return False
        left = bool((await self._llm.collective_rpc("loractl_deactivate", args=(engine_id,)))[0])
        hooks.reached("engine-deactivate")
        return left

    async def remove_adapter(self, engine_id: int) -> bool:
        """Drop an adapter from host and device; False if the engine did not hold it."""
        if self.stopped_asleep:
            return False   # a stopped engine holds nothing (keep-alive): nothing to drop
        removed = bool(await self._llm.remove_lora(engine_id))
        hooks.reached("engine-remove")
        return removed

    def generation_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults (its generation_config.json: temperature, top_p,
        top_k), which vLLM's server applies to requests that leave them out. Read once: vLLM
        reads the file on every call, and this is on the request path."""
        if self._generation_defaults is None:
            wanted = ("temperature", "top_p", "top_k")
            self._generation_defaults = {k: v for k, v in self._llm.model_config.get_diff_sampling_param().items()
                                         if k in wanted}
        return dict(self._generation_defaults)

    def prometheus_text(self) -> str:
        """vLLM's own metrics (``vllm:*``: queue, tokens, latencies, cache use), as the /metrics
        of ``vllm serve`` shows them, so dashboards made for vLLM read loractl's too."""
        from prometheus_client import REGISTRY, generate_latest

        class _Families:  # generate_latest wants something with collect()
            def collect(self):
                return [family for family in REGISTRY.collect() if family.name.startswith("vllm:")]

        return generate_latest(_Families()).decode()

    def unfinished_requests(self) -> int:
        """Requests the engine holds (waiting or running); an aborted one leaves at once."""
        return compat.unfinished_requests(self._llm) if self._llm is not None else 0

    @property
    def errored(self) -> bool:
        return bool(getattr(self._llm, "errored", False))

    def shutdown(self) -> None:
        """Stop the engine and its processes. Idempotent."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        llm.shutdown()
        self._journal.remove()
        # AsyncLLM.__del__ calls shutdown() again, and when that happens at interpreter exit
        # the module globals it needs are gone (a TypeError printed on every clean stop).
        llm.shutdown = lambda *args, **kwargs: None

    # -- keep-alive: sleep and wake (the policy is loractld.serving.keep_alive's) -------------
    asleep = False              # True from the start of a sleep to the end of its wake: nothing asks the engine
    restarted_by_sleep = False  # the last wake started a new engine (or reloaded everything): pins are gone
    slept_as = ""               # how the engine sleeps now: "level 1", "level 2" (vLLM's sleep mode) or "stopped"

    @property
    def stopped_asleep(self) -> bool:
        """Asleep as a full stop (the CPU): the engine holds no adapter and no pin, so dropping
        one needs no wake; ``rm`` while asleep answers at once."""
        return self.asleep and self._llm is None

    @property
    def has_sleep_mode(self) -> bool:
        """vLLM's sleep mode is on for this engine (CUDA, started with ``sleep_mode``)."""
        return self.device == "cuda" and bool(getattr(self.settings, "sleep_mode", False))

    async def sleep(self, level: int = 1) -> str:
        """Give the engine's memory back; return how ("level 1", "level 2", "stopped").

        With vLLM's sleep mode (CUDA): its ``sleep(level)`` (level 1: weights to host RAM, KV
        cache dropped; level 2: both dropped), which also empties the prefix cache. Without it
        (the CPU): a full stop of the engine and its processes; :meth:`wake` starts a new one with
        the same settings. The caller makes sure that no request is in the engine."""
        self.asleep = True
        try:
            if self.has_sleep_mode:
                await self._llm.sleep(level)
                self.slept_as = f"level {level}"
            else:
                await asyncio.to_thread(self.shutdown)
                self.slept_as = "stopped"
        except BaseException:
            self.asleep = False
            raise
        return self.slept_as

    async def wake(self) -> str:
        """Bring the engine back from :meth:`sleep`; return how. ``restarted_by_sleep`` says
        whether the adapters it held are gone (a new engine, or weights reloaded after level 2)."""
        slept_as = self.slept_as
        if slept_as == "stopped":
            fresh = await type(self).start(self.settings)
            self._llm, self._journal = fresh._llm, fresh._journal
            fresh._llm = None
            how = f"a new engine, started in {fresh.start_seconds:.1f} s"
            self.restarted_by_sleep = True
        else:
            await self._llm.wake_up()
            self.restarted_by_sleep = slept_as == "level 2"
            if self.restarted_by_sleep:
                # Level 2 dropped the weights: read them again from the model's files (as vLLM's
                # own server does after /wake_up), and the adapters with them (their device slots'
                # contents were dropped too: every adapter leaves, the pins are applied again).
                await self._llm.collective_rpc("reload_weights")
                for engine_id in (await self.lora_state()).get("host", []):
                    await self._llm.remove_lora(int(engine_id))
            await self._llm.reset_prefix_cache()
            how = f"from sleep mode {slept_as}"
        self.slept_as = ""
        self.asleep = False
        return how
