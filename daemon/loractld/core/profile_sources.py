"""Where a profile's adapters come from: a Modelfile's ``ADAPTER`` (and ``loractl create
--adapter``, Ollama's ``/api/create`` blobs) names a stored adapter, a folder or a Hub ref, and
what a create pulls for it is pulled as ``loractl pull`` pulls it — and removed again when the
create fails.

The rule, for each ADAPTER value (its weight already split off by the parser):

1. a stored adapter's name wins (``sql-expert/v1``); a profile's name is refused (FROM takes a
   profile, its adapter and defaults);
2. otherwise an absolute folder (``/abs/folder``, ``file:///abs/folder``) is pulled as a folder;
   the CLI sends relative ones (``./x``, ``../x``, ``~/x``, or an existing folder that is no
   stored name) made absolute against the Modelfile's folder, as Ollama resolves them. A
   relative path that still reaches the daemon is refused: the daemon's working folder and home
   mean nothing to the caller;
3. otherwise a ref an adapter source understands (``org/repo``, ``hf://org/repo@rev/sub``, a
   plugin's) is pulled from there, with the daemon's ``HF_ENDPOINT``/``HF_TOKEN`` — except a
   value in a stored name's form that is close to a stored adapter's name (``sql-exprt/v1``),
   refused with "did you mean": a typo must not fetch somebody else's repo. Written as
   ``hf://...`` (or in a form no stored name takes) it is always a Hub ref.

Invariants:
- A pulled source is stored under a name derived from the profile's: ``<profile>-adapter``,
  then ``-adapter-2``, ``-adapter-3``, ...; a name already stored from the same place (a create
  of the same Modelfile again) is pulled into again (up to date, or its new revision), any other
  stored name is skipped. The profile names the stored name (``show``, ``show --modelfile``), so
  its Modelfile recreates it without pulling.
- A pull is the store's own (``Core.pull``: verified, validated, preflighted, installed
  atomically, announced) under the pull's rule: a door that authorized the create passes no
  caller (gRPC's ``@mutating``); with a caller each pull is authorized and audited as ``pull``.
- Nothing is left behind: when the create fails or is cancelled after a pull, every name it
  installed that was not stored before is removed again (:meth:`CreatePulls.undo`). A name that
  was stored before keeps what the pull made of it (a new revision cannot be taken back).
- A refusal names the Modelfile's line (``Modelfile line N: ADAPTER '...': ...``) and keeps the
  error's kind and hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from loractl.errors import AdapterNotFound, InvalidRequest, LoractlError
from loractl.names import NAME_RE, colon_weight, validate_name
from loractld.core import policy
from loractld.store.create_journal import CreateJournal
from loractld.store.modelfile import Modelfile, refused
from loractld.store.sources import parse_hub_ref, pick_source

if TYPE_CHECKING:
    from loractld.store.pulls import PullEvent

# ``core`` below is the daemon's Core (a ProfileOps): not imported, since Core's own module
# imports this one through core/profiles.py.

_log = logging.getLogger("loractld.core")
SUFFIX = "-adapter"
_RELATIVE = ("./", "../", "~")


def adapter_taken(name: str) -> InvalidRequest:
    """The refusal of a profile's name that an adapter holds (one name space for both)."""
    return InvalidRequest(f"{name!r} is taken: it is an adapter in the store", "Give the profile another name "
                          "(adapters and profiles share one name space; loractl ls lists them).")


class CreatePulls:
    """The adapters one create pulls, and the names it installed new (removed by :meth:`undo`)."""

    def __init__(self, core, caller: policy.Caller | None) -> None:
        self.core = core
        self.caller = caller
        self.new: list[str] = []
        self.journal: CreateJournal | None = None   # the new names on disk: a kill's are undone at start

    async def pull(self, ref: str, name: str) -> AsyncIterator[PullEvent]:
        """``loractl pull REF --name NAME``'s events, the name recorded when it was not stored."""
        catalog = await self.core._wait_catalog()
        if not await asyncio.to_thread(catalog.store.has, name) and name not in self.new:
            # Before the pull: a cancel after its install still undoes it, and a kill the next start.
            self.journal = self.journal or CreateJournal(catalog.store.root)
            await asyncio.to_thread(self.journal.record, name)
            self.new.append(name)
        authorized = policy.authorized(self.caller, self.core.socket_gid, "pull", f"{ref} as {name}",
                                       refusal="pull adapters on this daemon",
                                       hint="Ask the daemon's owner to pull it, then name it in ADAPTER.") \
            if self.caller is not None else contextlib.nullcontext()
        async with authorized:
            async with contextlib.aclosing(self.core.pull(ref, name=name)) as events:
                async for event in events:
                    yield event

    async def undo(self) -> None:
        """Remove what this create installed new (those names only, newest first)."""
        catalog = await self.core._wait_catalog()
        for name in reversed(self.new):
            async with catalog.puller.lock(name):   # a pull of it still ending (its install) ends first
                stored = await asyncio.to_thread(catalog.store.has, name)
            if not stored:
                continue
            try:
                await self.core.remove(name, force=True)
                _log.info("create failed: removed %s, which it had pulled", name)
            except LoractlError as e:   # logged: the create's own error is what its caller hears
                _log.warning("create failed, and %s, which it had pulled, could not be removed: %s", name, e.message)
        self.new.clear()
        self.close()

    def close(self) -> None:
        """The create ended (made, or undone): its record of new names goes."""
        if self.journal is not None:
            self.journal.close()


@contextlib.asynccontextmanager
async def undone_on_failure(core, caller: policy.Caller | None = None) -> AsyncIterator[CreatePulls]:
    """A :class:`CreatePulls` whose installs are removed again if the body fails or is cancelled."""
    pulls = CreatePulls(core, caller)
    try:
        yield pulls
    except BaseException:
        # Shielded: a cancelled create (its caller gone) still takes back what it installed.
        await asyncio.shield(pulls.undo())
        raise
    pulls.close()


@contextlib.asynccontextmanager
async def sourced(core, name: str, modelfile: Modelfile,
                  caller: policy.Caller | None = None) -> AsyncIterator[Modelfile]:
    """``modelfile`` with every ADAPTER a stored name (see the module's rule), for the body that
    makes the profile; what was pulled for it is removed again if that body fails."""
    validate_name(name)   # the pulled names derive from it: refused before anything is pulled
    catalog = await core._wait_catalog()
    await asyncio.to_thread(catalog.profiles.check_writable, name)   # a newer release's profile: left alone
    if await asyncio.to_thread(catalog.store.has, name):   # one name space: refused before anything is pulled
        raise adapter_taken(name)
    lines = getattr(modelfile, "adapter_lines", [])
    await _merge_fits(core, catalog, modelfile.adapters)   # before anything is pulled
    async with undone_on_failure(core, caller) as pulls:
        adapters: list[tuple[str, float]] = []
        for index, (value, weight) in enumerate(modelfile.adapters):
            line = lines[index] if index < len(lines) else 0
            stored = await _stored(core, pulls, name, value, line, [n for n, _ in adapters])
            adapters.append((stored, weight))
        yield dataclasses.replace(modelfile, adapters=adapters)


async def _merge_fits(core, catalog, adapters: list[tuple[str, float]]) -> None:
    """Refuse, before any pull, a merge whose rank is known to pass the engine's --max-lora-rank:
    the sources that are stored adapters or folders (their adapter_config.json; a Hub ref's is
    not known until it is pulled) targeting the same modules without a rank_pattern, their ranks
    summed (PEFT's ``cat``). The merge checks the rest itself, after the pulls."""
    if len(adapters) < 2 and not (adapters and adapters[0][1] != 1.0):
        return   # no merge
    engine, _ = await core._wait_engine()
    limit = engine.settings.max_lora_rank

    def known() -> tuple[int, bool] | None:
        import json

        total, modules = 0, None
        for value, _ in adapters:
            if catalog.store.has(value):
                config_path = catalog.store.get(value).path / "adapter_config.json"
            else:
                folder = Path(value.removeprefix("file://"))
                if not folder.is_absolute() or not folder.is_dir():
                    return None   # a Hub ref (or a refusal the pull names)
                config_path = folder / "adapter_config.json"
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError):
                return None   # the pull names what is wrong with it
            targets = config.get("target_modules")
            targets = tuple(sorted(targets)) if isinstance(targets, list) else targets
            if config.get("rank_pattern") or not isinstance(config.get("r"), int) or (
                    modules is not None and targets != modules):
                return None
            modules = targets
            total += config["r"]
        return total, True

    found = await asyncio.to_thread(known)
    if found is not None and found[0] > limit:
        raise InvalidRequest(f"the {len(adapters)} ADAPTERs merge to rank {found[0]}, over this daemon's "
                             f"--max-lora-rank {limit} (nothing was pulled)",
                             f"Name fewer adapters, or restart the daemon with --max-lora-rank {found[0]}.")


async def _stored(core, pulls: CreatePulls, profile: str, value: str, line: int, taken: list[str]) -> str:
    """The stored name ``value`` stands for, pulled first when it is a folder or a ref."""
    catalog = await core._wait_catalog()
    if await asyncio.to_thread(catalog.store.has, value):
        return value
    if core.profile_of(value) is not None:
        raise refused(line, f"ADAPTER {value!r} is a profile, not an adapter",
                      f"Build on a profile with FROM {value} (its adapter and defaults), or name its adapter "
                      f"(loractl show {value}).")
    if value.startswith(_RELATIVE) or value in (".", ".."):
        raise refused(line, f"ADAPTER {value!r} is a relative path, which the daemon cannot resolve",
                      "Give the folder's absolute path (loractl create -f makes a Modelfile's relative paths "
                      "absolute against the Modelfile's folder).")
    if NAME_RE.match(value):
        # A form a stored name takes, which no stored adapter has: a typo of a stored name is refused
        # (it would pull somebody else's Hub repo); with no close match it is taken as a Hub ref.
        # Closer than other suggestions' 0.6: a Hub repo that merely resembles a stored name is pulled.
        # Profiles count as close too: a typo of one is no Hub repo either (FROM takes a profile).
        close = await asyncio.to_thread(functools.partial(core.close_matches, value, cutoff=0.8))
        close = [c for c in close if c not in core.base_model_names()]
        if close:
            where = f"Modelfile line {line}: " if line else ""
            named = [f"the profile {c!r} (FROM {c})" if core.profile_of(c) is not None else repr(c) for c in close]
            raise AdapterNotFound(f"{where}ADAPTER {value!r} is not a stored adapter",
                                  f"Did you mean {' or '.join(named)}? To pull a Hub repo of that "
                                  f"name, write it as one: ADAPTER hf://{value}.")
    try:
        source = pick_source(catalog.puller.sources, value)
        canonical = _canonical(source.name, value)
    except InvalidRequest:
        weighted = colon_weight(value)
        raise refused(line, f"ADAPTER {value!r} is neither a stored adapter, a folder nor a Hub ref",
                      f"A weight is written with '=': ADAPTER {weighted[0]}={weighted[1]}." if weighted else
                      "Name a stored adapter (loractl ls), an adapter folder (./my-adapter) or a Hub repo "
                      "(org/repo, hf://org/repo@rev/sub).") from None
    target = await asyncio.to_thread(_name_for, catalog.store, profile, canonical, taken)
    try:
        async for _ in pulls.pull(value, target):
            pass
    except LoractlError as e:
        raise _at_line(e, line, value) from e
    return target


def _canonical(source: str, ref: str) -> str:
    """The ``ref`` a pull of ``ref`` records in its manifest (what "pulled from the same place" compares)."""
    if source == "local":
        return str(Path(ref.removeprefix("file://")))
    if source == "hf":
        repo, _, sub = parse_hub_ref(ref)
        return f"hf://{repo}/{sub}" if sub else f"hf://{repo}"
    return ref


def _name_for(store, profile: str, canonical: str, taken: list[str]) -> str:
    """The first of ``<profile>-adapter``, ``-adapter-2``, ... that is free or holds ``canonical``'s pull."""
    index = 1
    while True:
        candidate = validate_name(f"{profile}{SUFFIX}" + (f"-{index}" if index > 1 else ""))
        index += 1
        if candidate in taken:
            continue
        if not store.has(candidate):
            return candidate
        try:
            if store.get(candidate).manifest.get("ref") == canonical:
                return candidate
        except LoractlError:   # a damaged adapter under that name: not ours to pull into
            continue


def _at_line(error: LoractlError, line: int, value: str) -> LoractlError:
    """``error`` (same kind and hint) naming the Modelfile's line and the ADAPTER value."""
    where = f"Modelfile line {line}: " if line else ""
    named = copy.copy(error)
    named.message = f"{where}ADAPTER {value!r}: {error.message}"
    named.args = (named.message,)
    return named
