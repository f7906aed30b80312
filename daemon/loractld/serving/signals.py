"""What schedulers in front of this daemon read from its metrics: the load and the adapters,
counted where loractl holds requests, named as clients name them.

llm-d's endpoint picker (the Gateway API Inference Extension's scheduler) and similar routers
score a model server from three of vLLM's series (notes/fleet.md):

- ``vllm:lora_requests_info``: a gauge whose *value is a timestamp* (the newest series wins),
  labels ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated names, as
  requests name them in ``model``) and ``max_lora``;
- ``vllm:num_requests_waiting`` and ``vllm:num_requests_running``.

vLLM's own values are wrong for loractl: a request waiting at the admission gate has not reached
the engine, so vLLM counts neither it nor its adapter, and vLLM names adapters by the engine's
internal name (``pirate/v1@d2043e03e6f78d69``). A router reading them would send more requests for
a queued adapter here and never see that this server already runs it.

Invariants:
- A request is *waiting* while it is queued at the gate or admitted but waiting in vLLM's
  scheduler; *running* while vLLM runs it. Every request is counted once.
- ``running_lora_adapters``: adapters the gate has admitted requests of (they hold a device place);
  ``waiting_lora_adapters``: adapters with requests queued at the gate and none admitted. Names are
  the user-facing ones (the gate's ticket labels), never the engine's.
- vLLM's own series of these three names are replaced, not repeated: a scraper never sees two
  answers to one question.
"""

from __future__ import annotations

import re
import time

from loractld.serving.admission import Gate

REPLACED = ("vllm:lora_requests_info", "vllm:num_requests_waiting", "vllm:num_requests_running")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _engine_values(engine_text: str) -> tuple[dict[str, float], str]:
    """The engine's waiting/running counts (summed over its engines), and its text without the
    series this module replaces."""
    values = {"vllm:num_requests_waiting": 0.0, "vllm:num_requests_running": 0.0}
    kept = []
    for line in engine_text.splitlines():
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[2] in REPLACED:
                continue
            kept.append(line)
            continue
        match = _SAMPLE.match(line)
        if match and match.group("name") in REPLACED:
            if match.group("name") in values:
                try:
                    values[match.group("name")] += float(match.group("value"))
                except ValueError:
                    pass
            continue
        kept.append(line)
    return values, "\n".join(kept) + ("\n" if kept else "")


def scheduler_series(gate: Gate | None, max_loras: int, engine_text: str, model_name: str) -> str:
    """The three series a scheduler reads (see the module), then the rest of ``engine_text``."""
    engine, rest = _engine_values(engine_text)
    running: list[str] = []
    waiting: list[str] = []
    queued = 0
    if gate is not None:
        for ticket in gate.tickets.values():
            if ticket.key is None:
                continue
            target = running if ticket.admitted is not None else waiting
            if ticket.label not in target:
                target.append(ticket.label)
        waiting = [label for label in waiting if label not in running]
        queued = len(gate.queue)
    # vLLM's running count is what its scheduler runs; its waiting count is what it holds back.
    # The gate's queue comes on top: vLLM never saw those requests.
    model = _escape(model_name)
    lines = [
        "# HELP vllm:num_requests_waiting Requests waiting: queued at loractl's admission gate or in vLLM's scheduler.",
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{model_name="{model}"}} {engine["vllm:num_requests_waiting"] + queued:g}',
        "# HELP vllm:num_requests_running Requests running in the engine.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="{model}"}} {engine["vllm:num_requests_running"]:g}',
        "# HELP vllm:lora_requests_info Adapters with requests admitted (running) and queued (waiting), by the names "
        "clients use; the value is when this was read.",
        "# TYPE vllm:lora_requests_info gauge",
        f'vllm:lora_requests_info{{max_lora="{max_loras}",running_lora_adapters="{_escape(",".join(sorted(running)))}",'
        f'waiting_lora_adapters="{_escape(",".join(sorted(waiting)))}"}} {time.time():.6f}',
    ]
    return "\n".join(lines) + "\n" + rest
