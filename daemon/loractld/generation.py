"""A generation request on its way through the daemon: as a door hands it to the core
(:class:`GenerationRequest`), checked and tokenized (:class:`Prepared`), and the errors and
checks of that step. Plain data and pure functions; the doors reach them through ``core``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loractl.errors import AdapterNotFound
from loractld.engine.sampling import Sampling

if TYPE_CHECKING:
    from loractld.core.policy import Caller
    from loractld.store.identity import AdapterRef
    from loractld.store.leases import Lease


@dataclass
class GenerationRequest:
    """One completion. Exactly one of ``prompt`` (tokenized as is), ``prompt_token_ids`` or
    ``messages`` (rendered with the model's chat template)."""

    prompt: str = ""
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    lora: str = ""                  # a store name, or an absolute adapter folder; "" is the base model
    # max_tokens None: whatever the context leaves after the prompt (what vLLM's server does).
    sampling: Sampling = field(default_factory=Sampling)
    allow_folders: bool = True      # False for network clients: they may name stored adapters only
    # Who asked, as the door knows them: the core decides what they may change (core.policy) —
    # a folder, an auto-pull. None: an unknown caller, who may generate from stored adapters only.
    caller: Caller | None = None
    # The sampling fields the caller set itself (a profile's defaults fill the others); None:
    # the door cannot tell, and a field at its default counts as not set.
    given_sampling: frozenset[str] | None = None


@dataclass
class Prepared:
    """A checked, tokenized request, ready for :meth:`Core.run`."""

    adapter: AdapterRef | None
    name: str | None                # the store name, when the adapter came from the store
    prompt_ids: list[int]
    sampling: Sampling
    # Holds the adapter's folder from resolve to the request's end (copies share it; it goes
    # when the last copy does, so a request prepared and never run cannot keep it for good).
    lease: Lease | None = None
    # vLLM's rendered request and its SamplingParams (loractld.engine.vllm_requests.Planned).
    planned: Any = None


class UnknownModel(AdapterNotFound):
    """A name that is neither the base model nor a stored adapter; ``close_matches`` may help."""

    def __init__(self, name: str, close_matches: list[str]) -> None:
        # With a close match the name was most likely misspelt: no advice to pull under it.
        hint = (f"Did you mean {' or '.join(repr(m) for m in close_matches)}? loractl ls lists the store; "
                "loractl pull REF --name NAME adds one."
                if close_matches else f"Pull it first: loractl pull REF --name {name} (loractl ls lists the store).")
        super().__init__(f"no adapter named {name!r} in the store", hint)
        self.name = name
        self.close_matches = close_matches
