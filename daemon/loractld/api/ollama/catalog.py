"""``GET /api/tags``, ``GET /api/ps`` and ``POST /api/show``: the base model and every stored
adapter, in Ollama's shapes, from the core's views (the tiers as the engine reports them).

- tags: every model there is, with size on disk, a digest of its files, when it was pulled,
  and ``details`` (family, parameter size, the adapter's base as ``parent_model``);
- ps: what the engine holds: the base model, and each adapter in host RAM (``size_vram`` 0) or
  in a device slot (``size_vram`` its size); ``expires_at`` is far in the future for the base
  model and pinned adapters, and absent for the others (the least-recently-used rule, not a
  clock, decides when they go);
- tags also lists each profile (its size: its adapter's, or the base model's; ``parent_model``:
  its FROM), and show of a profile gives its Modelfile, system prompt, template, parameters,
  few-shot messages and license (``show_profile``);
- show: details, the adapter's LoRA config and the model's sampling defaults as
  ``parameters``, the chat template, ``model_info`` (context length, parameter count, LoRA
  config) and ``capabilities``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from loractld.api.ollama.names import base_listed_name, listed_name

if TYPE_CHECKING:
    from loractld.core import Core
    from loractld.views import AdapterView

FOREVER = "9999-12-31T23:59:59Z"
# loractl's sampling defaults' names -> Ollama's parameter names.
_PARAMETER_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repeat_penalty"}


@dataclass(frozen=True)
class BaseFacts:
    """What the base model's folder says of it, read once (off the event loop)."""

    family: str = ""
    parameters: int = 0
    size: int = 0
    template: str = ""
    modified: float = 0.0


def read_base_facts(folder: str, parameters: int) -> BaseFacts:
    path = Path(folder)
    if not path.is_dir():
        return BaseFacts(parameters=parameters)
    config = _json(path / "config.json")
    tokenizer = _json(path / "tokenizer_config.json")
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()]
    template = tokenizer.get("chat_template") or ""
    if not isinstance(template, str):   # a list of named templates: the default one
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
    if not template and (path / "chat_template.jinja").is_file():   # where newer transformers save it
        template = (path / "chat_template.jinja").read_text()
    return BaseFacts(family=str(config.get("model_type") or ""), parameters=parameters,
                     size=sum(p.stat().st_size for p in weights), template=template,
                     modified=max((p.stat().st_mtime for p in weights), default=0.0))


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def quantization_level(description: str) -> str:
    """Ollama's ``quantization_level`` for a quantized base, from the core's one-line description
    (``awq, 4-bit, groups of 128`` -> ``AWQ_4BIT``)."""
    words = [w for w in description.split(", ") if not w.startswith("groups")]
    return "_".join(w.replace("-", "").upper() for w in words)


def parameter_size(count: int) -> str:
    """``134515008`` -> ``"134.5M"``, as Ollama writes it."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}".rstrip("0").rstrip(".") + unit
    return str(count)


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


class Catalog:
    """The listings; the base model's facts are read at the first request that needs them."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._facts: BaseFacts | None = None

    async def facts(self) -> BaseFacts:
        if self._facts is None:
            catalog = self.core.catalog
            folder = catalog.base_model.model if catalog is not None else ""
            parameters = catalog.base_model.parameters() if catalog is not None else 0
            self._facts = await asyncio.to_thread(read_base_facts, folder, parameters)
        return self._facts

    @property
    def base_name(self) -> str:
        return base_listed_name(self.core.served_model_name or self.core.model_label)

    def _dtype(self) -> str:
        """The weights' type, as Ollama's quantization level (``F32``, ``BF16``)."""
        catalog = self.core.catalog
        if catalog is not None and catalog.base_model.quantization:
            return quantization_level(catalog.base_model.quantization)
        engine = self.core.engine
        dtype = str(engine.dtype).removeprefix("torch.") if engine is not None else ""
        return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype.upper())

    def details(self, facts: BaseFacts, adapter: AdapterView | None) -> dict:
        families = [facts.family] if facts.family else []
        return {"parent_model": self.base_name if adapter is not None else "", "format": "safetensors",
                "family": facts.family, "families": families + (["lora"] if adapter is not None else []),
                "parameter_size": parameter_size(facts.parameters) if facts.parameters else "",
                "quantization_level": self._dtype()}

    async def tags(self) -> dict:
        facts = await self.facts()
        adapters = await self.core.list_adapters()
        profiles = await self.core.list_profiles()
        stored = {a.name for a in adapters} | {p.name for p in profiles}
        models = [self._entry(self.base_name, facts.size, self._base_digest(), iso(facts.modified or
                                                                               self.core.started_wall),
                              self.details(facts, None))]
        owned = self.core.owned_adapters()   # a weighted profile's merge is listed as that profile only
        for a in adapters:
            if a.name in owned:
                continue
            models.append(self._entry(listed_name(a.name, stored), a.size_bytes, digest(a), iso(a.pulled_at),
                                      self.details(facts, a)))
        by_name = {a.name: a for a in adapters}
        for p in profiles:
            runs = by_name.get(p.profile.adapter)
            made = self.core.profile_of(p.name)
            listed = (made.listed_as if made is not None else "") or listed_name(p.name, stored)
            models.append(self._entry(listed, runs.size_bytes if runs else facts.size,
                                      profile_digest(p), iso(p.pulled_at), self.profile_details(facts, p, stored)))
        return {"models": models}

    def profile_details(self, facts: BaseFacts, profile: AdapterView, stored: set[str]) -> dict:
        """A profile's details: its FROM as ``parent_model``; ``lora`` among its families when it
        runs an adapter."""
        made_of = profile.profile
        parent = self.base_name if made_of.base in self.core.base_model_names() else listed_name(made_of.base, stored)
        details = self.details(facts, profile if made_of.adapter else None)
        return {**details, "parent_model": parent}

    async def show_profile(self, profile: AdapterView, adapter: AdapterView | None) -> dict:
        """``/api/show`` of a profile: its adapter's (or the base model's) answer, with the
        profile's Modelfile (as ``loractl show --modelfile`` prints it), system prompt, template,
        parameters, few-shot messages and license."""
        made_of = profile.profile
        out = await self.show(adapter)
        stored = {a.name for a in await self.core.list_adapters()} | {p.name for p in await self.core.list_profiles()}
        parameters = {k: json.loads(v) for k, v in made_of.parameters.items()}
        lines = [f"{k:<30} {json.dumps(v) if k == 'stop' else v}" for k, values in parameters.items()
                 for v in (values if isinstance(values, list) else [values])]
        out.update({"modelfile": made_of.modelfile, "parameters": "\n".join(lines),
                    "license": "\n".join(made_of.license), "messages": list(made_of.messages),
                    "details": self.profile_details(await self.facts(), profile, stored),
                    "modified_at": iso(profile.pulled_at)})
        if made_of.system is not None:
            out["system"] = made_of.system
        if made_of.template is not None:
            out["template"] = made_of.template
        return out

    async def ps(self) -> dict:
        facts = await self.facts()
        adapters = await self.core.list_adapters()
        stored = {a.name for a in adapters}
        engine = self.core.engine
        on_gpu = engine is not None and str(engine.device).startswith("cuda")
        context = engine.max_model_len if engine is not None else None
        models = []
        if engine is not None:
            base = self._entry(self.base_name, facts.size, self._base_digest(), None, self.details(facts, None))
            models.append({**base, "expires_at": FOREVER, "size_vram": facts.size if on_gpu else 0,
                           "context_length": context})
        for a in adapters:
            if a.tier not in ("host", "device"):
                continue
            size = a.host_bytes or a.size_bytes
            entry = self._entry(listed_name(a.name, stored), size, digest(a), None, self.details(facts, a))
            entry.update(size_vram=size if a.tier == "device" else 0, context_length=context)
            if a.pinned:
                entry["expires_at"] = FOREVER
            models.append(entry)
        return {"models": models}

    def capabilities(self) -> list[str]:
        """``completion``, and ``tools`` when the model may call tools on its own (Ollama's
        tools have no ``tool_choice``: vLLM's ``--enable-auto-tool-choice`` and a parser)."""
        engine = self.core.engine
        served = getattr(engine.settings, "openai", None) if engine is not None else None
        tools = bool(getattr(served, "enable_auto_tool_choice", False) and getattr(served, "tool_call_parser", None))
        return ["completion"] + (["tools"] if tools else [])

    async def show(self, adapter: AdapterView | None) -> dict:
        facts = await self.facts()
        engine = self.core.engine
        template = (getattr(engine.settings, "chat_template", None) if engine is not None else None) or facts.template
        defaults = await self.core.sampling_defaults()
        parameters = {_PARAMETER_NAMES[k]: v for k, v in defaults.items() if k in _PARAMETER_NAMES}
        info = {"general.architecture": facts.family, "general.parameter_count": facts.parameters,
                "general.basename": self.core.model_label}
        if facts.family and engine is not None:
            info[f"{facts.family}.context_length"] = engine.max_model_len
        source = f"FROM {self.base_name}"
        if adapter is not None:
            lora = {"rank": adapter.rank, "alpha": adapter.alpha, "target_modules": adapter.target_modules,
                    "base_model": adapter.base_model, "source": adapter.source, "ref": adapter.ref,
                    "revision": adapter.revision}
            parameters.update({f"lora_{k}": v for k, v in lora.items() if k in ("rank", "alpha")})
            parameters["lora_target_modules"] = ",".join(adapter.target_modules)
            info.update({f"lora.{k}": v for k, v in lora.items()})
            source += f"\nADAPTER {adapter.path}"
        lines = "\n".join(f"{k:<30} {v}" for k, v in parameters.items())
        modelfile = f"# Modelfile of a loractl model\n{source}\n" + \
            "".join(f"PARAMETER {k} {v}\n" for k, v in parameters.items() if not k.startswith("lora_")) + \
            (f'TEMPLATE """{template}"""\n' if template else "")
        modified = adapter.pulled_at if adapter is not None else (facts.modified or self.core.started_wall)
        return {"license": "", "modelfile": modelfile, "parameters": lines, "template": template,
                "details": self.details(facts, adapter), "model_info": info, "capabilities": self.capabilities(),
                "modified_at": iso(modified)}

    def _base_digest(self) -> str:
        catalog = self.core.catalog
        where = catalog.base_model.model if catalog is not None else self.core.served_model_name
        return hashlib.sha256(f"{self.base_name}\0{where}".encode()).hexdigest()

    @staticmethod
    def _entry(name: str, size: int, digest_: str, modified: str | None, details: dict) -> dict:
        entry = {"name": name, "model": name, "size": size, "digest": digest_, "details": details}
        if modified is not None:
            entry["modified_at"] = modified
        return entry


def profile_digest(profile: AdapterView) -> str:
    """A digest of what a profile is: its Modelfile and its adapter's content."""
    return hashlib.sha256(f"{profile.profile.modelfile}\0{profile.profile.digest}".encode()).hexdigest()


def digest(adapter: AdapterView) -> str:
    """A digest of the adapter's content (its files' sha256), as Ollama gives a model's."""
    text = "".join(f"{f['name']}\0{f['sha256']}\n" for f in sorted(adapter.files, key=lambda f: f["name"]))
    return hashlib.sha256(text.encode()).hexdigest()
