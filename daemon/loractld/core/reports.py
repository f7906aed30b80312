"""What :class:`loractld.core.core.Core` reports of itself: ``status`` (the engine's
configuration, its capacity, the admission queue, start-up progress) and ``metrics_text``
(Prometheus text). Read-only, and apart from the request path: nothing here changes state
beyond the metrics' gauges it refreshes.

A part of ``Core`` (a base class of it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from loractl import __version__
from loractld.core.state import engine_died
from loractld.models.naming import relabel_model
from loractld.serving.signals import scheduler_series
from loractld.views import (AdapterQueueView, AdmissionView, CapacityView, EngineChoiceView, EngineConfigView,
                            RequestView, StartupView, StatusView)


class Reports:
    # -- status ---------------------------------------------------------------------------
    async def status(self) -> StatusView:
        engine, tiers, catalog = self.engine, self.tiers, self.catalog
        config, capacity = EngineConfigView(), CapacityView()
        if engine is not None:
            s = engine.settings
            config = EngineConfigView(model=s.model, device=engine.device, dtype=engine.dtype, max_loras=s.max_loras,
                                      max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank,
                                      max_model_len=engine.max_model_len, vllm_version=engine.vllm_version,
                                      kv_cache_bytes=engine.kv_cache_bytes or 0, max_num_seqs=engine.max_num_seqs,
                                      model_name=self.model_label, model_arg=self.model_name.asked
                                      if self.model_name else "",
                                      engine_args_json=json.dumps(engine.engine_args, sort_keys=True),
                                      choices=[EngineChoiceView(c.name, ", ".join(map(str, c.value)) if isinstance(c.value, list) else str(c.value),
                                                               c.why) for c in engine.choices],
                                      quantization=str(engine.engine_args.get("quantization") or ""))
        if engine is not None and tiers is not None and catalog is not None:
            self._refuse_if_engine_dead(engine)
            try:
                state = await tiers.sync()
            except Exception as e:
                # vLLM's EngineDeadError (not imported here) can come before its monitor flags
                # the engine as errored.
                if type(e).__name__ == "EngineDeadError" or engine.errored:
                    raise engine_died() from e
                raise
            stored = await asyncio.to_thread(catalog.store.list)
            capacity = CapacityView(
                device_slots=state.device_capacity, device_used=len(state.device), host_slots=state.host_capacity,
                host_used=len(state.host), pins=len(tiers.state.pins), max_pins=tiers.max_pins,
                device_pins=len(tiers.state.device_pins), max_device_pins=tiers.max_device_pins,
                max_lora_rank=engine.settings.max_lora_rank, disk_adapters=len(stored),
                disk_bytes=sum(a.size_bytes for a in stored))
        return StatusView(version=__version__, pid=os.getpid(), socket=self.socket_path, home=self.home,
                          ready=self.ready, state=self.engine_state(), uptime_s=time.monotonic() - self.started,
                          engine_start_s=engine.start_seconds if engine else 0.0, engine=config,
                          requests_in_flight=self.requests_in_flight, capacity=capacity, http=self.http_url,
                          admission=self._admission_view(),
                          startup=self.startup.view() if not self.started_up and self.startup_error is None
                          else StartupView())

    def engine_state(self) -> str:
        """starting, ready, asleep (given back after ``--keep-alive`` idle, or falling asleep),
        waking (a request woke it), stopping; failed when the engine could not start."""
        if self.draining:
            return "stopping"
        if self.engine is None or not self.started_up:
            return "failed" if self.startup_error is not None else "starting"
        keep_alive = self.keep_alive
        if keep_alive is not None and keep_alive.asleep:
            return "waking" if keep_alive.state == "waking" else "asleep"
        return "ready"

    def _admission_view(self) -> AdmissionView:
        gate = self.gate
        if gate is None:
            return AdmissionView()
        now = gate.clock()
        requests = [RequestView(id=t.id, adapter=t.label, state="running" if t.admitted is not None else "queued",
                                position=gate.position(t), waited_s=t.wait_s if t.admitted is not None else now - t.arrived,
                                age_s=now - t.arrived) for t in gate.tickets.values()]
        measured = gate.measured
        mode, mode_reason = gate.mode()
        return AdmissionView(mode=mode, mode_reason=mode_reason, policy=gate.policy.name, places=gate.places, pinned=len(gate.pinned),
                             active=len(gate.unpinned_active()), queued=len(gate.queue),
                             max_wait_s=float(gate.policy.bound()) if hasattr(gate.policy, "bound") else 0.0, requests=requests,
                             adapters=[AdapterQueueView(q.label, q.running, q.queued, q.oldest_wait_s)
                                       for q in gate.adapter_queues()],
                             handover_s=measured.handover_s or 0.0, service_s=measured.service_s or 0.0)

    async def metrics_text(self) -> str:
        """Prometheus text: the tiers' counters and gauges, the disk tier, then vLLM's own."""
        if self.engine is not None:
            # Read before the tier sync below, which can wait for engine steps.
            self.metrics.set("loractl_engine_requests", (), self.engine.unfinished_requests())
        if self.gate is not None:
            depth = self.gate.queued_by_adapter()
            for labels in list(self.metrics.gauges.get("loractl_admission_queue_depth", {})):
                self.metrics.set("loractl_admission_queue_depth", labels, 0)  # drained since the last read
            for label, queued in depth.items():
                self.metrics.set("loractl_admission_queue_depth", (("adapter", label),), queued)
            for labels in list(self.metrics.gauges.get("loractl_admission_oldest_wait_seconds", {})):
                self.metrics.set("loractl_admission_oldest_wait_seconds", labels, 0)  # none waits now
            for q in self.gate.adapter_queues():
                if q.queued:
                    self.metrics.set("loractl_admission_oldest_wait_seconds", (("adapter", q.label),), q.oldest_wait_s)
            measured = self.gate.measured
            for what, value in (("handover", measured.handover_s), ("service", measured.service_s)):
                if value is not None:
                    self.metrics.set("loractl_admission_measured_seconds", (("what", what),), value)
        if self.tiers is not None:
            await self.tiers.sync()
        if self.catalog is not None:
            stored = await asyncio.to_thread(self.catalog.store.list)
            self.metrics.set("loractl_tier_bytes", (("tier", "disk"),), sum(a.size_bytes for a in stored))
            self.metrics.set("loractl_tier_adapters", (("tier", "disk"),), len(stored))
        if self.engine is None:
            return self.metrics.render()
        # What routers score this daemon by, counted at the gate and named as clients name them.
        return self.metrics.render() + scheduler_series(
            self.gate, self.engine.settings.max_loras,
            relabel_model(self.engine.prometheus_text(), self.engine.settings.model, self.model_label),
            self.model_label)
