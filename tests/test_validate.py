"""Validation and the store without a daemon: checks that need injected faults or no engine."""

from __future__ import annotations

import errno
import shutil

import pytest

from adapter_factory import broken, good
from loractl.errors import InvalidAdapter
from loractl.names import default_name, validate_name
from loractld.store.disk import DiskFull, Store
from loractld.store.validate import base_model_shapes, validate_adapter


def check(folder, demo, **kw):
    return validate_adapter(folder, max_lora_rank=16, base_shapes=base_model_shapes(demo / "model"),
                            model_names={"loractl/demo-tiny-llama"}, **kw)


def test_good_adapter_passes(demo, tmp_path):
    facts = check(good(demo, tmp_path / "ok"), demo)
    assert facts.rank == 8 and len(facts.target_modules) == 7


def test_size_cap(demo, tmp_path):
    folder = good(demo, tmp_path / "big")
    with pytest.raises(InvalidAdapter, match="over the cap"):
        check(folder, demo, max_weights_bytes=1000)


def test_base_model_names_match_by_last_component(demo, tmp_path):
    folder = broken("other_base_model", demo, tmp_path / "x")
    facts = validate_adapter(folder, max_lora_rank=16, model_names={"/models/Llama-3.1-8B"})
    assert facts.base_model == "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize("name", ["sql-expert/v1", "a", "a.b_c-d/0"])
def test_valid_names(name):
    assert validate_name(name) == name


def test_default_names():
    assert default_name("Org/My_Adapter") == "org/my_adapter"
    assert default_name("org/repo", "sub/dir") == "org/repo-sub-dir"


def test_disk_full_before_download(tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100, 10))
    with pytest.raises(DiskFull, match="not enough disk space"):
        store.check_free_space(1 << 20)


def test_disk_full_during_install_loses_nothing(demo, tmp_path, monkeypatch):
    """ENOSPC while installing a new revision: the old one stays, nothing half-written shows."""
    store = Store(tmp_path / "store")
    manifest = {"files": [{"name": "adapter_config.json", "size": 1, "sha256": "x"}]}
    with store.staging() as staged:
        good(demo, staged)
        old = store.install("keep/v1", staged, manifest)

    import loractld.store.disk as store_module

    real_rename = store_module.os.rename

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    with store.staging() as staged:
        good(demo, staged, name="other")
        monkeypatch.setattr(store_module.os, "rename", full)
        with pytest.raises(DiskFull):
            store.install("keep/v1", staged, {**manifest, "revision": "new"})
        monkeypatch.setattr(store_module.os, "rename", real_rename)
    assert store.get("keep/v1").path == old.path and old.path.exists()
    assert not any(store.tmp.iterdir())


def test_recover_removes_interrupted_pulls(demo, tmp_path):
    store = Store(tmp_path / "store")
    (store.tmp / "half").mkdir()
    (store.tmp / "half" / "adapter_model.safetensors").write_bytes(b"partial")
    (store.objects / "orphan").mkdir()
    removed = store.recover()
    assert len(removed) == 2 and not any(store.tmp.iterdir()) and not any(store.objects.iterdir())


def test_third_party_sources_plug_in_through_entry_points(monkeypatch, demo, tmp_path):
    """A source registered under the `loractl.sources` entry-point group is consulted after
    local folders and before the Hub (a stand-in EntryPoint: installing a distribution just
    for this test would prove nothing more)."""
    from importlib.metadata import EntryPoint

    from loractld.store import sources

    class S3Source(sources.LocalFolderSource):
        name = "s3"

        def accepts(self, ref):
            return ref.startswith("s3://")

    monkeypatch.setattr(sources, "entry_points", lambda group: [
        EntryPoint(name="s3", value="test_validate:S3Source", group=group)] if group == sources.ENTRY_POINT_GROUP else [])
    globals()["S3Source"] = S3Source
    found = sources.load_sources()
    assert [s.name for s in found] == ["local", "s3", "hf"]
    assert sources.pick_source(found, "s3://bucket/adapter").name == "s3"
    assert sources.pick_source(found, "org/repo").name == "hf"


def corpus_adapter(demo, tmp_path, name: str):
    import peft_corpus

    case = next(c for c in peft_corpus.CASES if c.name == name)
    peft_corpus.build(case, demo / "model", tmp_path / name)
    return tmp_path / name


def test_a_rank_pattern_adapter_passes_with_its_largest_rank(demo, tmp_path):
    facts = check(corpus_adapter(demo, tmp_path, "rank-pattern"), demo, force=True)
    assert facts.rank == 8  # rank_pattern's q_proj, above r=4


def test_weights_that_contradict_the_rank_pattern_name_it(demo, tmp_path):
    import json

    folder = corpus_adapter(demo, tmp_path, "rank-pattern")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["rank_pattern"] = {"down_proj": 3, "q_proj": 8}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidAdapter, match=r"down_proj' has rank 2/2, but the config \(its rank_pattern\) says 3"):
        check(folder, demo, force=True)


def test_an_embedding_lora_for_a_resized_vocabulary_is_refused_as_added_tokens(demo, tmp_path):
    import torch

    from adapter_factory import replace_tensors

    folder = corpus_adapter(demo, tmp_path, "embeddings")

    def grow(tensors):
        key = "base_model.model.model.embed_tokens.base_layer.weight"
        tensors[key] = torch.cat([tensors[key], torch.zeros(4, tensors[key].shape[1])])
    replace_tensors(folder, grow)
    with pytest.raises(InvalidAdapter, match="added tokens"):
        check(folder, demo, force=True)


@pytest.mark.parametrize("key, needle", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "LoRA bias"),
    ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", "trainable-tokens"),
    ("base_model.model.lm_head.weight", "a whole module's weights"),
])
def test_tensors_of_unservable_features_are_named_even_when_the_config_hides_them(demo, tmp_path, key, needle):
    import torch

    from adapter_factory import replace_tensors

    folder = replace_tensors(good(demo, tmp_path / "x"), lambda t: t.__setitem__(key, torch.zeros(4, 4)))
    with pytest.raises(InvalidAdapter, match=needle):
        check(folder, demo)


def test_normalising_renames_keys_and_keeps_every_weight_bit_identical(demo, tmp_path):
    import torch
    from safetensors.torch import load_file

    from loractld.store.normalize import normalize_folder

    folder = corpus_adapter(demo, tmp_path, "default-keys")
    before = load_file(folder / "adapter_model.safetensors")
    assert all(".default." in k for k in before)
    with pytest.raises(InvalidAdapter, match=r"not in PEFT's standard layout.*'\.default\.'"):
        check(folder, demo, force=True)  # a folder used in place is refused, with the pull as the way out
    assert normalize_folder(folder) == ["removed the adapter name '.default.' from the tensor keys"]
    after = load_file(folder / "adapter_model.safetensors")
    assert set(after) == {k.replace(".default.", ".") for k in before}
    assert all(torch.equal(after[k.replace(".default.", ".")], v) for k, v in before.items())
    check(folder, demo, force=True)
    assert normalize_folder(folder) == []  # already standard: untouched


def test_weights_of_two_adapters_are_refused_not_merged(demo, tmp_path):
    from adapter_factory import replace_tensors
    from loractld.store.normalize import normalize_folder

    def two_names(tensors):
        for key in list(tensors):
            tensors[key.replace(".lora_A.", ".lora_A.one.").replace(".lora_B.", ".lora_B.one.")] = tensors.pop(key)
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.two.weight"] = \
            tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.one.weight"].clone()
    folder = replace_tensors(good(demo, tmp_path / "x"), two_names)
    with pytest.raises(InvalidAdapter, match=r"several adapters \(one, two\)"):
        normalize_folder(folder)


def test_base_model_shapes_unknown_at_start_are_read_once_the_engine_has_the_model(demo):
    """A Hub id not yet in the cache has no files when the catalog opens: the shapes are read
    after the engine's start instead of staying unknown (and the checks off) for good."""
    from loractld.models.basemodel import BaseModel, refresh_shapes

    info = BaseModel(model=str(demo / "model"), names={"org/not-downloaded-yet"})
    refresh_shapes(info)
    assert info.shapes == base_model_shapes(demo / "model")
    assert "loractl/demo-tiny-llama" in info.names and "org/not-downloaded-yet" in info.names


def _poison(dtype, value):
    def mutate(tensors):
        import torch

        key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[0]
        for k in tensors:
            tensors[k] = tensors[k].to(dtype)
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value
    return mutate


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_weight_that_is_not_finite_is_refused(demo, tmp_path, dtype_name, value):
    """One NaN or inf in the file (a diverged float16 run) is refused with the tensor named:
    served, such an adapter changed other clients' answers (issue 37, finding 2)."""
    import torch

    from adapter_factory import replace_tensors

    folder = replace_tensors(good(demo, tmp_path / "p"), _poison(getattr(torch, dtype_name), value))
    with pytest.raises(InvalidAdapter, match=r"holds 1 value\(s\) that are not finite") as refused:
        check(folder, demo)
    assert "lora_B.weight" in refused.value.message and "retrain" in refused.value.hint


def test_weights_beyond_half_precision_are_refused_and_large_finite_ones_pass(demo, tmp_path):
    """Finite in the file, overflowing in the engine: float32's largest (3.4e38), as a reviewer
    found served and changing other clients' answers; 60000 (float16 holds it) passes."""
    import torch

    from adapter_factory import replace_tensors

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        folder = replace_tensors(good(demo, tmp_path / f"ok-{dtype}"), _poison(dtype, 60000.0))
        assert check(folder, demo).rank == 8
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        folder = replace_tensors(good(demo, tmp_path / f"big-{dtype}"), _poison(dtype, torch.finfo(dtype).max))
        with pytest.raises(InvalidAdapter, match="beyond what half precision holds"):
            check(folder, demo)


def test_integer_weights_and_huge_integer_alphas_are_refused_in_one_line(demo, tmp_path):
    import torch

    from adapter_factory import edit_config, replace_tensors

    def to_int8(tensors):
        for k in tensors:
            tensors[k] = tensors[k].to(torch.int8)

    with pytest.raises(InvalidAdapter, match="is I8: LoRA weights are floating point"):
        check(replace_tensors(good(demo, tmp_path / "i8"), to_int8), demo)
    folder = good(demo, tmp_path / "bigint")
    (folder / "adapter_config.json").write_text(
        (folder / "adapter_config.json").read_text().replace('"lora_alpha": 16', '"lora_alpha": 1' + "0" * 400))
    with pytest.raises(InvalidAdapter, match="not a finite number"):
        check(folder, demo)
    with pytest.raises(InvalidAdapter, match="not a finite number"):
        check(edit_config(good(demo, tmp_path / "bigpat"), alpha_pattern={"q_proj": 10 ** 400}), demo)


def test_a_header_over_the_cap_is_refused_without_echoing_the_files_first_bytes(tmp_path):
    """The header length is the file's first 8 bytes: a refusal naming it leaked them (a symlink
    to a root-only file, through a daemon that reads it)."""
    import struct as _struct

    from loractld.store.validate import MAX_HEADER_BYTES, read_safetensors_header

    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"root:*:2" + b"x" * 100)
    with pytest.raises(InvalidAdapter) as refused:
        read_safetensors_header(secret)
    assert str(_struct.unpack("<Q", b"root:*:2")[0]) not in refused.value.message
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(_struct.pack("<Q", MAX_HEADER_BYTES + 1) + b" " * (MAX_HEADER_BYTES + 1))
    with pytest.raises(InvalidAdapter, match="over the 8 MiB"):
        read_safetensors_header(huge)


@pytest.mark.parametrize("changes, fragment", [
    ({"lora_alpha": 1e38}, "beyond what half precision holds"),
    ({"lora_alpha": float("nan")}, "not a finite number"),
    ({"lora_alpha": "16"}, "not a finite number"),
    ({"alpha_pattern": {"q_proj": 1e9}}, "alpha_pattern['q_proj']"),
    ({"lora_alpha": 600000, "use_rslora": False}, "beyond what half precision holds"),
])
def test_a_scaling_that_overflows_half_precision_is_refused(demo, tmp_path, changes, fragment):
    from adapter_factory import edit_config

    folder = edit_config(good(demo, tmp_path / "s"), **changes)
    with pytest.raises(InvalidAdapter) as refused:
        check(folder, demo)
    assert fragment in refused.value.message


def test_rslora_scaling_uses_the_square_root(demo, tmp_path):
    from adapter_factory import edit_config

    # 150000 / sqrt(8) = 53033: within float16 with rsLoRA, over it without (150000 / 8 = 18750 is within too)
    assert check(edit_config(good(demo, tmp_path / "r"), lora_alpha=150000, use_rslora=True), demo).rank == 8
    with pytest.raises(InvalidAdapter, match="beyond"):
        check(edit_config(good(demo, tmp_path / "r2"), lora_alpha=200000, use_rslora=True), demo)
