"""What the core answers with: plain data, the same whichever front end asked.

The field names are the wire protocol's (``loractl/v1/loractl.proto``), so the gRPC servicer
copies them field for field and the HTTP app renders them as JSON; a field added here and in
the .proto reaches both doors.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Protocol


class Stored(Protocol):
    """What a view reads of a stored adapter (``store.disk.StoredAdapter``): said here, since
    this module is on the base floor and knows no store (tests/test_layout.py)."""

    name: str
    manifest: dict
    size_bytes: int
    path: object
    hand_placed: bool


@dataclass
class ProfileView:
    """What a profile is made of (``loractld.store.profiles.Profile``), as the wire says it."""

    base: str = ""
    adapter: str = ""           # "": the base model
    digest: str = ""
    adapters: list[dict] = field(default_factory=list)    # {"name", "weight"}: the ADAPTER lines
    system: str | None = None
    template: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)   # Ollama's names; values as JSON
    messages: list[dict] = field(default_factory=list)    # {"role", "content"}
    license: list[str] = field(default_factory=list)
    modelfile: str = ""
    created_at: float = 0.0


@dataclass
class MergeView:
    """How a merged adapter was made (``loractl merge``): its sources ({"name", "digest",
    "weight", "revision"}: the source's content digest, and its revision as ``ls`` shows it),
    the method (cat: exact; svd: approximate) and, for svd, the measured relative
    Frobenius error of its delta."""

    method: str = ""
    sources: list[dict] = field(default_factory=list)
    rank: int = 0
    relative_error: float = 0.0

    @classmethod
    def of(cls, merged: dict | None) -> MergeView | None:
        if not isinstance(merged, dict):
            return None
        return cls(method=str(merged.get("method", "")), rank=int(merged.get("rank") or 0),
                   relative_error=float(merged.get("relative_error") or 0),
                   sources=[{"name": s["name"], "digest": s["digest"], "weight": float(s["weight"]),
                             "revision": str(s.get("revision") or "")} for s in merged.get("sources", [])])


@dataclass
class AdapterView:
    """One stored adapter: its manifest, and its residency as the engine last reported it."""

    name: str
    source: str = ""
    ref: str = ""
    revision: str = ""
    base_model: str = ""
    rank: int = 0
    alpha: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    size_bytes: int = 0
    pulled_at: float = 0.0
    files: list[dict] = field(default_factory=list)    # {"name", "size", "sha256"}
    path: str = ""
    hand_placed: bool = False
    state: str = "ready"        # ready, loading, failed (see error), checking (not validated yet)
    error: str = ""
    tier: str = "disk"          # device, host or disk: what the engine really holds
    pinned: bool = False
    slot: int = -1
    last_used: float = 0.0
    requests: int = 0
    host_bytes: int = 0
    pin: str = ""               # device, host, or "" (not pinned)
    normalized: list[str] = field(default_factory=list)   # key spellings the pull rewrote
    kind: str = "adapter"       # or "profile": then ``profile`` says what it is made of
    profile: ProfileView | None = None
    merge: MergeView | None = None   # a merged adapter: what it was made of

    def copy(self) -> AdapterView:
        """A shallow copy (lists shared): a listing's per-ask copy of a view made once, which
        remembers that view as ``base`` (a door may keep what it made of the base: fields the
        copy holds other values in are all that differ)."""
        clone = object.__new__(AdapterView)
        clone.__dict__.update(self.__dict__)
        clone.__dict__["base"] = self
        return clone

    def changes(self) -> dict | None:
        """The fields this copy (:meth:`copy`) holds other objects in than its base, by identity
        (a copy shares every value it did not set); None for a view that is not a copy."""
        fields = self.__dict__
        base = fields.get("base")
        if base is None:
            return None
        base_fields = base.__dict__
        # A copy's fields are its base's, in its base's order, then "base": compared pairwise in
        # C first (most copies of a large listing changed nothing; the dict cost 28 ms at 10,000).
        if len(fields) == len(base_fields) + 1 and not any(map(operator.is_not, fields.values(),
                                                               base_fields.values())):
            return {}
        return {k: v for k, v in fields.items() if base_fields.get(k) is not v and k != "base"}

    @classmethod
    def of(cls, adapter: Stored) -> AdapterView:
        m = adapter.manifest
        targets = m.get("target_modules") or []
        return cls(
            name=adapter.name, source=m.get("source", ""), ref=m.get("ref", ""), revision=m.get("revision", ""),
            base_model=m.get("base_model") or "", rank=int(m.get("rank") or 0), alpha=float(m.get("alpha") or 0),
            target_modules=targets if isinstance(targets, list) else [str(targets)],
            size_bytes=adapter.size_bytes, pulled_at=float(m.get("pulled_at") or 0),
            files=[{"name": f["name"], "size": f["size"], "sha256": f["sha256"]} for f in m.get("files", [])],
            path=str(adapter.path), hand_placed=adapter.hand_placed, normalized=list(m.get("normalized") or []),
            merge=MergeView.of(m.get("merge")),
        )


@dataclass
class EngineConfigView:
    model: str = ""             # the folder (or Hub id) vLLM serves
    device: str = ""
    dtype: str = ""
    max_loras: int = 0
    max_cpu_loras: int = 0
    max_lora_rank: int = 0
    max_model_len: int = 0
    vllm_version: str = ""
    kv_cache_bytes: int = 0
    max_num_seqs: int = 0
    model_name: str = ""        # what users know it by: the Hub id, a GGUF's Hub id or file (models/naming.py)
    model_arg: str = ""         # --model as given: demo, a .gguf file, a folder, a Hub id
    engine_args_json: str = ""  # the engine settings in effect, a JSON object under vLLM's names
    choices: list = field(default_factory=list)   # EngineChoiceView: what loractld chose for the device
    quantization: str = ""      # the base model's quantization as vLLM loaded it ("" for none)


@dataclass
class EngineChoiceView:
    name: str = ""              # vLLM's field name
    value: str = ""
    why: str = ""


@dataclass
class CapacityView:
    device_slots: int = 0
    device_used: int = 0
    host_slots: int = 0
    host_used: int = 0
    pins: int = 0
    max_pins: int = 0
    max_lora_rank: int = 0
    disk_adapters: int = 0
    disk_bytes: int = 0
    device_pins: int = 0
    max_device_pins: int = 0


@dataclass
class RequestView:
    """A generation the daemon holds: waiting at the admission gate, or in the engine."""

    id: str
    adapter: str                # "" for the base model
    state: str                  # queued or running
    position: int = 0           # 1-based place in the waiting line; 0 once running
    waited_s: float = 0.0       # at the gate: so far while queued, in all once running
    age_s: float = 0.0          # since it arrived


@dataclass
class AdapterQueueView:
    adapter: str
    running: int = 0            # requests in the engine
    queued: int = 0             # requests waiting for a place
    oldest_wait_s: float = 0.0  # how long its oldest waiting request has waited (0: none waits)


@dataclass
class AdmissionView:
    policy: str = ""
    places: int = 0             # device slots (max_loras)
    pinned: int = 0             # places held by device pins
    active: int = 0             # places held by unpinned adapters with requests in the engine
    queued: int = 0
    max_wait_s: float = 0.0     # the bound in force before an adapter hands its slot over
    requests: list[RequestView] = field(default_factory=list)
    adapters: list[AdapterQueueView] = field(default_factory=list)   # the longest-waiting first
    handover_s: float = 0.0     # measured: a turn's first request, grant to first token (0: none yet)
    service_s: float = 0.0      # measured: a request, grant to end (0: none yet)
    mode: str = ""              # passthrough (every request enters at once) or holding
    mode_reason: str = ""       # why, in words: "1 device pin: vLLM alone would evict it mid-step"


@dataclass
class StartupView:
    """What a starting daemon is doing (``loractld.startup``); empty once ready."""

    stage: str = ""             # fetch, convert, train, model, engine; "" when not starting
    message: str = ""           # the stage in words: "training demo adapter pirate/v1"
    done: float = 0.0           # progress in ``unit``s (for the engine: seconds so far)
    total: float = 0.0          # 0 where unknown (for the engine: the previous start's seconds)
    unit: str = ""              # bytes, tensors, steps, s
    detail: str = ""            # e.g. "loss 1.234"
    elapsed_s: float = 0.0      # in this stage
    eta_s: float = 0.0          # estimated seconds left in this stage; 0 where unknown


@dataclass
class StatusView:
    version: str
    pid: int
    socket: str
    home: str
    ready: bool
    uptime_s: float
    engine_start_s: float
    engine: EngineConfigView
    requests_in_flight: int
    capacity: CapacityView
    http: str = ""              # the HTTP API's base URL, when it is on
    admission: AdmissionView = field(default_factory=AdmissionView)
    startup: StartupView = field(default_factory=StartupView)
    state: str = ""             # starting, ready, asleep (--keep-alive), waking, stopping


@dataclass
class RemovedView:
    adapter: AdapterView
    unloaded: bool
