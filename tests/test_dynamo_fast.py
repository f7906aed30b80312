"""The Dynamo door's pure parts, without an engine or the runtime: flags, source URIs, the
translation of Dynamo's tokenized requests (every option its frontend sends: mapped as Dynamo's
own vLLM worker maps it, or refused by name), the chunks back (logprobs, n choices) — what
tests/test_dynamo.py runs for real."""

import asyncio
import json

import pytest

from loractl.errors import EngineUnavailable, InvalidRequest
from loractld.api.dynamo import protocol
from loractld.api.dynamo.settings import DynamoSettings
from loractld.api.dynamo.worker import DynamoWorker
from loractld.core import Delta, Prepared, TokenLogprob
from loractld.api.dynamo.loras import pull_ref
from loractld.main import build_parser, settings_from


def _settings(*flags: str):
    return settings_from(build_parser().parse_args(["--model", "tiny", *flags]))


def test_flags_default_off_and_check_the_namespace():
    assert not _settings().dynamo.enabled
    assert not _settings().auto_pull and _settings("--auto-pull").auto_pull
    on = _settings("--dynamo", "--dynamo-discovery", "file", "--dynamo-namespace", "lab-1").dynamo
    assert (on.enabled, on.discovery, on.generate_path) == (True, "file", "lab-1.loractl.generate")
    with pytest.raises(InvalidRequest, match="not a Dynamo namespace"):
        _settings("--dynamo-namespace", "a.b")


def test_source_uris_map_to_what_pull_takes():
    assert pull_ref("file:///srv/adapters/sql%20expert") == "/srv/adapters/sql expert"
    assert pull_ref("hf://org/repo") == "hf://org/repo"
    assert pull_ref("org/repo") == "org/repo"
    for bad in ("s3://bucket/x", "file://host/x", "gs://b/x"):
        with pytest.raises(InvalidRequest):
            pull_ref(bad)


def test_a_tokenized_request_becomes_the_cores_request():
    request = {"token_ids": [1, 2], "model": "base", "routing": {"lora_name": "sql-expert/v1"},
               "stop_conditions": {"max_tokens": 5, "min_tokens": 1, "stop": ["x"]},
               "sampling_options": {"temperature": 0.0, "seed": 7}}
    lora = protocol.lora_name(request, {"base"})
    got = protocol.generation_request(request, lora, {"top_p": 0.9})
    assert (got.lora, got.prompt_token_ids, got.allow_folders) == ("sql-expert/v1", [1, 2], False)
    s = got.sampling
    # Stop strings stay with the frontend, which detokenizes; the model's defaults fill the rest.
    assert (s.max_tokens, s.min_tokens, s.temperature, s.top_p, s.seed, s.stop) == (5, 1, 0.0, 0.9, 7, [])
    assert protocol.lora_name({"model": "base"}, {"base"}) == ""
    assert protocol.lora_name({"model": "poet/v1"}, {"base"}) == "poet/v1"
    with pytest.raises(InvalidRequest):
        protocol.generation_request({"token_ids": []}, "", {})


# What Dynamo 1.6.1's frontend sent for one chat request with every option it carries (captured
# from python -m dynamo.frontend on the tiny model): every key present, most at None.
FRONTEND_REQUEST = {
    "model": "tiny", "token_ids": [1, 4, 102, 78, 79, 2, 102, 5, 102],
    "stop_conditions": {"max_tokens": 3, "stop": ["x"], "stop_token_ids": [7], "stop_token_ids_visible": None,
                        "stop_token_ids_hidden": [2], "min_tokens": 2, "ignore_eos": None,
                        "max_thinking_tokens": None},
    "sampling_options": {"n": 1, "best_of": None, "presence_penalty": 0.5, "frequency_penalty": 0.30000001192092896,
                         "repetition_penalty": 1.2000000476837158, "temperature": 0.5, "top_p": 0.8999999761581421,
                         "top_k": 5, "min_p": 0.10000000149011612, "use_beam_search": None, "length_penalty": None,
                         "seed": 3, "include_stop_str_in_output": True,
                         "guided_decoding": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    "output_options": {"logprobs": 2, "prompt_logprobs": None, "skip_special_tokens": False,
                       "formatted_prompt": None, "return_tokens_as_token_ids": True, "no_stop_trim": True},
    "eos_token_ids": [2], "mdc_sum": "5fb0e604", "annotations": [], "routing": {}, "router_config_override": None,
}


def _with(section: str, **values) -> dict:
    request = {**FRONTEND_REQUEST, section: {**FRONTEND_REQUEST[section], **values}}
    return request


def test_every_option_the_frontend_sends_is_mapped_as_dynamos_vllm_worker_does():
    s = protocol.generation_request(FRONTEND_REQUEST, "", {"temperature": 0.7, "top_k": 20}).sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, 0.8999999761581421, 5, 3)
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == \
        (0.10000000149011612, 0.5, 0.30000001192092896, 1.2000000476837158)
    # stop strings, include_stop_str_in_output, skip_special_tokens, return_tokens_as_token_ids,
    # no_stop_trim: the frontend's (it detokenizes). Stop token ids: the engine's, hidden ones too.
    assert (s.max_tokens, s.min_tokens, s.stop, s.stop_token_ids, s.ignore_eos) == (3, 2, [], [7, 2], False)
    assert s.logprobs == 2
    assert s.structured.kinds() == ["json_schema"]
    assert json.loads(s.structured.json_schema) == {"type": "object", "properties": {"a": {"type": "integer"}}}
    # Left out: the model's defaults, else vLLM's.
    bare = protocol.generation_request({"token_ids": [1]}, "", {"temperature": 0.7, "top_k": 20, "max_tokens": 9})
    b = bare.sampling
    assert (b.temperature, b.top_p, b.top_k, b.min_p, b.repetition_penalty, b.logprobs, b.structured) == \
        (0.7, 1.0, 20, 0.0, 1.0, None, None)
    assert (b.max_tokens, b.default_max_tokens, b.stop_token_ids, b.ignore_eos) == (None, 9, [], False)
    # ignore_eos (the frontend then sends no hidden stop ids), visible stop ids, top_k -1.
    s = protocol.generation_request(_with("stop_conditions", ignore_eos=True, stop_token_ids=None,
                                          stop_token_ids_hidden=None, stop_token_ids_visible=[9, 9]), "", {}).sampling
    assert (s.ignore_eos, s.stop_token_ids) == (True, [9])
    assert protocol.generation_request(_with("sampling_options", top_k=-1), "", {"top_k": 20}).sampling.top_k == 0
    # extra_args.sampling_options over sampling_options, as Dynamo's worker merges them.
    merged = {**FRONTEND_REQUEST, "extra_args": {"sampling_options": {"temperature": 0.0},
                                                 "nvext": {"extra_fields": ["worker_id"]}}}
    assert protocol.generation_request(merged, "", {}).sampling.temperature == 0.0
    assert protocol.generation_request(_with("output_options", logprobs=0), "", {}).sampling.logprobs == 0


@pytest.mark.parametrize("guided, expected", [
    ({"json": '{"type": "object"}'}, ("json_schema", '{"type": "object"}')),
    ({"regex": "[a-z]+", "backend": "auto"}, ("regex", "[a-z]+")),
    ({"choice": ["yes", "no"], "backend": None}, ("choice", ["yes", "no"])),
    ({"grammar": 'root ::= "a"', "whitespace_pattern": None}, ("grammar", 'root ::= "a"')),
])
def test_guided_decoding_becomes_one_structured_output(guided, expected):
    s = protocol.generation_request(_with("sampling_options", guided_decoding=guided), "", {}).sampling
    kind, value = expected
    assert s.structured.kinds() == [kind] and getattr(s.structured, kind) == value
    empty = protocol.generation_request(_with("sampling_options", guided_decoding={"choice": []}), "", {})
    assert empty.sampling.structured is None


@pytest.mark.parametrize("section, values, name", [
    ("sampling_options", {"use_beam_search": True}, "use_beam_search"),
    ("sampling_options", {"best_of": 3}, "best_of"),
    ("sampling_options", {"length_penalty": 0.5}, "length_penalty"),
    ("sampling_options", {"top_k": -2}, "top_k"),
    ("sampling_options", {"guided_decoding": {"json": {}, "backend": "outlines"}}, "guided_decoding.backend"),
    ("sampling_options", {"guided_decoding": {"whitespace_pattern": " "}}, "guided_decoding.whitespace_pattern"),
    ("sampling_options", {"guided_decoding": {"structural_tag": {"type": "x"}}}, "guided_decoding.structural_tag"),
    ("sampling_options", {"guided_decoding": {"json": {}, "sketch": "x"}}, "guided_decoding.sketch"),
    ("sampling_options", {"allowed_token_ids": [5]}, "sampling_options.allowed_token_ids"),
    ("stop_conditions", {"max_thinking_tokens": 5}, "max_thinking_tokens"),
    ("stop_conditions", {"stop_regex": ["a+"]}, "stop_conditions.stop_regex"),
    ("stop_conditions", {"stop_token_ids": ["x"]}, "stop_conditions.stop_token_ids"),
    ("output_options", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("output_options", {"logprobs": 2 ** 32 - 1}, "logprobs"),
    ("output_options", {"logprobs": -1}, "logprobs"),
    ("output_options", {"return_hidden_states": True}, "output_options.return_hidden_states"),
])
def test_what_loractl_cannot_honour_is_refused_by_name(section, values, name):
    with pytest.raises(InvalidRequest) as refused:
        protocol.generation_request(_with(section, **values), "", {})
    assert name in refused.value.message and refused.value.hint and "\n" not in str(refused.value.message)


def test_refused_by_name_outside_the_options_and_n():
    for key, value, name in (("multi_modal_data", {"image_url": ["http://x/y.png"]}, "multi_modal_data"),
                             ("prompt_embeds", "AAAA", "prompt_embeds"),
                             ("extra_args", {"nvext": {"cache_salt": "tenant-a"}}, "nvext.cache_salt")):
        with pytest.raises(InvalidRequest, match=name):
            protocol.generation_request({**FRONTEND_REQUEST, key: value}, "", {})
    assert protocol.choices(FRONTEND_REQUEST) == 1 and protocol.choices({"token_ids": [1]}) == 1
    assert protocol.choices(_with("sampling_options", n=4)) == 4
    for n in (0, protocol.MAX_CHOICES + 1, "2"):
        with pytest.raises(InvalidRequest, match="n must be"):
            protocol.choices(_with("sampling_options", n=n))
    # best_of equal to n asks for nothing more.
    protocol.generation_request(_with("sampling_options", n=2, best_of=2), "", {})


@pytest.mark.parametrize("value", [None, 0, 0.0, False, "", [], {}])
def test_an_unknown_option_at_a_neutral_value_passes(value):
    for section in ("sampling_options", "stop_conditions", "output_options"):
        protocol.generation_request(_with(section, added_by_a_later_frontend=value), "", {})


def test_chunks_carry_logprobs_as_dynamos_vllm_worker_sends_them():
    sampled_in_top = TokenLogprob(token_id=5, logprob=-0.25, text="a", top=[(5, -0.25, "a"), (6, -1.5, "é")])
    sampled_below = TokenLogprob(token_id=9, logprob=float("-inf"), text="", top=[(5, -0.1, "a")])
    delta = Delta(text="a", token_ids=[5, 9], finish_reason="length", logprobs=[sampled_in_top, sampled_below])
    out = protocol.chunk(delta, prompt_tokens=4, produced=6, index=1)
    assert out["index"] == 1 and out["token_ids"] == [5, 9]
    assert out["log_probs"] == [-0.25, protocol.MIN_FINITE_LOGPROB]
    assert out["top_logprobs"] == [
        [{"rank": 1, "token_id": 5, "token": "a", "logprob": -0.25, "bytes": [97]},
         {"rank": 2, "token_id": 6, "token": "é", "logprob": -1.5, "bytes": [195, 169]}],
        # The sampled token first (rank N + 1: below the top N), no text: the frontend decodes it.
        [{"rank": 2, "token_id": 9, "token": None, "logprob": protocol.MIN_FINITE_LOGPROB, "bytes": None},
         {"rank": 1, "token_id": 5, "token": "a", "logprob": -0.1, "bytes": [97]}]]
    assert out["completion_usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    plain = protocol.chunk(Delta(text="b", token_ids=[7]), 4, 1)
    assert plain == {"index": 0, "token_ids": [7]}


class _Core:
    """A core whose engine answers each choice with its seed as tokens (two steps)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.closed = 0

    def base_model_names(self):
        return {"tiny"}

    async def sampling_defaults(self):
        return {}

    async def prepare(self, request):
        return Prepared(adapter=None, name=None, prompt_ids=request.prompt_token_ids,
                        sampling=request.sampling)

    async def run(self, prepared):
        seed = prepared.sampling.seed
        try:
            for step in range(2):
                await asyncio.sleep(0.001 * seed)
                if seed == self.fail_at and step == 1:
                    raise InvalidRequest("late")
                yield Delta(text="", token_ids=[seed], finish_reason="length" if step else None)
        finally:
            self.closed += 1


class _Context:
    def __init__(self) -> None:
        self.stop = asyncio.Event()

    async def async_killed_or_stopped(self):
        await self.stop.wait()


def _worker(core):
    worker = DynamoWorker(core, DynamoSettings(enabled=True))
    worker._exceptions = None  # unused: nothing fails before output in these runs
    return worker


async def _chunks(core, request) -> list[dict]:
    return [c async for c in _worker(core).generate(request, _Context())]


def test_n_choices_run_as_n_generations_seeded_as_vllm_does():
    request = {"token_ids": [1, 2, 3], "sampling_options": {"n": 3, "seed": 10}, "stop_conditions": {"max_tokens": 2}}
    core = _Core()
    chunks = asyncio.run(_chunks(core, request))
    by_index = {i: [t for c in chunks if c["index"] == i for t in c["token_ids"]] for i in range(3)}
    assert by_index == {0: [10, 10], 1: [11, 11], 2: [12, 12]}
    ends = [c for c in chunks if c.get("finish_reason")]
    assert sorted(c["index"] for c in ends) == [0, 1, 2]
    assert ends[-1]["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert core.closed == 3
    # One choice failing after output began: every unfinished choice ends with the error, all closed.
    core = _Core(fail_at=11)
    chunks = asyncio.run(_chunks(core, request))
    errors = [c for c in chunks if str(c.get("finish_reason", "")).startswith("error: late")]
    assert errors and 1 in {c["index"] for c in errors} and core.closed == 3

    async def stopped_after_the_first_chunk():
        core, context, seen = _Core(), _Context(), []
        async for c in _worker(core).generate(request, context):
            seen.append(c)
            context.stop.set()
        return core, seen

    core, seen = asyncio.run(stopped_after_the_first_chunk())
    assert sorted(c["index"] for c in seen if c.get("finish_reason") == "cancelled") == [0, 1, 2]
    assert core.closed == 3


def test_failures_map_to_dynamos_exceptions():
    class Exceptions:  # the two classes of dynamo.llm.exceptions that are used, by name
        class InvalidArgument(Exception):
            pass

        class EngineShutdown(Exception):
            pass

    refused = protocol.raised(InvalidRequest("bad", "do this"), Exceptions)
    assert isinstance(refused, Exceptions.InvalidArgument) and str(refused) == "bad (do this)"
    assert isinstance(protocol.raised(EngineUnavailable("draining"), Exceptions), Exceptions.EngineShutdown)
    assert protocol.failed(InvalidRequest("late", "hint"))["finish_reason"] == "error: late (hint)"
