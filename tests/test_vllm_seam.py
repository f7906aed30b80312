"""The vLLM seam (issue 46, item 3): every vLLM internal loractl relies on is listed in
``loractld.worker.vllm_seam`` and checked at start. The installed vLLM passes; a vLLM where one
listed internal was renamed (a stub: the real class with the name moved) is refused naming it,
with the installed version and the supported range; a daemon on such a vLLM exits at start
with that message; and the code touches no private name of vLLM's that the seam does not list."""

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
RANGE = "loractl supports vLLM 0.26 to 0.32"


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
    # OpenAIServingChat.warmup is 0.26's (0.32 moved it to the renderer): not asked of 0.32, and
    # asked of 0.26, where the installed 0.32 code lacks it.
    old = vllm_seam.entry("OpenAIServingChat.warmup")
    assert old.until < vllm_seam.parse_version(version)[:2] and vllm_seam._problem(old) == "is gone"
    vllm_seam.check()
    assert "OpenAIServingChat.warmup" in _refusal(version="0.26.0")


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
    assert "vLLM 0.33.1 is not supported (loractl supports vLLM 0.26 to 0.32)" in _refusal(version="0.33.1")
    assert "vLLM 0.25.0 is not supported" in _refusal(version="0.25.0")


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
NOT_VLLM = {"_exit": "os._exit (plugin.py)", "_init_amx": "torch.cpu._init_amx, optional (cpu_fixes.py)"}


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
