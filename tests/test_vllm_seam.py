"""The vLLM seam (issue 46, item 3): every vLLM internal loractl relies on is listed in
``loractld.worker.vllm_seam`` and checked at start. The installed vLLM passes; a vLLM where one
listed internal was renamed (a stub: the real class with the name moved) is refused naming it,
with the installed version and the supported range; a daemon on such a vLLM exits at start
with that message; and the code touches no private name of vLLM's that the seam does not list.

vLLM 0.33 is read, not run (no CPU wheel of it): ``IN_033`` is where each entry is in 0.33.0's
source, a table made by reading the wheel (tests/vllm_source.py resolved each entry, and each was
read there); with ``LORACTL_VLLM_SOURCE_033`` set to the unpacked wheel the table is checked
against that source, and the source reader itself is checked against the installed vLLM here."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loractl.errors import EngineUnavailable
from loractld.worker import cpu_fixes, vllm_seam

PKG = Path(__file__).resolve().parent.parent / "daemon" / "loractld"
RANGE = "loractl supports vLLM 0.26 to 0.33"


IN_OWN_PROCESS = "LORACTL_SEAM_TEST_IN_OWN_PROCESS"


def own_process(test):
    """Run ``test`` in a pytest process of its own: the vLLM modules it imports pull in
    setuptools' distutils shim, which refuses to load once another test of the session has
    imported the standard library's distutils (as tests/test_compat.py found; here in a clean
    clone's full run). The daemon imports them in a fresh process too."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if os.environ.get(IN_OWN_PROCESS):
            return test(*args, **kwargs)
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                 f"{__file__}::{test.__name__}"], env={**os.environ, IN_OWN_PROCESS: "1"},
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return wrapper


@pytest.fixture(scope="module")
def version() -> str:
    import vllm

    return vllm.__version__


@own_process
def test_the_installed_vllm_passes_and_every_entry_resolves(version):
    vllm_seam.check()
    installed = vllm_seam.parse_version(version)[:2]
    applies = [e for e in vllm_seam.SEAM if e.since <= installed <= e.until]
    assert [e.dotted for e in applies if vllm_seam._problem(e) is not None] == []
    assert {e.kind for e in vllm_seam.SEAM} == {vllm_seam.PATCHED, vllm_seam.CALLED, vllm_seam.READ}
    assert all(e.read_in and e.why for e in vllm_seam.SEAM)


@own_process
def test_an_entry_is_checked_only_in_its_releases(version):
    # OpenAIServingChat.warmup is 0.26's (0.27 moved it to the renderer): not asked of 0.32, and
    # asked of 0.26, where the installed 0.32 code lacks it. Nor of 0.27 to 0.31, which have only the
    # renderer's (read in their wheels; it was asked of them before, and refused every one of them).
    old = vllm_seam.entry("OpenAIServingChat.warmup")
    assert old.until < vllm_seam.parse_version(version)[:2] and vllm_seam._problem(old) == "is gone"
    vllm_seam.check()
    assert "OpenAIServingChat.warmup" in _refusal(version="0.26.0")
    for newer in ("0.27.0", "0.31.0", "0.33.0"):
        vllm_seam.check(version=newer)


def _refusal(seam=vllm_seam.SEAM, version=None) -> str:
    with pytest.raises(EngineUnavailable) as caught:
        vllm_seam.check(seam, version)
    message = caught.value.message
    assert "\n" not in message
    return message


def _rename(monkeypatch, owner: type, name: str) -> None:
    """The stub of an upstream rename: ``name`` moves to ``name + "_v2"`` on the real class (and
    off every class of its MRO that holds it, so nothing inherits it)."""
    value = inspect.getattr_static(owner, name)
    for cls in owner.__mro__:
        if name in cls.__dict__:
            monkeypatch.delattr(cls, name)
    monkeypatch.setattr(owner, name + "_v2", value, raising=False)


@own_process
def test_a_renamed_patched_method_is_refused_naming_it_with_version_and_range(monkeypatch, version):
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    _rename(monkeypatch, LRUCacheWorkerLoRAManager, "_load_adapter")
    message = _refusal()
    assert f"vLLM {version} is refused: vllm.lora.worker_manager.LRUCacheWorkerLoRAManager._load_adapter" in message
    assert "is gone" in message and RANGE in message and "read in vLLM 0.32.0" in message


@own_process
def test_a_renamed_module_function_and_a_changed_signature_are_refused(monkeypatch, version):
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.delattr(punica_cpu, "bgmv_expand")
    assert "vllm.lora.punica_wrapper.punica_cpu.bgmv_expand" in _refusal()
    monkeypatch.undo()

    def execute_model(self, sched_output):  # the parameter renamed upstream
        return None

    monkeypatch.setattr(Worker, "execute_model", execute_model)
    message = _refusal()
    assert "vllm.v1.worker.gpu_worker.Worker.execute_model" in message
    assert "takes (sched_output), not (scheduler_output)" in message


def test_a_renamed_instance_attribute_is_refused(tmp_path, monkeypatch):
    """An attribute vLLM sets in ``__init__`` is seen in the class's source: present while the
    class assigns it, refused once it assigns another name."""
    package = tmp_path / "vllm_stub_seam"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = vllm_seam.Internal("vllm_stub_seam.manager:Manager", "_registered_adapters", vllm_seam.READ, "a stub")
    for assigned, refused in (("_registered_adapters", False), ("_host_adapters", True)):
        (package / "manager.py").write_text(textwrap.dedent(f"""
            class Base:
                def __init__(self):
                    self.{assigned} = {{}}

            class Manager(Base):
                pass
        """))
        sys.modules.pop("vllm_stub_seam.manager", None)
        vllm_seam._assigned.cache_clear()
        if refused:
            message = _refusal((entry,), "0.32.0")
            assert "vllm_stub_seam.manager.Manager._registered_adapters" in message and RANGE in message
            assert "neither on the class nor set by it" in message
        else:
            vllm_seam.check((entry,), "0.32.0")
    vllm_seam._assigned.cache_clear()


def test_a_vllm_outside_the_range_is_refused_before_its_internals_are_read():
    assert "vLLM 0.34.0 is not supported (loractl supports vLLM 0.26 to 0.33)" in _refusal(version="0.34.0")
    assert "vLLM 0.25.0 is not supported" in _refusal(version="0.25.0")
    vllm_seam.check((), "0.33.0")   # admitted: the range's newest
    vllm_seam.check((), "0.33.2")


def test_an_entry_required_only_from_a_later_release_is_not_asked_of_an_older_one():
    moved = vllm_seam.Internal("vllm.envs", "no_such_name", vllm_seam.CALLED, "a stub", since=(0, 32))
    vllm_seam.check((moved,), "0.26.0")
    assert "vllm.envs.no_such_name" in _refusal((moved,), "0.32.0")


def test_the_cpu_ops_patch_what_the_seam_lists_with_vllms_parameters():
    """cpu_fixes takes its targets from the seam, and each replacement takes vLLM's parameters."""
    patched = cpu_fixes.install_lora_ops() or []
    for module, name in vllm_seam.targets("cpu_ops"):
        assert getattr(module, name) is cpu_fixes.REPLACEMENTS[name]
        seam_entry = next(e for e in vllm_seam.SEAM if e.group == "cpu_ops" and e.name == name)
        assert tuple(inspect.signature(cpu_fixes.REPLACEMENTS[name]).parameters) == seam_entry.params
    assert len(vllm_seam.targets("cpu_ops")) == 18 and len(patched) in (0, 18)


# -- the list cannot drift from the code -----------------------------------------------------------
# Private names of others than vLLM's that engine/ and worker/ use, each with why it is not vLLM's.
NOT_VLLM = {"_exit": "os._exit (plugin.py)", "_init_amx": "torch.cpu._init_amx, optional (cpu_fixes.py)",
            # argparse's own (engine_flags.py reads the parser vLLM's add_cli_args filled)
            "_actions": "argparse.ArgumentParser._actions", "_StoreTrueAction": "argparse._StoreTrueAction",
            "_StoreFalseAction": "argparse._StoreFalseAction", "_search_keyword":
            "vLLM's FlexibleArgumentParser._search_keyword, set for loractld --help=KEYWORD only: were it renamed, "
            "the help would list vLLM's groups instead (engine_flags.print_help), nothing else changes",
            "_compile_jinja_template": "jinja2's (template_child.py)"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_by_loractl() -> set[str]:
    """Every name loractl's own code defines or assigns anywhere in the daemon package."""
    names: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _private_uses(source: str) -> set[str]:
    """Private attribute names read in ``source``: ``x._name`` and ``getattr(x, "_name")``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr):
            used.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            used.add(node.args[1].value)
    return used


def test_every_private_name_of_vllms_that_the_code_reads_is_in_the_seam():
    defined = _defined_by_loractl()
    listed = {e.name for e in vllm_seam.SEAM}
    unlisted = {}
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).parts[0] in ("engine", "worker"):
            for name in _private_uses(path.read_text()) - defined - listed - set(NOT_VLLM):
                unlisted.setdefault(name, []).append(str(path.relative_to(PKG)))
    assert unlisted == {}, f"private names read from vLLM but not in vllm_seam.SEAM: {unlisted}"
    # The scan sees a planted read of a private vLLM name, and the seam's own names pass.
    assert _private_uses("mgr._lora_slots_v2\ngetattr(w, '_runner')") - defined == {"_lora_slots_v2", "_runner"}
    assert {"_registered_adapters", "_load_adapter", "_unpin", "_adapter_manager"} <= listed


def test_a_daemon_on_a_vllm_whose_internal_moved_exits_at_start_naming_it(home, tmp_path, version):
    """A sitecustomize on the daemon's PYTHONPATH renames ``_load_adapter`` (a stub of an upstream
    rename): the daemon exits at start, before vLLM's engine starts, with the seam's one-line
    refusal in its log and in what ``loractl status`` says."""
    from conftest import BIN, run_cli
    from support_daemons import ENGINE_FLAGS, sub_home
    from test_errors import assert_one_error

    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(textwrap.dedent("""
        from vllm.lora.worker_manager import WorkerLoRAManager

        WorkerLoRAManager._load_adapter_v2 = WorkerLoRAManager._load_adapter
        del WorkerLoRAManager._load_adapter
    """))
    root = sub_home(home, "seam")
    log = root / "d.log"
    with open(log, "wb") as out:
        daemon = subprocess.run([str(BIN / "loractld"), "--model", "tiny", "--home", str(root), *ENGINE_FLAGS], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(stub)}, timeout=180)
    text = log.read_text(errors="replace")
    moved = "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager._load_adapter"
    assert daemon.returncode == 1, text[-3000:]
    assert f"vLLM {version} is refused: {moved}" in text and RANGE in text, text[-3000:]
    assert "engine up in" not in text and "Traceback" not in text
    assert_one_error(run_cli("status", "--home", str(root)), 3, "loractld exited", moved, RANGE)


# -- vLLM 0.33.0: read, not run --------------------------------------------------------------------
# Where each entry asked of 0.33 is in vLLM 0.33.0's source (the wheel's, unpacked: vllm/...py:line
# of the def, field or ``self.NAME =`` that makes it). A table, not a check of a 0.33 install: made
# with tests/vllm_source.py from the wheel and read there entry by entry (docs/vllm-releases.md says
# what changed). It fails when an entry is added, or made to apply to 0.33, without a 0.33 reading.
IN_033 = {
    "vllm.config.parallel.ParallelConfig.worker_extension_cls": "vllm/config/parallel.py:309",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.set_active_adapters": "vllm/lora/worker_manager.py:194",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.add_adapter": "vllm/lora/worker_manager.py:288",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.remove_adapter": "vllm/lora/worker_manager.py:234",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.pin_adapter": "vllm/lora/worker_manager.py:191",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.remove_all_adapters": "vllm/lora/worker_manager.py:237",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager._load_adapter": "vllm/lora/worker_manager.py:106",
    "vllm.lora.model_manager.LoRAModelManager.activate_adapter": "vllm/lora/model_manager.py:355",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager._adapter_manager": "vllm/lora/worker_manager.py:270",
    "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager.embedding_modules": "vllm/lora/worker_manager.py:43",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager._registered_adapters": "vllm/lora/model_manager.py:114",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager._active_adapters": "vllm/lora/model_manager.py:117",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager.lora_index_to_id": "vllm/lora/model_manager.py:121",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager.capacity": "vllm/lora/model_manager.py:343",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager.lora_slots": "vllm/lora/model_manager.py:348",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager.modules": "vllm/lora/model_manager.py:133",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager.deactivate_adapter": "vllm/lora/model_manager.py:1386",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager._create_merged_loras_inplace":
        "vllm/lora/model_manager.py:849",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager._get_lora_layer_weights": "vllm/lora/model_manager.py:1231",
    "vllm.lora.model_manager.LRUCacheLoRAModelManager.create_dummy_lora": "vllm/lora/model_manager.py:648",
    "vllm.utils.cache.LRUCache.order": "vllm/utils/cache.py:89",
    "vllm.utils.cache.LRUCache.cache": "vllm/utils/cache.py:81",
    "vllm.utils.cache.LRUCache.pinned_items": "vllm/utils/cache.py:55",
    "vllm.utils.cache.LRUCache.pin": "vllm/utils/cache.py:177",
    "vllm.utils.cache.LRUCache._unpin": "vllm/utils/cache.py:185",
    "vllm.lora.layers.base.BaseLayerWithLoRA.reset_lora": "vllm/lora/layers/base.py:81",
    "vllm.v1.worker.gpu_worker.Worker.model_runner": "vllm/v1/worker/gpu_worker.py:565",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.lora_manager": "vllm/v1/worker/lora_model_runner_mixin.py:53",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.lora_manager": "vllm/v1/worker/lora_model_runner_mixin.py:53",
    "vllm.v1.worker.gpu_worker.Worker.execute_model": "vllm/v1/worker/gpu_worker.py:1334",
    "vllm.v1.worker.gpu_worker.Worker.cache_config": "vllm/v1/worker/worker_base.py:71",
    "vllm.config.cache.CacheConfig.num_gpu_blocks": "vllm/config/cache.py:333",
    "vllm.config.cache.CacheConfig.block_size": "vllm/config/cache.py:187",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.kv_caches": "vllm/v1/worker/gpu_model_runner.py:581",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.kv_caches": "vllm/v1/worker/gpu/model_runner.py:812",
    "vllm.v1.core.sched.output.SchedulerOutput.scheduled_new_reqs": "vllm/v1/core/sched/output.py:236",
    "vllm.v1.core.sched.output.SchedulerOutput.scheduled_cached_reqs": "vllm/v1/core/sched/output.py:240",
    "vllm.v1.core.sched.output.NewRequestData.block_ids": "vllm/v1/core/sched/output.py:47",
    "vllm.v1.core.sched.output.NewRequestData.num_computed_tokens": "vllm/v1/core/sched/output.py:48",
    "vllm.v1.core.sched.output.CachedRequestData.req_ids": "vllm/v1/core/sched/output.py:139",
    "vllm.v1.core.sched.output.CachedRequestData.new_block_ids": "vllm/v1/core/sched/output.py:150",
    "vllm.v1.core.sched.output.CachedRequestData.num_computed_tokens": "vllm/v1/core/sched/output.py:151",
    "vllm.v1.core.sched.output.CachedRequestData.resumed_req_ids": "vllm/v1/core/sched/output.py:143",
    "vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink": "vllm/lora/ops/torch_ops/lora_ops.py:77",
    "vllm.lora.ops.torch_ops.lora_ops.bgmv_expand": "vllm/lora/ops/torch_ops/lora_ops.py:24",
    "vllm.lora.ops.torch_ops.lora_ops.bgmv_expand_slice": "vllm/lora/ops/torch_ops/lora_ops.py:124",
    "vllm.lora.ops.torch_ops.lora_ops.sgmv_shrink": "vllm/lora/ops/torch_ops/lora_ops.py:60",
    "vllm.lora.ops.torch_ops.lora_ops.sgmv_expand": "vllm/lora/ops/torch_ops/lora_ops.py:7",
    "vllm.lora.ops.torch_ops.lora_ops.sgmv_expand_slice": "vllm/lora/ops/torch_ops/lora_ops.py:97",
    "vllm.lora.ops.torch_ops.bgmv_shrink": "vllm/lora/ops/torch_ops/lora_ops.py:77",
    "vllm.lora.ops.torch_ops.bgmv_expand": "vllm/lora/ops/torch_ops/lora_ops.py:24",
    "vllm.lora.ops.torch_ops.bgmv_expand_slice": "vllm/lora/ops/torch_ops/lora_ops.py:124",
    "vllm.lora.ops.torch_ops.sgmv_shrink": "vllm/lora/ops/torch_ops/lora_ops.py:60",
    "vllm.lora.ops.torch_ops.sgmv_expand": "vllm/lora/ops/torch_ops/lora_ops.py:7",
    "vllm.lora.ops.torch_ops.sgmv_expand_slice": "vllm/lora/ops/torch_ops/lora_ops.py:97",
    "vllm.lora.punica_wrapper.punica_cpu.bgmv_shrink": "vllm/lora/ops/torch_ops/lora_ops.py:77",
    "vllm.lora.punica_wrapper.punica_cpu.bgmv_expand": "vllm/lora/ops/torch_ops/lora_ops.py:24",
    "vllm.lora.punica_wrapper.punica_cpu.bgmv_expand_slice": "vllm/lora/ops/torch_ops/lora_ops.py:124",
    "vllm.lora.punica_wrapper.punica_cpu.sgmv_shrink": "vllm/lora/ops/torch_ops/lora_ops.py:60",
    "vllm.lora.punica_wrapper.punica_cpu.sgmv_expand": "vllm/lora/ops/torch_ops/lora_ops.py:7",
    "vllm.lora.punica_wrapper.punica_cpu.sgmv_expand_slice": "vllm/lora/ops/torch_ops/lora_ops.py:97",
    "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU.add_lora_logits":
        "vllm/lora/punica_wrapper/punica_cpu.py:313",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner._get_prompt_logprobs_dict":
        "vllm/v1/worker/gpu_model_runner.py:5245",
    "vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase.sampler_indices":
        "vllm/lora/punica_wrapper/punica_base.py:263",
    "vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase.token_lora_indices":
        "vllm/lora/punica_wrapper/punica_base.py:255",
    "vllm.v1.engine.async_llm.AsyncLLM.output_processor": "vllm/v1/engine/async_llm.py:180",
    "vllm.v1.engine.output_processor.OutputProcessor.external_req_ids": "vllm/v1/engine/output_processor.py:568",
    "vllm.v1.engine.output_processor.OutputProcessor.get_num_unfinished_requests":
        "vllm/v1/engine/output_processor.py:573",
    "vllm.v1.engine.async_llm.AsyncLLM.engine_core": "vllm/v1/engine/async_llm.py:193",
    "vllm.v1.engine.core_client.EngineCoreClient.abort_requests_async": "vllm/v1/engine/core_client.py:328",
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown": "vllm/v1/engine/async_llm.py:305",
    "vllm.lora.request.LoRARequest.lora_name": "vllm/lora/request.py:24",
    "vllm.lora.request.LoRARequest.lora_int_id": "vllm/lora/request.py:25",
    "vllm.lora.request.LoRARequest.lora_path": "vllm/lora/request.py:26",
    "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.render_chat_request":
        "vllm/entrypoints/openai/chat_completion/serving.py:264",
    "vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.render_completion_request":
        "vllm/entrypoints/openai/completion/serving.py:94",
    "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.default_sampling_params":
        "vllm/entrypoints/openai/chat_completion/serving.py:180",
    "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.override_max_tokens":
        "vllm/entrypoints/openai/chat_completion/serving.py:182",
    "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.online_renderer":
        "vllm/entrypoints/openai/chat_completion/serving.py:155",
    "vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.default_sampling_params":
        "vllm/entrypoints/openai/completion/serving.py:86",
    "vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.override_max_tokens":
        "vllm/entrypoints/openai/completion/serving.py:88",
    "vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.online_renderer":
        "vllm/entrypoints/openai/completion/serving.py:79",
    "vllm.entrypoints.serve.utils.api_utils.get_max_tokens": "vllm/entrypoints/serve/utils/api_utils.py:234",
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest.to_sampling_params":
        "vllm/entrypoints/openai/chat_completion/protocol.py:748",
    "vllm.entrypoints.openai.completion.protocol.CompletionRequest.to_sampling_params":
        "vllm/entrypoints/openai/completion/protocol.py:359",
    "vllm.renderers.online_renderer.OnlineRenderer.warmup": "vllm/renderers/online_renderer.py:212",
    "vllm.renderers.online_renderer.OnlineRenderer.validate_chat_template": "vllm/renderers/online_renderer.py:692",
    "vllm.renderers.hf.HfRenderer._apply_chat_template_async": "vllm/renderers/hf.py:1053",
    "vllm.renderers.hf.safe_apply_chat_template": "vllm/renderers/hf.py:868",
    "vllm.renderers.hf._try_extract_ast": "vllm/renderers/hf.py:567",
    "vllm.renderers.hf._cached_resolve_chat_template_kwargs": "vllm/renderers/hf.py:779",
    "vllm.renderers.hf.AssistantTracker": "vllm/renderers/hf.py:757",
    "vllm.inputs.engine.tokens_input": "vllm/inputs/engine.py:47",
    "vllm.envs.enable_envs_cache": "vllm/envs.py:2310",
    "vllm.utils.ompmultiprocessing.OMPProcessManager.configure_omp_envs": "vllm/utils/ompmultiprocessing.py:72",
}
# Entries not asked of 0.33 (their releases end before it), and why.
NOT_IN_033 = {"vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.warmup":
              "0.26's chat warm-up; from 0.27 on it is OnlineRenderer.warmup",
              "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.select_unquantized_moe_backend":
              "the 0.32 CPU wheel's MoE path only (no CPU wheel of 0.33; 0.33.0 has the same function, "
              "oracle/unquantized.py:222)"}
GONE_IN_033 = {"vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.warmup"}   # of NOT_IN_033
SOURCE_033 = "LORACTL_VLLM_SOURCE_033"   # the unpacked 0.33.0 wheel (the directory holding vllm/)
# Unpacked wheels of any releases (directories holding vllm/, separated by os.pathsep): every entry
# asked of each must be in it. Run with 0.26.0, 0.27.0, 0.27.1, 0.28.0 to 0.33.0 (docs/vllm-releases.md).
SOURCES = "LORACTL_VLLM_SOURCES"


def _asked_of(version: tuple[int, int]) -> list:
    return [e for e in vllm_seam.SEAM if e.since <= version <= e.until]


def test_every_entry_asked_of_0_33_was_read_in_0_33():
    asked = {e.dotted for e in _asked_of((0, 33))}
    assert set(IN_033) == asked, (f"read in 0.33 but not asked: {sorted(set(IN_033) - asked)}; "
                                  f"asked but not read: {sorted(asked - set(IN_033))}")
    assert set(NOT_IN_033) == {e.dotted for e in vllm_seam.SEAM} - asked and GONE_IN_033 <= set(NOT_IN_033)
    for e in vllm_seam.SEAM:
        assert ("0.33.0" in e.read_in) == (e.dotted in IN_033), e.dotted
    assert vllm_seam.SUPPORTED[1] == (0, 33) and vllm_seam.TESTED == (0, 32)


@pytest.mark.skipif(not os.environ.get(SOURCE_033), reason=f"{SOURCE_033} is not set (the unpacked 0.33.0 wheel)")
def test_the_0_33_table_is_what_the_0_33_source_says():
    import vllm_source

    source = vllm_source.Source(Path(os.environ[SOURCE_033]))
    assert vllm_source.version(source.root) == (0, 33, 0)
    for e in _asked_of((0, 33)):
        assert source.problem(e) is None, (e.dotted, source.problem(e))
        assert source.find(e.owner, e.name)[1] == IN_033[e.dotted], e.dotted
    for e in vllm_seam.SEAM:
        if e.dotted in GONE_IN_033:
            assert source.problem(e) == "is gone", e.dotted
    # The HTTP door's serving classes (engine/compat.py): each class, handler and request model is
    # where compat takes it from, and each constructor wants nothing that compat does not offer.
    from loractld.engine import compat

    offered = {"engine_client", "models", "request_logger", "chat_template", "online_renderer", "response_role",
               "chat_template_content_format", "model_config", "renderer"}
    for module, name, method, protocol, request in compat._SERVING_CLASSES.values():
        assert source.find(f"{module}:{name}", method) and source.top(protocol, request), (name, method, request)
        assert set(source.required(f"{module}:{name}")) <= offered, name
    assert set(source.required("vllm.renderers.online_renderer:OnlineRenderer")) <= offered


@pytest.mark.skipif(not os.environ.get(SOURCES), reason=f"{SOURCES} is not set (unpacked vLLM wheels)")
def test_every_entry_asked_of_each_release_is_in_its_source():
    import vllm_source

    for root in os.environ[SOURCES].split(os.pathsep):
        source = vllm_source.Source(Path(root))
        release = vllm_source.version(source.root)
        problems = [(e.dotted, source.problem(e)) for e in _asked_of(release[:2]) if source.problem(e)]
        assert problems == [], (release, problems)


def _installed_source_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")   # finds the package without importing it
    return Path(next(iter(spec.submodule_search_locations))).parent


def test_the_source_reader_agrees_with_the_installed_vllm():
    """tests/vllm_source.py, which made ``IN_033``, finds every entry asked of the installed vLLM in
    its source (as ``vllm_seam.check`` finds them by importing it, in the tests above) and finds the
    entry of the releases before it gone; it never imports vLLM."""
    import vllm_source

    root = _installed_source_root()
    version = vllm_source.version(root)[:2]
    source = vllm_source.Source(root)
    assert [(e.dotted, source.problem(e)) for e in _asked_of(version) if source.problem(e)] == []
    assert source.problem(vllm_seam.entry("OpenAIServingChat.warmup")) == "is gone"


def test_the_source_reader_refuses_a_renamed_name_and_a_changed_signature(tmp_path):
    """A stub source tree: a re-exported base class that sets an attribute, a method, a module
    function. The reader finds them through the re-export and the base, and refuses each once it
    is renamed or its parameters change."""
    import vllm_source

    pkg = tmp_path / "vllm"
    (pkg / "lora").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lora" / "__init__.py").write_text("from .base import Base as Base\n")

    def write(attr: str, params: str, function: str) -> vllm_source.Source:
        (pkg / "lora" / "base.py").write_text(textwrap.dedent(f"""
            class Base:
                def __init__(self):
                    self.{attr} = {{}}

                def _load_adapter(self, {params}):
                    pass

            def {function}(inputs, lora_b_weights):
                pass
        """))
        (pkg / "lora" / "manager.py").write_text("from vllm.lora import Base\n\nclass Manager(Base):\n    pass\n")
        return vllm_source.Source(tmp_path)

    read = vllm_seam.Internal("vllm.lora.manager:Manager", "_registered_adapters", vllm_seam.READ, "a stub")
    patched = vllm_seam.Internal("vllm.lora.manager:Manager", "_load_adapter", vllm_seam.PATCHED, "a stub",
                                 params=("lora_request",))
    function = vllm_seam.Internal("vllm.lora.base", "bgmv_shrink", vllm_seam.PATCHED, "a stub",
                                  params=("inputs", "lora_b_weights"))
    source = write("_registered_adapters", "lora_request", "bgmv_shrink")
    assert [source.problem(e) for e in (read, patched, function)] == [None, None, None]
    assert source.find(read.owner, read.name)[1] == "vllm/lora/base.py:4"
    source = write("_host_adapters", "request", "bgmv_shrink_v2")
    assert source.problem(read) == "is gone" and source.problem(function) == "is gone"
    assert source.problem(patched) == "takes (request), not (lora_request)"


# -- the guarded device copy under 0.32's and 0.33's order (worker/extension.py) ------------------
class _Layer:
    def __init__(self, fits: bool = True) -> None:
        self.fits, self.slots, self.zeroed = fits, {}, []

    def set_lora(self, index, lora_a, lora_b):
        if not self.fits and lora_a == "adapter-2":
            raise RuntimeError("The size of tensor a (64) must match the size of tensor b (32)")
        self.slots[index] = lora_a

    def reset_lora(self, index):
        self.slots[index] = None
        self.zeroed.append(index)


class _Manager:
    """Two device slots, slot 0 held by adapter 1; adapter 2's "v" layer does not fit its buffer."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self._active_adapters = {1: None}
        self.lora_index_to_id = [1, None]
        self._registered_adapters = {i: SimpleNamespace(id=i, weights=f"adapter-{i}") for i in (1, 2, 3)}
        self.modules = {"q": _Layer(), "v": _Layer(fits=False)}

    def _get_lora_layer_weights(self, lora_model, module_name):
        from types import SimpleNamespace

        return SimpleNamespace(lora_a=lora_model.weights, lora_b=None)


def _activate_0_33(self, lora_id):
    """vLLM 0.33.0's ``LoRAModelManager.activate_adapter`` (vllm/lora/model_manager.py:355), transcribed
    from the wheel with its order kept: the slot is recorded only after every layer's copy."""
    if lora_id in self._active_adapters:
        return False
    first_free_slot = next(((i, held) for i, held in enumerate(self.lora_index_to_id) if held is None), None)
    if first_free_slot is None:
        raise ValueError("No free lora slots")
    index, _ = first_free_slot
    lora_model = self._registered_adapters[lora_id]
    for module_name, module in self.modules.items():
        module_lora = self._get_lora_layer_weights(lora_model, module_name)
        module.set_lora(index, module_lora.lora_a, module_lora.lora_b)
    self._active_adapters[lora_id] = None
    self.lora_index_to_id[index] = lora_model.id
    return True


def _check_guarded_activate(activate, tmp_path, monkeypatch):
    import json

    from loractld.worker import extension

    journal = tmp_path / "broken.jsonl"
    monkeypatch.setenv(extension.BROKEN_JOURNAL, str(journal))
    guarded = extension._guarded_activate(activate)
    mgr = _Manager()
    assert guarded(mgr, 2) is True   # the failed copy does not raise into the step
    assert mgr.lora_index_to_id == [1, 2] and 2 in mgr._active_adapters   # the step's mapping finds it
    assert all(layer.zeroed == [1] and layer.slots[1] is None for layer in mgr.modules.values())
    assert [json.loads(line) for line in journal.read_text().splitlines()] == [
        {"id": 2, "error": "RuntimeError: The size of tensor a (64) must match the size of tensor b (32)"}]
    assert guarded(mgr, 2) is False   # already active: vLLM's own answer
    with pytest.raises(ValueError, match="No free lora slots"):   # the scheduler's invariant, not the adapter
        guarded(mgr, 3)
    with pytest.raises(KeyError):   # not in the host tier: not a copy that failed
        guarded(_Manager(), 9)
    assert len(journal.read_text().splitlines()) == 1
    good = _Manager()
    good.modules["v"].fits = True
    assert guarded(good, 2) is True and good.lora_index_to_id == [1, 2] and good.modules["v"].slots[1] == "adapter-2"


def test_a_failed_device_copy_is_journaled_and_zeroed_where_0_33_records_the_slot_after_it(tmp_path, monkeypatch):
    _check_guarded_activate(_activate_0_33, tmp_path, monkeypatch)


@own_process
def test_a_failed_device_copy_is_journaled_and_zeroed_where_0_32_records_the_slot_first(tmp_path, monkeypatch):
    """The installed vLLM's own ``activate_adapter`` (0.32: the slot recorded before the copy)."""
    from vllm.lora.model_manager import LoRAModelManager

    activate = LoRAModelManager.activate_adapter
    _check_guarded_activate(getattr(activate, "__wrapped__", activate), tmp_path, monkeypatch)
