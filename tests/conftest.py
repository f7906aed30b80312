"""The suite's fixtures, split by what they start (each module a plugin, registered below):

- ``support_daemons``: the session's home with the tiny demo, the session daemon, daemons of a
  test's own (``start_daemon``, ``own_daemon``), the CLI runner and ``collect``;
- ``support_rigs``: daemons that tests kill or arm hooks in (``rig``, ``hooked``);
- ``support_vllm_server``: vLLM's own OpenAI server beside the rig (``vllm_server``);
- ``support_reference``: the HF + PEFT oracle and the real demo's build (``real_demo``);
- ``support_background``: the pip-bound builds that start with the session and overlap the rest
  (the fresh venvs of test_first_run and test_wheel, test_install_resolves' dry runs).

Test modules import helpers from here (``from conftest import run_cli``) or from those modules.
"""

from __future__ import annotations

import os

import support_hooks  # noqa: F401 - first: enables the suite's hook for loractld (tests/hooks_plugin)
import pytest

# Rewritten asserts in the plugins too (their fixtures assert): registered before the imports
# below load them, else pytest finds them already imported and leaves their asserts plain.
pytest.register_assert_rewrite("support_daemons", "support_rigs", "support_vllm_server", "support_reference",
                               "support_background")
pytest_plugins = ["support_daemons", "support_rigs", "support_vllm_server", "support_reference", "support_background"]

# Under pytest-xdist (scripts/test.sh runs two workers on a 2-core machine), each worker's engines
# put their OpenMP thread on a core of their own: vLLM's default binds every engine to core 0.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and len(os.sched_getaffinity(0)) >= 2:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(sorted(os.sched_getaffinity(0))[
        int(_WORKER[2:]) % len(os.sched_getaffinity(0))]))

# The names test modules import from conftest: fixtures are not among them (pytest finds those in
# the plugins above; a fixture imported here would be registered twice).
from support_daemons import (  # noqa: E402
    BIN, ENGINE_FLAGS, REPO, Daemon, adapter_folder, collect, own_daemon, run_cli, sigint_as_at_a_terminal,
    start_daemon, sub_home)
from support_reference import REAL_DEMO_CACHE, Reference, add_bos  # noqa: E402
from support_rigs import CUDA_SPY, RIG_CONTEXT, RIG_SERVER_FLAGS, Hooked, Rig, SocketUsers  # noqa: E402
from support_vllm_server import ORACLE_ADAPTERS, VllmServer  # noqa: E402

__all__ = ["BIN", "CUDA_SPY", "ENGINE_FLAGS", "ORACLE_ADAPTERS", "REAL_DEMO_CACHE", "REPO", "RIG_CONTEXT",
           "RIG_SERVER_FLAGS", "Daemon", "Hooked", "Reference", "Rig", "SocketUsers", "VllmServer", "add_bos",
           "adapter_folder", "collect", "own_daemon", "run_cli", "sigint_as_at_a_terminal", "start_daemon",
           "sub_home"]
