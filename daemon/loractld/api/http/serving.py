"""``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's shapes over the core.

One HTTP request becomes one or more choices (``n``, and for completions one per prompt),
each a ``Core.prepare``/``Core.run`` of its own, running in its own task.

Invariants:
- Everything that can refuse a request — the model, the messages, the prompt against the
  context, the engine's own input checks — is answered before the status line: a streamed
  response starts only once every choice has produced its first output, so a bad request is
  a 4xx in the OpenAI error schema, never a 200 with an error inside.
- A client that goes away (before or during the answer) cancels every choice, which aborts
  them in the engine; a :class:`Run` releases its concurrency slot exactly once, however it ends.
- ``n`` > 1 follows vLLM: choice ``i`` samples with ``seed + i`` when a seed is given.
- One request asks for at most ``max_choices`` generations (prompts x ``n``), refused with 400
  before any is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loractl.errors import AdapterNotFound, LoractlError
from loractld.api.http.errors import HttpError, error_body, from_domain, unknown_model
from loractld.api.http.protocol import ChatCompletionRequest, CompletionRequest
from loractld.core import Core, GenerationRequest, Prepared, UnknownModel
from loractld.core import Delta, Sampling
from loractld.core.policy import Caller

_log = logging.getLogger("loractld.http")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class Limiter:
    """At most ``limit`` generation requests at once; the next one is told to come back (429)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise HttpError(429, f"too many requests at once ({self.limit} are running)",
                            "Retry in a moment, or raise loractld --http-max-concurrency.",
                            code="too_many_requests", headers={"Retry-After": "1"})
        self.active += 1

    def release(self) -> None:
        self.active -= 1


class Run:
    """The running choices of one request. Items arrive as ``(index, Delta)``; a choice that
    ends sends ``(index, None)``, one that fails ``(index, exception)``."""

    def __init__(self, core: Core, choices: list[Prepared], release: Callable[[], None]) -> None:
        self.core = core
        self.choices = choices
        self._release: Callable[[], None] | None = release
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, p)) for i, p in enumerate(choices)]

    async def _pump(self, index: int, prepared: Prepared) -> None:
        try:
            async with contextlib.aclosing(self.core.run(prepared)) as deltas:
                async for delta in deltas:
                    self._queue.put_nowait((index, delta))
            self._queue.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the response, which reports it
            self._queue.put_nowait((index, e))

    async def first(self) -> list[tuple[int, Delta | None]]:
        """Wait until every choice produced its first output; raise the first failure."""
        buffered, waiting = [], set(range(len(self.choices)))
        while waiting:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            buffered.append((index, item))
            waiting.discard(index)
        return buffered

    async def rest(self, buffered: list[tuple[int, Delta | None]]) -> AsyncIterator[tuple[int, Delta]]:
        """The buffered items, then the others as they come, until every choice has ended."""
        running = len(self.choices) - sum(1 for _, item in buffered if item is None)
        for index, item in buffered:
            if item is not None:
                yield index, item
        while running:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item

    async def close(self) -> None:
        """Cancel what still runs (an abort in the engine) and free the concurrency slot."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._release is not None:
            self._release, release = None, self._release
            release()


class EventStream(StreamingResponse):
    """Server-sent events that close their :class:`Run` however the response ends: finished,
    failed, or cut short by a client that went away (Starlette cancels the body then)."""

    def __init__(self, body: AsyncIterator[str], run: Run) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._run.close()


async def until_disconnected(request: Request, work: Awaitable) -> Any:
    """``work``'s result; if the client goes away first, ``work`` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sampling_for(body: ChatCompletionRequest | CompletionRequest, defaults: dict) -> Sampling:
    """The request's sampling over the model's defaults over OpenAI's (temperature 1, top_p 1)."""
    top_k = body.top_k if body.top_k is not None else defaults.get("top_k", 0)
    return Sampling(
        max_tokens=body.token_limit,  # None: the rest of the context (see core.GenerationRequest)
        min_tokens=body.min_tokens or 0,
        temperature=body.temperature if body.temperature is not None else defaults.get("temperature", 1.0),
        top_p=body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
        top_k=max(0, top_k), seed=body.seed, stop=body.stop_list,
    )


class Serving:
    def __init__(self, core: Core, limiter: Limiter, *, max_choices: int = 128, key_required: bool = False) -> None:
        self.core = core
        self.limiter = limiter
        self.max_choices = max_choices
        # Behind the guard every generation request of a keyed API carries the key: its holder is
        # the caller the core judges (core.policy). Keyless callers stay unidentified: they never
        # make the daemon download.
        self.caller = Caller("http", key_holder=True) if key_required else None

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        messages = [m.as_core() for m in body.messages]
        return await self._serve(request, body, [GenerationRequest(messages=messages)], _ChatFormat(body))

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        prompts = [GenerationRequest(prompt=p) if isinstance(p, str) else GenerationRequest(prompt_token_ids=p)
                   for p in body.prompts()]
        return await self._serve(request, body, prompts, _CompletionFormat(body))

    async def _serve(self, request: Request, body, prompts: list[GenerationRequest], fmt) -> Response:
        if len(prompts) * body.n > self.max_choices:
            # One HTTP request counts once against --http-max-concurrency: this bounds what it holds.
            raise HttpError(400, f"{len(prompts)} prompt(s) x n={body.n} asks for {len(prompts) * body.n} "
                                 f"generations, over this daemon's limit of {self.max_choices} per request",
                            "Split the prompts over several requests, or raise loractld --http-max-choices.",
                            param="prompt" if len(prompts) > 1 else "n", code="too_many_choices")
        try:
            run = await until_disconnected(request, self._start(body, prompts))
            if body.stream:
                try:
                    buffered = await until_disconnected(request, run.first())
                except BaseException:
                    await run.close()
                    raise
                return EventStream(self._events(run, buffered, fmt), run)
            try:
                outputs = await until_disconnected(request, _collect(run))
            finally:
                await run.close()
            return JSONResponse(fmt.response(outputs, run.choices))
        except ClientGone:
            _log.debug("the client went away; its request was aborted")
            return Response(status_code=499)
        except UnknownModel as e:
            raise unknown_model(body.model, e.close_matches) from e
        except AdapterNotFound as e:
            raise from_domain(e, param="model") from e

    async def _start(self, body, prompts: list[GenerationRequest]) -> Run:
        """A slot, every prompt prepared (tokenized once, then one choice per ``n``), started."""
        self.limiter.acquire()
        try:
            defaults = await self.core.sampling_defaults()
            sampling = sampling_for(body, defaults)
            lora = "" if body.model in self.core.base_model_names() else body.model
            choices = []
            for prompt in prompts:
                prepared = await self.core.prepare(dataclasses.replace(prompt, lora=lora, sampling=sampling,
                                                                       allow_folders=False, caller=self.caller))
                for i in range(body.n):
                    seed = None if sampling.seed is None else sampling.seed + i
                    choices.append(dataclasses.replace(prepared, sampling=dataclasses.replace(prepared.sampling,
                                                                                             seed=seed)))
            return Run(self.core, choices, self.limiter.release)
        except BaseException:
            self.limiter.release()
            raise

    async def _events(self, run: Run, buffered, fmt) -> AsyncIterator[str]:
        produced = [0] * len(run.choices)
        try:
            for chunk in fmt.opening(len(run.choices)):
                yield _sse(chunk)
            async for index, delta in run.rest(buffered):
                produced[index] += len(delta.token_ids)
                if delta.text or delta.finish_reason:
                    yield _sse(fmt.chunk(index, delta))
            if fmt.body.include_usage:
                yield _sse(fmt.usage_chunk(_usage(run.choices, produced, fmt.prompts_counted)))
        except LoractlError as e:
            yield _sse(error_body(from_domain(e).status, e.message, e.hint, code=e.kind))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            _log.exception("generation failed mid-stream")
            yield _sse(error_body(500, f"internal error: {type(e).__name__}: {e}", "See the daemon's log."))
        yield "data: [DONE]\n\n"


async def _collect(run: Run) -> list[dict]:
    outputs = [{"text": [], "tokens": 0, "finish_reason": None} for _ in run.choices]
    async for index, delta in run.rest([]):
        outputs[index]["text"].append(delta.text)
        outputs[index]["tokens"] += len(delta.token_ids)
        outputs[index]["finish_reason"] = delta.finish_reason or outputs[index]["finish_reason"]
    return [{**o, "text": "".join(o["text"])} for o in outputs]


def _usage(choices: list[Prepared], produced: list[int], prompts_counted: int) -> dict:
    """Prompt tokens once per prompt (not per choice), as vLLM counts them."""
    n = len(choices) // prompts_counted
    prompt = sum(len(choices[i * n].prompt_ids) for i in range(prompts_counted))
    completion = sum(produced)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Format:
    """What one endpoint's responses look like; the running is shared."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, body) -> None:
        self.body = body
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompts_counted = 1

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.body.model,
                "choices": choices, **extra}

    def opening(self, choices: int) -> list[dict]:
        return []

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope(self.chunk_object_name, [], usage=usage)

    def response(self, outputs: list[dict], choices: list[Prepared]) -> dict:
        usage = _usage(choices, [o["tokens"] for o in outputs], self.prompts_counted)
        return self._envelope(self.object_name, [self.final_choice(i, o) for i, o in enumerate(outputs)], usage=usage)


class _ChatFormat(_Format):
    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def opening(self, choices: int) -> list[dict]:
        # The role first, once per choice, as OpenAI and vLLM stream it.
        return [self._envelope(self.chunk_object_name, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
                for i in range(choices)]

    def chunk(self, index: int, delta: Delta) -> dict:
        return self._envelope(self.chunk_object_name, [{"index": index, "delta": {"content": delta.text} if delta.text
                                                        else {}, "logprobs": None,
                                                        "finish_reason": delta.finish_reason}])

    def final_choice(self, index: int, output: dict) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": output["text"]}, "logprobs": None,
                "finish_reason": output["finish_reason"]}


class _CompletionFormat(_Format):
    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, body: CompletionRequest) -> None:
        super().__init__(body)
        self.prompts_counted = len(body.prompts())

    def chunk(self, index: int, delta: Delta) -> dict:
        return self._envelope(self.chunk_object_name, [{"index": index, "text": delta.text, "logprobs": None,
                                                        "finish_reason": delta.finish_reason}])

    def final_choice(self, index: int, output: dict) -> dict:
        return {"index": index, "text": output["text"], "logprobs": None, "finish_reason": output["finish_reason"]}
