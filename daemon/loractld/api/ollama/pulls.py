"""``POST /api/pull`` and ``DELETE /api/delete``: loractl's pull and rm, in Ollama's words.

What a pull's name may be:
- ``hf.co/ORG/REPO[:TAG]`` (Ollama's Hub integration; also ``huggingface.co/...``): the Hub
  repository, at the revision ``TAG`` (a branch, tag or commit; ``latest`` or none: the default
  branch), stored as ``loractl pull ORG/REPO`` stores it (``org/repo``, listed ``org:repo``);
- what ``loractl pull`` takes: ``ORG/REPO``, ``hf://ORG/REPO[@REV][/SUB]``, an absolute folder;
- a stored adapter's name (``sql-expert:v1``): pulled again from where it came from, as
  ``ollama pull`` updates a model.

The progress lines are Ollama's: ``pulling manifest``, one ``pulling FILE`` line per file with
``digest`` (the file's name: loractl checks each file's sha256 once it is down), ``total`` and
``completed``, ``verifying sha256 digest``, ``writing manifest``, ``success``. A failure after
the stream has begun is a last ``{"error": ...}`` line, as Ollama sends it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from loractld.api.ollama.names import hub_reference, resolve
from loractld.api.ollama.options import refusal

if TYPE_CHECKING:
    from loractld.core import Core


async def pull_ref(core: Core, name: str) -> tuple[str, str, str]:
    """(ref, revision, store name or "") for ``loractl pull`` of an Ollama model name."""
    if not isinstance(name, str) or not name.strip():
        raise refusal("model is required", "Name the model to pull, e.g. hf.co/ORG/REPO.", param="model")
    name = name.strip()
    hub = hub_reference(name)
    if hub is not None:
        return hub[0], hub[1], ""
    if os.path.isabs(name) or name.startswith("hf://"):
        return name, "", ""
    adapters = await core.list_adapters()
    target = resolve(name, core.base_model_names(), {a.name for a in adapters}.__contains__)
    if target is not None and target.adapter is None:
        raise refusal(f"{name!r} is the base model: it is loaded when the daemon starts",
                      "Pull an adapter (hf.co/ORG/REPO), or restart loractld with another --model.", param="model")
    if target is not None:
        stored = next(a for a in adapters if a.name == target.adapter)
        if not stored.ref:
            raise refusal(f"{name!r} was not pulled from a place it can be pulled from again",
                          "Pull it by its Hub reference (hf.co/ORG/REPO) or its folder.", param="model")
        return stored.ref, "", stored.name
    if name.count("/") == 1 and ":" not in name:
        return name, "", ""    # ORG/REPO, as loractl pull takes it
    raise refusal(f"{name!r} names no stored adapter and no Hub repository",
                  "Pull from the Hub as hf.co/ORG/REPO (or ORG/REPO), or from a folder by its absolute path; "
                  "Ollama's own library is not served.", status=404, param="model")


def progress_line(stage: str, file: str, done: int, total: int) -> dict | None:
    """A loractl pull event as Ollama's status line (None: no line for it)."""
    if stage == "resolving":
        return {"status": "pulling manifest"}
    if stage == "downloading":
        return {"status": f"pulling {file}", "digest": file, "total": total, "completed": done}
    if stage == "verifying":
        return {"status": "verifying sha256 digest"}
    if stage == "checking":
        return {"status": "checking the adapter with the engine's own loader"}
    if stage == "installing":
        return {"status": "writing manifest"}
    if stage in ("done", "up_to_date"):
        return {"status": "success"}
    return None
