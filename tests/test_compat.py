"""vLLM 0.26 through 0.32: each version path that loractl adapts, checked without a GPU."""

from __future__ import annotations

import pytest

from loractl.errors import EngineUnavailable
from loractld.engine import compat

FIELDS_026 = ("lora_name", "lora_int_id", "lora_path", "lora_local_path", "long_lora_max_len",
              "base_model_name", "tensorizer_config_dict")
FIELDS_032 = ("lora_name", "lora_int_id", "lora_path", "base_model_name", "load_inplace", "is_3d_lora_weight")


@pytest.mark.parametrize("version, has_path, flashinfer", [
    ("0.26.0", False, True), ("0.27.1", False, False), ("0.32.0", True, False), ("0.32.0+cpu", True, False),
])
def test_supported_versions(version, has_path, flashinfer):
    f = compat.features(version)
    assert f.prefix_cache_key_has_path is has_path and f.flashinfer_sampler_default is flashinfer


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "1.0.0"])
def test_unsupported_versions_are_refused_with_a_hint(version):
    with pytest.raises(EngineUnavailable, match="not supported") as info:
        compat.features(version)
    assert "pip install" in info.value.hint


@pytest.mark.parametrize("fields", [FIELDS_026, FIELDS_032], ids=["0.26", "0.32"])
def test_lora_request_keywords_fit_both_layouts(fields):
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
