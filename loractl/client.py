"""``loractl.Client``: the async client library the CLI itself uses.

    async with Client() as client:
        print(await client.status())
        async for chunk in client.generate(messages=[{"role": "user", "content": "hi"}]):
            print(chunk.text, end="")

Every failure surfaces as a :class:`loractl.errors.LoractlError` subclass with a message and
a hint: a daemon that is not running is :class:`DaemonNotRunning`, and the daemon's own
domain errors arrive as the class it raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from loractl import paths
from loractl.errors import (DaemonExited, DaemonNotRunning, EngineUnavailable, InvalidRequest, LoractlError,
                            PermissionDenied, from_wire)
from loractl.messages import to_dict  # every reply as a dict: all fields, numbers as numbers
from loractl.multiplexed import Multiplexer
from loractl.v1 import loractl_pb2 as pb
from loractl.v1.loractl_grpc import LoractlStub

_log = logging.getLogger("loractl.client")


@dataclass
class TokenLogprob:
    """A generated token's log-probability and text, and the most likely tokens at its place
    as (token id, logprob, text), most likely first."""

    token_id: int
    logprob: float
    text: str = ""
    top: list[tuple[int, float, str]] = field(default_factory=list)


@dataclass
class Chunk:
    """One streamed piece of a completion (deltas; the last one has ``finish_reason``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    adapter: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token of token_ids, when asked


# How long ``wait_ready`` takes a silent socket, with no daemon process holding the home, for a
# daemon just launched (its imports, before it takes the home's lock); a loaded 2-core machine
# took up to ~4 s here.
START_GRACE_S = 15.0


class DaemonStarting(DaemonNotRunning):
    """A loractld process holds the home but does not listen yet (it is importing, or binding)."""


def _progress_mark(info: dict[str, Any] | None) -> tuple | None:
    """What changes when a starting daemon makes progress: its stage, and the count of a stage
    counted in units of work (steps, tensors, bytes); a stage timed in seconds (the engine's
    start, measured against the last one) moves by the clock alone, so only entering it counts."""
    startup = (info or {}).get("startup") or {}
    if not startup.get("stage"):
        return None
    done = startup.get("done") if startup.get("unit") != "s" else None
    return startup.get("stage"), startup.get("message"), startup.get("detail"), done


def local_folder(ref: str) -> str | None:
    """``ref`` as an absolute folder path when it names one: an existing folder, or anything
    written as a path (``/``, ``./``, ``../``, ``~``) whether or not it exists, so that a missing
    folder is reported as "no adapter folder at /abs/path", never as a bad adapter name."""
    if ref.startswith(("./", "../", "~")) or ref in (".", "..") or (not os.path.isabs(ref) and os.path.isdir(ref)):
        return str(Path(ref).expanduser().absolute())
    return ref if os.path.isabs(ref) else None


def permission_hint(socket_path: Path) -> str:
    """What to do about a socket this user may not open: join its group, or ask for one."""
    import grp
    import pwd
    import stat

    try:
        st = socket_path.stat()
    except OSError:  # a folder on the way is closed to this user
        return (f"A folder above {socket_path} is closed to you; the daemon's owner must open the way "
                "(chmod o+x), or run loractl as that user or root.")
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    as_owner = "root" if owner == "root" else f"{owner} or root"
    if st.st_mode & stat.S_IRWXG:
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = f"gid {st.st_gid}"
        return f"Ask to be added to the socket's group '{group}' (then log in again), or run loractl as {as_owner}."
    return (f"The socket is private to {owner}: run loractl as {as_owner}, or start the daemon with "
            "--socket-group GROUP and join that group.")


class Client:
    """An async connection to one loractld over its Unix socket.

    The socket is ``socket`` if given, else ``$LORACTL_SOCKET``, else the default under
    ``home`` / ``$LORACTL_HOME`` / the platform runtime dir.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, home: str | None = None,
                 instance: str | None = None, prefer_adapter: str | None = None,
                 timeout: float | None = None) -> None:
        self.home = home
        # With several daemons and no --instance: the one holding this adapter on device.
        self.prefer_adapter = prefer_adapter
        self.instance = instance or os.environ.get("LORACTL_INSTANCE") or None
        # An explicit socket (argument or LORACTL_SOCKET) wins; otherwise the registry decides
        # at first use, and this default is where a single local daemon listens.
        self._explicit = bool(socket or os.environ.get("LORACTL_SOCKET"))
        self.socket_path = paths.socket_path(socket, home)
        self.timeout = timeout
        self._channel: Channel | None = None
        self._stub: LoractlStub | None = None
        self._mux: Multiplexer | None = None
        self._unary_only = False   # the daemon answered GenerateMany with UNIMPLEMENTED

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._mux is not None:
            self._mux.close()
            self._mux = None
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    def _discover(self, prefer_adapter: str | None = None) -> None:
        """Pick the daemon: ``--instance``, else the only ready one, else the one holding
        ``prefer_adapter`` on device, else the default socket if it is among them."""
        if self._explicit:
            return
        from loractl.registry import ServiceDiscovery

        discovery = ServiceDiscovery(home=self.home)
        ready = [i for i in discovery.list_instances("loractl", "loractld")
                 if i.status == "ready" and self._believed(discovery, i)]
        if self.instance:
            chosen = [i for i in ready if i.instance_id == self.instance]
            if not chosen:
                raise DaemonNotRunning(f"no ready instance {self.instance!r}",
                                       "List them with: loractl instances")
        elif prefer_adapter and len(ready) > 1:
            chosen = [i for i in ready if prefer_adapter in i.metadata().get("lora", {}).get("loaded_loras", [])]
            chosen = chosen[:1] or [i for i in ready if i.metadata().get("socket") == str(self.socket_path)]
        elif len(ready) > 1:
            chosen = [i for i in ready if i.metadata().get("socket") == str(self.socket_path)]
            if not chosen:
                raise InvalidRequest(
                    f"{len(ready)} daemons are running: {', '.join(i.instance_id for i in ready)}",
                    "Pick one with --instance ID (loractl instances lists them).")
        else:
            chosen = ready
        if chosen and chosen[0].metadata().get("socket"):
            self.socket_path = Path(chosen[0].metadata()["socket"])

    @staticmethod
    def _believed(discovery, instance) -> bool:
        """An entry in a registry folder that others can write is ignored (with one warning
        line): its socket could be anyone's, and a pull sends HF_TOKEN through it."""
        why = discovery.distrust(instance)
        if why is not None:
            _log.warning("loractl: warning: ignoring the daemon entry %s: %s (hint: chmod go-w the folder, "
                         "remove the entry, or pass --socket PATH)", instance.instance_id, why)
        return why is None

    def _connect(self, prefer_adapter: str | None = None) -> LoractlStub:
        if self._stub is None:
            self._discover(prefer_adapter)
        return self.stub

    @property
    def stub(self) -> LoractlStub:
        if self._stub is None:
            if len(os.fsencode(self.socket_path)) > paths.MAX_SOCKET_PATH:
                raise InvalidRequest(
                    f"socket path is longer than {paths.MAX_SOCKET_PATH} bytes: {self.socket_path}",
                    "Use a shorter --socket or LORACTL_HOME.",
                )
            self._channel = Channel(path=str(self.socket_path))
            self._stub = LoractlStub(self._channel)
        return self._stub

    def _start_hint(self) -> str:
        if self.socket_path == paths.layout().default_socket:
            # The daemon may well run, under another home: the commonest miss.
            return ("Start it with: loractld --model demo; if one runs under another home, set LORACTL_HOME "
                    "to that folder or pass --socket PATH.")
        return f"Start it with: loractld --model demo --socket {self.socket_path}"

    def _not_listening(self) -> DaemonNotRunning:
        """Why nothing answers at the socket: the last daemon's failure when it left one
        (:class:`DaemonExited`), a daemon still starting, or none at all."""
        from loractl import daemon_exit

        layout = paths.layout(self.home)
        pid = daemon_exit.starting_pid(layout, self.socket_path)
        if pid is not None:
            return DaemonStarting(f"loractld (pid {pid}) is starting and does not listen at {self.socket_path} yet",
                                  "Wait for it: loractl status --wait")
        record = daemon_exit.read_exit(layout, self.socket_path)
        if record is not None:
            log = f" Its log: {record.log}." if record.log else ""
            return DaemonExited(f"loractld exited {record.ago()}: {record.message}", f"{record.hint}{log}",
                                exited_at=record.time)
        return DaemonNotRunning(f"no loractl daemon is listening at {self.socket_path}", self._start_hint())

    @asynccontextmanager
    async def _errors(self, prefer_adapter: str | None = None):
        """Pick the daemon (see ``_discover``); translate transport and gRPC failures into
        domain errors."""
        try:
            self._connect(prefer_adapter or self.prefer_adapter)
            yield
        except GRPCError as e:
            raise from_wire(e.status, e.message) from e
        except PermissionError as e:
            raise PermissionDenied(f"no permission to use the daemon's socket {self.socket_path}",
                                   permission_hint(Path(self.socket_path))) from e
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise self._not_listening() from e
        except (StreamTerminatedError, ConnectionResetError, BrokenPipeError) as e:
            raise DaemonNotRunning(f"the connection to the daemon at {self.socket_path} was lost: {e}",
                                   "Check whether the daemon is still running (loractl status).") from e
        except OSError as e:
            if isinstance(e, LoractlError):
                raise
            raise DaemonNotRunning(f"cannot reach the daemon at {self.socket_path}: {e.strerror or e}") from e

    async def status(self) -> dict[str, Any]:
        async with self._errors():
            reply = await self.stub.Status(pb.StatusRequest(), timeout=self.timeout)
        return to_dict(reply)

    async def wait_ready(self, timeout: float = 300.0, *, on_wait=None, missing_ok: bool = False,
                         interval: float = 0.5) -> dict[str, Any]:
        """Poll the daemon until its engine is ready; return its status.

        ``on_wait(elapsed_seconds, status)`` is called on every poll that found it still starting;
        ``status`` is the daemon's answer (its ``startup`` says what it is doing), None while
        it does not listen yet; once more with the ready status when it was called before, so
        a live display can close its line.
        ``missing_ok``: a daemon not listening yet (a service starting) counts as starting,
        for as long as a daemon process holds the home, or for ``START_GRACE_S`` when none
        does yet; otherwise that is :class:`DaemonNotRunning` at once.
        A daemon that failed meanwhile is :class:`DaemonExited` with its own error, as soon as
        it exits (loractl/daemon_exit.py). ``timeout`` counts from the daemon's last progress
        (a new stage, a step, a tensor, a megabyte): a first start that trains for minutes is
        waited for; one stuck longer than ``timeout`` is :class:`EngineUnavailable`.
        """
        import asyncio
        import time

        began = time.monotonic()
        began_wall = time.time()
        last_progress, progress_mark = began, None
        waited = False
        while True:
            info = None
            absent: DaemonNotRunning | None = None   # this poll found nothing listening
            try:
                info = await self.status()
                if info["ready"]:
                    if on_wait is not None and waited:
                        on_wait(time.monotonic() - began, info)
                    return info
            except DaemonNotRunning as e:
                if not missing_ok:
                    raise
                self.close()  # a fresh connection on the next poll
                absent = e
                elapsed = time.monotonic() - began
                if isinstance(e, DaemonExited) and (e.exited_at >= began_wall - 2 or elapsed >= START_GRACE_S):
                    raise
                if elapsed >= START_GRACE_S and not isinstance(e, (DaemonExited, DaemonStarting)):
                    raise DaemonNotRunning(f"{e.message}, and no loractld is starting there", e.hint) from e
            now = time.monotonic()
            mark = _progress_mark(info)
            if mark != progress_mark:
                last_progress, progress_mark = now, mark
            if now - last_progress >= timeout:
                if isinstance(absent, DaemonExited):
                    raise absent
                if absent is not None and not isinstance(absent, DaemonStarting):
                    raise DaemonNotRunning(f"{absent.message}, and no loractld started there within {timeout:.0f} s",
                                           absent.hint)
                stage = ((info or {}).get("startup") or {}).get("message") or "starting"
                raise EngineUnavailable(f"the daemon's engine was not ready after {now - began:.0f} s: no progress "
                                        f"for {timeout:.0f} s ({stage})",
                                        "Its log says why (journalctl --user -u loractld, or where it runs); "
                                        "--timeout waits longer.")
            if on_wait is not None:
                on_wait(now - began, info)
                waited = True
            await asyncio.sleep(interval)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        lora: str | None = None,
        max_tokens: int | None = None,
        min_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        json_schema: str | dict[str, Any] | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream a completion of ``prompt`` (sent as is) or ``messages`` (chat template).

        ``lora`` is an adapter: an existing local PEFT folder (made absolute here) or a name
        the daemon resolves. Closing the
        iterator early cancels the request in the daemon.

        The sampling options are vLLM's, with its names and ranges. ``logprobs=N`` gives each
        chunk its tokens' log-probabilities with the N most likely alternatives (``Chunk.logprobs``).
        At most one of ``json_schema`` (a dict or JSON text), ``json_object``, ``regex``,
        ``choice`` and ``grammar`` constrains the output; the daemon refuses a value the engine
        cannot honour (two constraints, a regex that does not compile) by name.
        """
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        if lora:
            lora = local_folder(lora) or lora  # a local folder, made absolute; anything else is a name
        sampling = pb.SamplingParams(stop=stop or [], logit_bias=logit_bias or {}, stop_token_ids=stop_token_ids or [],
                                     ignore_eos=ignore_eos)
        for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens), ("temperature", temperature),
                            ("top_p", top_p), ("top_k", top_k), ("seed", seed), ("min_p", min_p),
                            ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                            ("repetition_penalty", repetition_penalty), ("logprobs", logprobs)):
            if value is not None:
                setattr(sampling, name, value)
        if isinstance(json_schema, dict):
            json_schema = json.dumps(json_schema)
        for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)):
            if value is not None:
                setattr(sampling.structured, name, value)
        if json_object:
            sampling.structured.json_object = True
        if choice is not None:
            if not choice:  # an empty list on the wire is no constraint at all
                raise InvalidRequest("choice is empty", "Give at least one string to choose from.")
            sampling.structured.choice.extend(choice)
        request = pb.GenerateRequest(
            prompt=prompt or "",
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or []],
            sampling=sampling,
            lora=lora or "",
        )
        async with self._errors(prefer_adapter=lora):
            async with aclosing(self._replies(request)) as replies:
                async for reply in replies:
                    yield Chunk(
                        text=reply.text,
                        token_ids=list(reply.token_ids),
                        finish_reason=reply.finish_reason,
                        prompt_token_ids=list(reply.prompt_token_ids),
                        adapter=reply.adapter,
                        prompt_tokens=reply.usage.prompt_tokens,
                        completion_tokens=reply.usage.completion_tokens,
                        logprobs=[TokenLogprob(t.token_id, t.logprob, t.text,
                                               [(a.token_id, a.logprob, a.text) for a in t.top])
                                  for t in reply.logprobs],
                    )

    async def _replies(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateReply]:
        """A generation's replies: over the Client's one ``GenerateMany`` stream, shared by its
        concurrent generations; over a ``Generate`` stream of its own with a ``timeout`` (a
        deadline is per stream) or with a daemon that predates ``GenerateMany``."""
        if self.timeout is None and not self._unary_only:
            replied = False
            try:
                async with aclosing(self._multiplexer().generate(request)) as replies:
                    async for reply in replies:
                        replied = True
                        yield reply
                return
            except GRPCError as e:
                if e.status is not Status.UNIMPLEMENTED or replied:
                    raise
                self._unary_only = True
        async with self.stub.Generate.open(timeout=self.timeout) as stream:
            await stream.send_message(request, end=True)
            async for reply in stream:
                yield reply

    def _multiplexer(self) -> Multiplexer:
        if self._mux is None or self._mux.loop is not asyncio.get_running_loop():
            self._mux = Multiplexer(self.stub)
        return self._mux

    async def pull(self, ref: str, *, name: str | None = None, revision: str | None = None,
                   force: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Pull an adapter into the daemon's store; yield progress events as dicts.

        ``ref`` is ``org/repo``, ``hf://org/repo[@rev][/subfolder]`` or a local folder (made
        absolute here). The caller's ``HF_ENDPOINT`` and ``HF_TOKEN`` go along, so a daemon
        started elsewhere (systemd) pulls with the user's credentials.
        """
        ref = local_folder(ref) or ref
        request = pb.PullRequest(ref=ref, name=name or "", revision=revision or "", force=force,
                                 hf_endpoint=os.environ.get("HF_ENDPOINT", ""), hf_token=os.environ.get("HF_TOKEN", ""))
        async with self._errors():
            async with self.stub.Pull.open(timeout=self.timeout) as stream:
                await stream.send_message(request, end=True)
                async for event in stream:
                    yield to_dict(event)

    async def merge(self, name: str, sources: dict[str, float] | list[tuple[str, float]], *,
                    svd_rank: int | None = None, force: bool = False) -> dict[str, Any]:
        """Store under ``name`` the adapter whose delta is the weighted sum of the stored
        ``sources``' deltas (``{name: weight}`` or ``[(name, weight), ...]``): exact, by
        concatenating their ranks (PEFT's ``add_weighted_adapter``, ``cat``), or with
        ``svd_rank`` truncated to that rank (PEFT's ``svd``; ``show`` reports its error).
        Returns the merged adapter as ``show`` does; the same sources and weights again give
        the same content. A name holding another adapter is refused unless ``force``."""
        pairs = list(sources.items()) if isinstance(sources, dict) else list(sources)
        request = pb.MergeRequest(name=name, sources=[pb.MergeSource(name=n, weight=float(w)) for n, w in pairs],
                                  method="svd" if svd_rank else "cat", svd_rank=svd_rank or 0, force=force)
        async with self._errors():
            return to_dict(await self.stub.Merge(request, timeout=self.timeout))

    async def list(self) -> list[dict[str, Any]]:
        """The adapters in the store."""
        async with self._errors():
            reply = await self.stub.List(pb.ListRequest(), timeout=self.timeout)
        return [to_dict(a) for a in reply.adapters]

    async def show(self, name: str) -> dict[str, Any]:
        async with self._errors():
            return to_dict(await self.stub.Show(pb.ShowRequest(name=name), timeout=self.timeout))

    async def remove(self, name: str, *, force: bool = False) -> dict[str, Any]:
        """Delete an adapter from disk, unloading it from the engine first (``force``: even if pinned)."""
        async with self._errors():
            return to_dict(await self.stub.Remove(pb.RemoveRequest(name=name, force=force), timeout=self.timeout))

    async def create(self, name: str, modelfile: str = "", *, base: str = "", adapters: list[str] = (),
                     system: str | None = None, template: str | None = None, parameters: dict[str, Any] | None = None,
                     messages: list[dict[str, str]] = (), license: list[str] = (),
                     force: bool = False) -> dict[str, Any]:
        """Make the profile ``name``: a Modelfile's text (Ollama's syntax) and/or its
        fields, which override its lines (``base`` is FROM; ``adapters`` are ``NAME[=WEIGHT]``;
        ``parameters`` Ollama's names, a list value for ``stop``). Returns the profile as ``show``.
        A profile of that name is replaced only by the same Modelfile (an update), or with ``force``."""
        params = [f"{k}={v}" for k, values in (parameters or {}).items()
                  for v in (values if isinstance(values, (list, tuple)) else [values])]
        request = pb.CreateRequest(name=name, modelfile=modelfile, adapters=list(adapters), system=system,
                                   template=template, parameters=params, license=list(license),
                                   messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
                                   force=force)
        setattr(request, "from", base)
        async with self._errors():
            return to_dict(await self.stub.Create(request, timeout=self.timeout))

    async def copy(self, source: str, destination: str, *, force: bool = False) -> dict[str, Any]:
        """A new name for a profile's or an adapter's content; returns the copy as ``show``
        (``force``: replace what ``destination`` holds, of the same kind)."""
        async with self._errors():
            return to_dict(await self.stub.Copy(pb.CopyRequest(source=source, destination=destination, force=force),
                                                timeout=self.timeout))

    async def load(self, name: str, *, to: str = "device") -> dict[str, Any]:
        """Load a stored adapter into host RAM or onto the device; return its residency."""
        async with self._errors():
            return to_dict(await self.stub.Load(pb.LoadRequest(name=name, to=to), timeout=self.timeout))

    async def evict(self, name: str, *, source: str = "device") -> dict[str, Any]:
        """Evict from the device (the host copy stays) or from host RAM (the disk copy stays)."""
        request = pb.EvictRequest(name=name)
        setattr(request, "from", source)
        async with self._errors():
            return to_dict(await self.stub.Evict(request, timeout=self.timeout))

    async def pin(self, name: str, *, to: str = "host") -> dict[str, Any]:
        """Pin in host RAM (``to="host"``) or in a device slot (``"device"``: can wait for the
        adapters running now to hand a slot over); return its residency."""
        async with self._errors():
            return to_dict(await self.stub.Pin(pb.PinRequest(name=name, to=to), timeout=self.timeout))

    async def set_admission(self, policy: str, *, max_wait_s: float | None = None) -> dict[str, Any]:
        """Change the admission policy until the daemon stops; return the gate's state."""
        request = pb.AdmissionRequest(policy=policy)
        if max_wait_s is not None:
            request.max_wait_s = max_wait_s
        async with self._errors():
            return to_dict(await self.stub.SetAdmission(request, timeout=self.timeout))

    async def unpin(self, name: str) -> dict[str, Any]:
        async with self._errors():
            return to_dict(await self.stub.Unpin(pb.NameRequest(name=name), timeout=self.timeout))

    async def events(self, history: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Lifecycle events as they happen, until the caller stops iterating; first the last
        ``history`` events the daemon kept (a daemon older than that field sends none)."""
        async with self._errors():
            async with self.stub.Events.open() as stream:
                await stream.send_message(pb.EventsRequest(history=history), end=True)
                async for event in stream:
                    yield to_dict(event)

    async def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text format."""
        async with self._errors():
            return (await self.stub.Metrics(pb.MetricsRequest(), timeout=self.timeout)).text

    def instances(self) -> list[dict[str, Any]]:
        """The live loractld instances in the registry (no daemon connection needed)."""
        from loractl.registry import ServiceDiscovery

        return [{"instance_id": i.instance_id, "status": i.status, "pid": i.pid, "host": i.host,
                 "heartbeat": i.heartbeat, "started": i.started, "metadata": i.metadata()}
                for i in ServiceDiscovery(home=self.home).list_instances("loractl", "loractld")]
