"""vLLM's own OpenAI serving layer (chat, completions, responses, Anthropic messages,
tokenization) over loractl's engine: what `vllm serve --enable-lora` answers, answered the same.

vLLM's serving classes are handed two things of loractl's instead of vLLM's:
- an engine client (:class:`AdmittedEngineClient`): vLLM's ``AsyncLLM`` except for
  ``generate``, which runs each engine request inside the admission it was handed
  (``loractld.serving.admitted.Admission``: the drain, the gate, the token counts), refuses an
  adapter the worker failed to load (the broken journal), and orders a stop string's abort
  before the gate hands the slot on;
- a models registry (:class:`ScopedModels`) that knows one adapter: the one the door resolved
  through the store for the request being served (its :class:`RequestScope`). vLLM's own
  registry would keep names, counter ids and a permanent cache of its own; loractl's names map
  to content-addressed engine ids, so a revision swap is seen by the next request.

Each request is served by its own shallow copy of vLLM's handler (:meth:`OpenAISurface._bound`),
whose ``models``, ``engine_client`` and renderer are bound to that request's scope: the scope
is passed down as an object, never read back from task-local state. A copy shares every
heavy part (tokenizer, renderer internals, the Responses store) with the handler built once.

Invariants:
- ``vllm`` is imported inside functions only (this module is imported by the daemon's
  command line); which constructor takes which argument is ``compat.serving_kwargs``'s job.
- Every engine request a handler starts (``n``, several prompts, a stream, a background
  Responses request) goes through its copy's ``engine_client``, so it carries the scope its
  request resolved and no other; an engine request without a scope is refused.
- The door holds the adapter's lease for the whole response; nothing here releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from loractl.errors import InvalidRequest, LoractlError
from loractld.engine import compat
from loractld.engine.template_sandbox import TemplateSandbox

_log = logging.getLogger("loractld.engine")


@dataclass(frozen=True)
class ServeOptions:
    """vLLM's OpenAI server flags, under vLLM's names (``loractld --help`` lists them)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None
    reasoning_parser: str | None = None
    chat_template_content_format: str = "auto"
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: str | None = None   # JSON text, as vLLM takes it
    structured_outputs_config: str | None = None      # JSON text, as vLLM takes it

    def chat_template_kwargs(self) -> dict[str, Any] | None:
        return json.loads(self.default_chat_template_kwargs) if self.default_chat_template_kwargs else None


def add_arguments(parser: Any) -> None:
    """vLLM's OpenAI server flags, with vLLM's names, so a `vllm serve` command line carries over."""
    group = parser.add_argument_group("vLLM's OpenAI server flags (the --http API; same names as `vllm serve`)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model call tools on its own (tool_choice 'auto'); needs --tool-call-parser")
    group.add_argument("--tool-call-parser", metavar="NAME",
                       help="vLLM's parser of the model's tool calls (hermes, llama3_json, mistral, ...); needed "
                            "for any tool_choice but 'none'")
    group.add_argument("--tool-parser-plugin", metavar="FILE", help="a Python file that registers more tool parsers")
    group.add_argument("--reasoning-parser", metavar="NAME",
                       help="vLLM's parser of the model's reasoning (deepseek_r1, qwen3, ...): answers carry it "
                            "apart as reasoning_content")
    group.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"), default="auto",
                       help="how message content reaches the chat template (default: auto)")
    group.add_argument("--response-role", default="assistant", metavar="ROLE",
                       help="the role of the answers' messages (default: assistant)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens as 'token_id:N'")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details (cached tokens)")
    group.add_argument("--enable-force-include-usage", action="store_true", help="every response carries usage")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="with tool_choice 'none', leave the tools out of the prompt")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (a template runs code in the daemon's templating)")
    group.add_argument("--default-chat-template-kwargs", metavar="JSON",
                       help='keyword arguments for every chat template rendering, e.g. \'{"enable_thinking": false}\'')
    group.add_argument("--structured-outputs-config", metavar="JSON",
                       help='vLLM\'s structured outputs settings, e.g. \'{"backend": "xgrammar"}\' '
                            "(default: vLLM's: auto)")


def options_from(args: Any) -> ServeOptions:
    """The options of :func:`add_arguments`; JSON values are checked here, before the start."""
    for flag in ("default_chat_template_kwargs", "structured_outputs_config"):
        text = getattr(args, flag)
        if text is None:
            continue
        try:
            value = json.loads(text)
        except ValueError as e:
            raise InvalidRequest(f"--{flag.replace('_', '-')} is not JSON: {e}",
                                 "Give a JSON object, e.g. '{\"backend\": \"xgrammar\"}'.") from e
        if not isinstance(value, dict):
            raise InvalidRequest(f"--{flag.replace('_', '-')} must be a JSON object", "Give a JSON object.")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise InvalidRequest("--enable-auto-tool-choice needs --tool-call-parser",
                             "Name the parser for your model's tool calls, e.g. --tool-call-parser hermes.")
    return ServeOptions(**{f: getattr(args, f) for f in ServeOptions.__dataclass_fields__})


@dataclass
class RequestScope:
    """The adapter one HTTP request resolved: ``model`` as the client named it; ``adapter``
    None for the base model. ``lora_request`` is built from it (the content-addressed id)."""

    model: str
    adapter: Any = None          # loractld.store.identity.AdapterRef
    name: str | None = None      # the store name, when the adapter came from the store
    lora_request: Any = None
    counted: list[int] = field(default_factory=list)
    first_token_ns: int | None = None   # time.perf_counter_ns() at its first generated token
    # A profile's chat template (loractld.core.profiles): the daemon owner's, so vLLM takes it
    # as this request's chat_template without --trust-request-chat-template (a client's own is
    # still refused without it).
    template: str | None = None


@dataclass
class Answer:
    """What a handler answered: a JSON body with its status, or (status 200) an SSE stream."""

    status: int
    body: dict | None = None
    stream: AsyncIterator[str] | None = None
    scope: RequestScope | None = None   # the request's (its first token's time, for the Ollama door)


class ScopedModels:
    """vLLM's ``OpenAIServingModels`` as its serving classes use it (``lora_requests``,
    ``is_base_model``, ``model_name``, ``resolve_lora``, ``base_model_paths``), knowing only the
    adapter of one request (``scope``; None in the handlers built once, which serve nothing)."""

    def __init__(self, engine_client: Any, base_model_paths: list, scope: RequestScope | None = None) -> None:
        self.engine_client = engine_client
        self.base_model_paths = base_model_paths
        self.model_config = engine_client.model_config
        self.renderer = engine_client.renderer
        self.input_processor = getattr(engine_client, "input_processor", None)
        self.scope = scope

    def scoped(self, engine_client: Any, scope: RequestScope) -> ScopedModels:
        return ScopedModels(engine_client, self.base_model_paths, scope)

    @property
    def lora_requests(self) -> dict:
        scope = self.scope
        return {scope.model: scope.lora_request} if scope is not None and scope.lora_request is not None else {}

    def is_base_model(self, model_name: str | None) -> bool:
        scope = self.scope
        return scope is not None and scope.lora_request is None and model_name == scope.model

    def model_name(self, lora_request: Any = None) -> str:
        """What a response's ``model`` says: the name the client used for an adapter, the
        served name for the base model (as vLLM's server answers)."""
        if lora_request is not None and self.scope is not None:
            return self.scope.model
        return self.base_model_paths[0].name

    async def resolve_lora(self, lora_name: str) -> None:
        return None   # the door resolved the name already; an unknown one never gets this far


class AdmittedEngineClient:
    """vLLM's engine client for its serving classes: the engine's ``AsyncLLM`` in everything
    but ``generate``. See the module for what ``generate`` adds."""

    def __init__(self, engine: Any, admission: Any) -> None:
        self._engine = engine
        self._admission = admission   # its request(adapter, name) and generated(label, tokens)

    @property
    def _llm(self) -> Any:
        """The engine's ``AsyncLLM`` now: a wake after a keep-alive stop replaces it (engine.client)."""
        return self._engine._llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *, lora_request: Any = None,
                       scope: RequestScope | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        """vLLM's ``generate``, admitted; ``scope`` is the request's adapter (a handler's copy
        passes its own, :class:`ScopedEngineClient`; the core passes it for the gRPC and Dynamo doors)."""
        from vllm.sampling_params import RequestOutputKind

        if scope is None:
            raise RuntimeError("an engine request with no request scope")
        adapter = scope.adapter
        if (lora_request is None) != (adapter is None) or (
                adapter is not None and lora_request.lora_int_id != adapter.engine_id):
            raise RuntimeError("an engine request for an adapter its request did not resolve")
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        # A whole answer (FINAL_ONLY, stream: false) is followed step by step, as CUMULATIVE, and
        # only its final output is handed on: its first token is seen when it comes (Ollama's
        # prompt_eval_duration, the gate's hand-over measure), and its tokens are counted as they
        # are made. One sequence only: with n > 1 the final outputs are aggregated by vLLM.
        final_only = sampling_params.output_kind == RequestOutputKind.FINAL_ONLY and sampling_params.n == 1
        if final_only:
            sampling_params = sampling_params.clone()
            sampling_params.output_kind = RequestOutputKind.CUMULATIVE
        engine = self._engine
        count = self._admission.generated
        async with self._admission.request(adapter, scope.name) as label:
            engine_ids: list[str] = []
            produced = 0
            async for out in self._llm.generate(prompt, sampling_params, request_id, lora_request=lora_request,
                                                **kwargs):
                if not engine_ids:
                    engine_ids = engine._engine_request_ids(request_id)
                if out.finished and engine_ids and any(isinstance(o.stop_reason, str) for o in out.outputs):
                    await engine._abort_in_engine(engine_ids)
                if adapter is not None:
                    engine._refuse_if_broken(adapter)   # its stand-in's tokens never reach the client
                tokens = sum(len(o.token_ids) for o in out.outputs)
                if tokens and scope.first_token_ns is None:
                    scope.first_token_ns = time.perf_counter_ns()
                if delta:
                    count(label, tokens)
                elif final_only:
                    count(label, tokens - produced)
                    produced = tokens
                    if not out.finished:
                        continue
                else:
                    produced = tokens
                yield out
            if not delta and not final_only and produced:
                count(label, produced)


class ScopedEngineClient:
    """The engine client of one request's handler copy: :class:`AdmittedEngineClient` with
    that request's scope passed to every ``generate``."""

    def __init__(self, client: AdmittedEngineClient, scope: RequestScope) -> None:
        self._client = client
        self._scope = scope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        return self._client.generate(prompt, sampling_params, request_id, scope=self._scope, **kwargs)


class OpenAISurface:
    """vLLM's serving classes, built once over an :class:`AdmittedEngineClient`; the door calls
    :meth:`answer` with a route name and the request's JSON body."""

    def __init__(self, engine: Any, options: ServeOptions, admission: Any, served_names: list[str]) -> None:
        self._engine = engine
        self._built_on = engine._llm
        self.client = AdmittedEngineClient(engine, admission)
        self._routes = compat.openai_serving(self.client, ScopedModels, served_names, engine.settings.model,
                                             options, engine.settings.chat_template)
        self._validators: dict[str, Any] = {}
        self.served_name = served_names[0]   # the base model's name, as the serving classes know it
        # A profile's template (or a trusted request's) renders in a child with a deadline and a
        # memory cap, never in vLLM's renderer thread, which every other request waits on.
        self.templates = TemplateSandbox(server_template=engine.settings.chat_template,
                                         max_model_len=engine.max_model_len)
        self.templates.install(self.client.renderer)

    @property
    def stale(self) -> bool:
        """Built over an ``AsyncLLM`` the engine no longer runs (a wake after a keep-alive stop
        started a new one): the core builds the serving classes again."""
        return self._engine._llm is not self._built_on

    def _bound(self, route: str, scope: RequestScope) -> Callable:
        """``route``'s handler method on a shallow copy of its serving class bound to ``scope``:
        its ``models`` and ``engine_client`` know only this request. Its renderer is copied too
        when the scope carries a profile's template: vLLM refuses a request's chat_template unless
        --trust-request-chat-template, and the one a profile gives (:attr:`RequestScope.template`,
        set by the core) is let through, as if the daemon had been started with it."""
        method = self._routes[route].method
        handler = method.__self__
        bound = copy.copy(handler)
        client = ScopedEngineClient(self.client, scope)
        bound.engine_client = client
        bound.models = handler.models.scoped(client, scope)
        renderer = getattr(handler, "online_renderer", None)
        if scope.template is not None and renderer is not None:
            bound.online_renderer = _trusting(renderer, scope.template)
        return getattr(bound, method.__name__)

    @staticmethod
    def _kept(handler: Any, bound: Any, began: dict) -> None:
        """What vLLM's handler set on the request's copy while serving it (a lazily probed
        setting), kept on the handler built once, as serving in place would have kept it;
        ``began``: the copy's attributes when it was made."""
        for name, value in vars(bound).items():
            if began.get(name, _MISSING) is not value:
                setattr(handler, name, value)

    def fields(self, route: str) -> set[str]:
        """The request fields ``route`` knows (names and aliases)."""
        import typing

        request_type = self._routes[route].request_type
        known: set[str] = set()
        for model in typing.get_args(request_type) or (request_type,):   # /tokenize takes a union
            known |= set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
        return known

    def scope(self, model: str, adapter: Any, name: str | None, *, template: str | None = None) -> RequestScope:
        """The request's adapter as a :class:`RequestScope`, for :meth:`answer` or the core's doors."""
        return RequestScope(model=model, adapter=adapter, name=name,
                            lora_request=self._engine._lora_request(adapter) if adapter is not None else None,
                            template=template)

    # -- the parts of a handler the core's own doors use (see loractld.engine.vllm_requests) --
    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def engine_errored(self) -> bool:
        return self._engine.errored

    def handler(self, route: str) -> Any:
        """The serving class instance behind ``route`` (its defaults, its renderer)."""
        return self._routes[route].method.__self__

    def validator(self, route: str) -> Any:
        """A pydantic ``TypeAdapter`` of ``route``'s request model (built once)."""
        validator = self._validators.get(route)
        if validator is None:
            from pydantic import TypeAdapter

            validator = self._validators[route] = TypeAdapter(self._routes[route].request_type)
        return validator

    async def render(self, route: str, request: Any, *, template: str | None = None) -> list[Any]:
        """``request``'s engine inputs as ``route``'s handler renders them (the chat template, the
        tokenizer), for the base model's name; vLLM's refusal is an :class:`InvalidRequest`."""
        handler = self._bound(route, RequestScope(model=request.model, template=template)).__self__
        try:
            if route == "chat":
                result = await handler.render_chat_request(request)
            else:
                result = await handler.render_completion_request(request)
        except (LoractlError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's refusal of the messages (a template's error)
            raise self._unrendered(route, _first_line(e)) from e
        if isinstance(result, compat.error_response_type()):
            raise self._unrendered(route, _first_line(result.error.message))
        return result[1] if route == "chat" else result

    def _unrendered(self, route: str, reason: str) -> InvalidRequest:
        if route == "chat" and not (self._engine.settings.chat_template
                                    or getattr(self.handler(route).renderer.tokenizer, "chat_template", None)):
            return InvalidRequest(f"the model {self._engine.settings.model!r} has no chat template",
                                  "Send the prompt as is (loractl run --raw PROMPT), or restart the daemon "
                                  "with --chat-template FILE.")
        return InvalidRequest(f"the request could not be rendered: {reason}",
                              "Check the messages against the model's chat template and context, or send a raw "
                              "prompt (loractl run --raw).")

    async def answer(self, route: str, body: dict, raw_request: Any, scope: RequestScope) -> Answer:
        """vLLM's answer to ``body`` on ``route`` for the request ``scope`` resolved: its
        validation, its handler, its shapes; the answer carries ``scope``."""
        from pydantic import ValidationError

        try:
            request = self.validator(route).validate_python(body)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            # Field names and list indexes; not the union branches pydantic tried ("str", "list[int]").
            where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or (
                re.fullmatch(r"[a-z_][a-z0-9_]*", p) and p not in ("str", "int", "float", "bool", "list", "dict")))
            return Answer(400, {"error": {"message": f"{where + ': ' if where else ''}{first['msg']}",
                                          "type": "BadRequestError", "param": where or None, "code": 400}})
        except Exception as e:  # noqa: BLE001 - a model validator's own refusal (VLLMValidationError)
            return compat.error_answer(e, Answer)
        call = self._bound(route, scope)
        began = dict(vars(call.__self__))
        try:
            result = await call(request, raw_request)
        except (LoractlError, asyncio.CancelledError):
            raise   # loractl's own refusals (a broken adapter, a draining daemon): the door's to answer
        except Exception as e:  # noqa: BLE001 - answered as vLLM's server answers it
            if not isinstance(e, ValueError) and type(e).__name__ != "VLLMValidationError":
                _log.error("vLLM's %s handler failed", route, exc_info=e)
            return compat.error_answer(e, Answer)
        finally:
            self._kept(self._routes[route].method.__self__, call.__self__, began)
        answer = compat.serving_answer(result, Answer)
        answer.scope = scope
        return answer


class _NoAdmission:
    """No gate, no counts: for a caller that owns the engine alone."""

    @contextlib.asynccontextmanager
    async def request(self, adapter: Any, name: str | None):
        yield ()

    def generated(self, label: Any, tokens: int) -> None:
        pass


def unadmitted_surface(engine: Any) -> OpenAISurface:
    """The serving classes over ``engine`` with no admission gate and no token counts: for a
    caller that owns the engine alone (the self-check, benchmarks), never the daemon's doors."""
    return OpenAISurface(engine, engine.settings.openai, _NoAdmission(), [engine.settings.model])


_MISSING = object()


def _trusting(renderer: Any, template: str) -> Any:
    """A shallow copy of vLLM's ``OnlineRenderer`` that takes ``template`` (a profile's, the
    daemon owner's) as a request's chat_template without --trust-request-chat-template; a
    client's own template is still checked as vLLM checks it."""
    check = renderer.validate_chat_template
    trusting = copy.copy(renderer)

    def validate_chat_template(request_chat_template, chat_template_kwargs, trust_request_chat_template):
        if request_chat_template == template:
            request_chat_template = None
        return check(request_chat_template, chat_template_kwargs, trust_request_chat_template)

    trusting.validate_chat_template = validate_chat_template
    return trusting


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
