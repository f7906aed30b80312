"""vLLM 0.26 through 0.33: each version path that loractl adapts, checked without a GPU (0.33 is
read, not run: its values here are from its wheel's source, docs/vllm-releases.md)."""

from __future__ import annotations

import pytest

from loractl.errors import EngineUnavailable
from loractld.engine import compat

FIELDS_026 = ("lora_name", "lora_int_id", "lora_path", "lora_local_path", "long_lora_max_len",
              "base_model_name", "tensorizer_config_dict")
FIELDS_032 = ("lora_name", "lora_int_id", "lora_path", "base_model_name", "load_inplace", "is_3d_lora_weight")
FIELDS_033 = FIELDS_032   # vllm/lora/request.py unchanged in 0.33.0 (read in its wheel)


@pytest.mark.parametrize("version, has_path", [
    # the adapter's path joined its name in the prefix-cache key in 0.31.0 (kv_cache_utils, read in each wheel)
    ("0.26.0", False), ("0.27.1", False), ("0.30.0", False), ("0.31.0", True), ("0.32.0", True), ("0.32.0+cpu", True),
    ("0.33.0", True), ("0.33.1", True),
])
def test_supported_versions(version, has_path):
    f = compat.features(version)
    assert f.prefix_cache_key_has_path is has_path
    # max_model_len=-1 fits the context to the KV cache in 0.26.0 too (kv_cache_utils._auto_fit_max_model_len):
    # an unset --max-model-len must not start a long-context model at its full, unfittable length.
    assert f.auto_fit_max_model_len and compat.max_model_len_arg(None, f) == -1
    assert compat.max_model_len_arg(4096, f) == 4096


@pytest.mark.parametrize("device, installed, expected", [
    ("cuda", False, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}),  # vLLM imports flashinfer to decide, and raises
    ("cuda", True, {}),   # vLLM's own choice, with its own fallback: the faster sampler where it fits
    ("cpu", False, {}), ("cpu", True, {}),
])
def test_the_flashinfer_sampler_is_off_only_where_flashinfer_is_missing(device, installed, expected):
    assert compat.flashinfer_sampler_env(device, installed) == expected


def test_the_compat_range_is_the_range_the_gpu_extra_allows():
    """pyproject's `gpu` extra and compat.SUPPORTED say the same versions: a release the extra
    installs is one compat knows, and compat accepts nothing the extra would not install."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    vllm_req = next(r for r in project["project"]["optional-dependencies"]["gpu"] if r.startswith("vllm"))
    low, high = re.fullmatch(r"vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)", vllm_req).groups()[:2], \
        re.fullmatch(r"vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)", vllm_req).groups()[2:]
    (sup_low, sup_high) = compat.SUPPORTED
    assert (int(low[0]), int(low[1])) == sup_low
    assert (int(high[0]), int(high[1]) - 1) == sup_high  # <0.34 allows 0.33.x, the newest supported
    cpu_req = next(r for r in project["project"]["optional-dependencies"]["cpu"] if r.startswith("vllm"))
    cpu_version = compat.parse_version(cpu_req.split("==")[1])
    assert sup_low <= cpu_version[:2] <= sup_high


@pytest.mark.parametrize("version", ["0.25.2", "0.34.0", "1.0.0"])
def test_unsupported_versions_are_refused_with_a_hint(version):
    with pytest.raises(EngineUnavailable, match="not supported") as info:
        compat.features(version)
    assert "pip install" in info.value.hint


@pytest.mark.parametrize("fields", [FIELDS_026, FIELDS_032, FIELDS_033], ids=["0.26", "0.32", "0.33"])
def test_lora_request_keywords_fit_every_layout(fields):
    kwargs = compat.lora_request_kwargs(fields, name="a@1", engine_id=5, path="/x")
    assert kwargs == {"lora_name": "a@1", "lora_int_id": 5, "lora_path": "/x"}
    assert set(kwargs) <= set(fields)


def test_the_installed_vllm_matches_a_known_layout():
    import vllm
    from vllm.lora.request import LoRARequest

    assert compat.features(vllm.__version__).prefix_cache_key_has_path
    kwargs = compat.lora_request_kwargs(LoRARequest.__struct_fields__, name="a@1", engine_id=5, path="/x")
    assert LoRARequest(**kwargs).lora_int_id == 5


def test_the_install_self_check_starts_the_engine_with_a_lora():
    """`python -m loractld.selfcheck` is what an offline bundle runs after installing."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "loractld.selfcheck", "--device", "cpu"], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "selfcheck: vllm 0.32.0 on cpu" in result.stdout and result.stdout.rstrip().endswith(": ok")


_SEAM_CHECK = """
import importlib, inspect
from loractld.engine import compat
offered = dict(engine_client=None, models=None, request_logger=None, chat_template=None, online_renderer=None,
               **{name: None for name in ("chat_template_content_format", "response_role", "tool_parser",
                                          "reasoning_parser", "enable_auto_tools", "tool_server")})
for route, (module, name, method, protocol, request) in compat._SERVING_CLASSES.items():
    cls = getattr(importlib.import_module(module), name)
    assert callable(getattr(cls, method)), (route, method)
    assert getattr(importlib.import_module(protocol), request) is not None, (route, request)
    assert set(compat.serving_kwargs(cls, offered)) <= set(inspect.signature(cls.__init__).parameters)
print("ok", len(compat._SERVING_CLASSES))
"""


def test_the_serving_seam_builds_every_class_of_the_installed_vllm():
    """Every vLLM serving class the HTTP door uses imports from where the seam says, and takes
    the arguments loractl offers with none left missing (a release that adds a required one
    fails here, by name, not at a user's first request). In a process of its own, as the
    daemon imports them: vLLM's entrypoints import setuptools' distutils shim, which refuses
    to load after another test has imported the standard library's distutils."""
    import subprocess
    import sys

    checked = subprocess.run([sys.executable, "-c", _SEAM_CHECK], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and checked.stdout.startswith("ok 6"), checked.stderr[-3000:]


def test_the_serving_seam_names_a_required_argument_it_does_not_know():
    class Future:
        def __init__(self, engine_client, *, hologram_renderer, request_logger=None):
            pass

    with pytest.raises(EngineUnavailable, match="hologram_renderer"):
        compat.serving_kwargs(Future, {"engine_client": 1, "request_logger": None, "extra": 2})
    assert compat.serving_kwargs(Future, {"engine_client": 1, "hologram_renderer": 2, "extra": 3}) == \
        {"engine_client": 1, "hologram_renderer": 2}


def test_a_handler_refusal_is_recognized_where_0_26_keeps_error_response(monkeypatch):
    """vLLM 0.26 defines ``ErrorResponse`` in ``vllm.entrypoints.openai.engine.protocol`` (0.32:
    ``serve.engine.protocol``); a 0.26-shaped vLLM, faked in ``sys.modules``, must still have a
    handler's refusal answered with its code, and a rendering refusal be an InvalidRequest's cause,
    instead of every rendered request failing on the import."""
    import sys
    import types

    class ErrorInfo:
        def __init__(self, code):
            self.code, self.message = code, "bad"

    class ErrorResponse:
        def __init__(self, code):
            self.error = ErrorInfo(code)

        def model_dump(self, mode):
            return {"error": {"code": self.error.code, "message": self.error.message}}

    old = types.ModuleType("vllm.entrypoints.openai.engine.protocol")
    old.ErrorResponse = ErrorResponse
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.serve.engine.protocol", None)   # absent in 0.26
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.engine.protocol", old)
    compat.error_response_type.cache_clear()
    try:
        assert compat.error_response_type() is ErrorResponse
        answer = compat.serving_answer(ErrorResponse(404), lambda status, body=None, stream=None: (status, body))
        assert answer == (404, {"error": {"code": 404, "message": "bad"}})
    finally:
        compat.error_response_type.cache_clear()


def test_the_engine_request_count_reads_the_output_processor_where_0_26_asyncllm_has_no_count():
    """0.26's ``AsyncLLM`` has no ``get_num_unfinished_requests`` (0.32 added it, over its
    ``OutputProcessor``'s, which both have): /health, Status and the metrics must still count."""
    import types

    processor = types.SimpleNamespace(get_num_unfinished_requests=lambda: 3)
    llm_026 = types.SimpleNamespace(output_processor=processor)
    llm_032 = types.SimpleNamespace(output_processor=processor, get_num_unfinished_requests=lambda: 5)
    assert compat.unfinished_requests(llm_026) == 3
    assert compat.unfinished_requests(llm_032) == 5
