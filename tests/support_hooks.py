"""Enables the suite's hook for loractld (tests/hooks_plugin) in the test process and in every
process it starts (daemons, vLLM's engine when it is a child, the CLI): imported first by
conftest, before anything imports loractld, since loractld looks for its hook once, when
``loractld.worker.hooks`` is first imported (in each process).

The hook is found as an installed package's entry point would be (``loractld.hooks`` in
``loractl_test_hooks-0.dist-info``), from a folder put on ``sys.path`` here and on PYTHONPATH for
the children: nothing is installed, and a loractl run outside the suite has no hook.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parent / "hooks_plugin"

if "loractld.worker.hooks" in sys.modules and str(PLUGIN) not in sys.path:
    raise RuntimeError("loractld.worker.hooks was imported before the suite's hook was enabled: "
                       "import support_hooks first (tests/conftest.py)")
if str(PLUGIN) not in sys.path:
    sys.path.insert(0, str(PLUGIN))
if str(PLUGIN) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN), os.environ.get("PYTHONPATH")]))
