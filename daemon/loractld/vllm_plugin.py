"""The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts.

Inert unless loractld's engine asked for it through the environment, so a plain vLLM in the
same environment (a benchmark baseline, say) is left exactly as it is:
- ``LORACTL_ENGINE=1``: attach loractl's worker methods (``worker_ext``);
- ``LORACTL_VLLM_CPU_FIXES=1``: install the CPU fixes (``cpu_fixes``).
"""

from __future__ import annotations

import os

ENGINE_FLAG = "LORACTL_ENGINE"


def register() -> None:
    if os.environ.get(ENGINE_FLAG) == "1":
        from loractld import worker_ext

        worker_ext.install()
    from loractld import cpu_fixes

    if os.environ.get(cpu_fixes.ENV_FLAG) == "1":
        cpu_fixes.install()
