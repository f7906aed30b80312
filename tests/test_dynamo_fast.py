"""The Dynamo door's pure parts, without an engine or the runtime: flags, source URIs, the
translation of Dynamo's tokenized requests (what tests/test_dynamo.py runs for real)."""

import pytest

from loractl.errors import EngineUnavailable, InvalidRequest
from loractld.api.dynamo import protocol
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
    for bad in ({"token_ids": []}, {"token_ids": [1], "sampling_options": {"n": 2}},
                {"token_ids": [1], "stop_conditions": {"ignore_eos": True}}):
        with pytest.raises(InvalidRequest):
            protocol.generation_request(bad, "", {})


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
