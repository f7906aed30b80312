"""The daemon's lifecycle: bind the socket, start the engine, serve, shut down cleanly.

Shutdown order on SIGTERM/SIGINT (what systemd and Ctrl-C send): stop accepting new
generations, let running ones finish within the grace period, cancel the rest with a clear
status, close the gRPC server, stop the engine (and its child processes), remove the socket,
exit 0. A daemon whose engine cannot start exits 1, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grpclib.server import Server

from loractl import __version__, daemon_exit, paths
from loractl.errors import EngineUnavailable, LoractlError
from loractld.engine import pidfile as enginepid
from loractld.home_claim import claim_socket_path, lock_home
from loractld.store.identity import AdapterResolver
from loractld.serving.admission import DEFAULT_MAX_WAIT_S, DEFAULT_POLICY, Gate
from loractld.serving.policies import PolicyContext, make_policy
from loractld.serving.prefetch import Prefetcher
from loractld.api import grpc_deadlines
from loractld.api.coalesce import CoalescingServer, quiet_hang_ups
from loractld.api.grpc_service import DEFAULT_MAX_MESSAGE_BYTES, LoractlService
from loractld.api.http import settings as http_settings
from loractld.api.http.settings import HttpSettings
from loractld.api.dynamo import DynamoSettings
from loractld.api.dynamo.worker import join as join_dynamo
from loractld.models.basemodel import describe, refresh_shapes
from loractld.models.naming import name_model
from loractld.core import Catalog, Core
from loractld.engine.client import Engine, EngineSettings
from loractld.publisher import Publisher
from loractld.store.preflight import Preflight
from loractld.store.profiles import Profiles
from loractld.startup import Report, last_engine_start, record_engine_start
from loractld.store.pulls import Puller
from loractld.store.sources import load_sources
from loractld.store import formats, rank_limit
from loractld.store.blobs import clear_leftovers
from loractld.store.copies import SNAPSHOT_BUDGET
from loractld.store.create_journal import undo_unfinished
from loractld.store.disk import Store, remove_partial_writes
from loractld.systemd import SystemdEnv
from loractld.serving.pins import PersistentState
from loractld.serving.keep_alive import KeepAlive, resolve_idle
from loractld.serving.keep_alive import describe as describe_idle
from loractld.serving.tiers import Tiers
from loractld.store.known import validation_fingerprint
from loractld.store.validate import DEFAULT_MAX_WEIGHTS_BYTES, VALIDATION_VERSION, validate_adapter

if TYPE_CHECKING:
    from loractld.api.http.server import HttpFrontEnd

_log = logging.getLogger("loractld")


@dataclass(frozen=True)
class DaemonSettings:
    engine: EngineSettings
    home: str | None = None
    socket: str | None = None
    shutdown_grace_s: float = 10.0
    max_adapter_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES
    snapshot_budget: int = SNAPSHOT_BUDGET   # bytes of private copies kept unleased (loractld.store.copies)
    preload: tuple[str, ...] = ()
    socket_group: str | None = None
    served_model_name: str | None = None   # the base model's name in the HTTP API; default: --model
    http: HttpSettings = field(default_factory=HttpSettings)   # the OpenAI-compatible API (off: no address)
    admission_policy: str = DEFAULT_POLICY      # which adapter a freed device slot goes to (loractld.serving.admission)
    admission_max_wait_s: float = DEFAULT_MAX_WAIT_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES   # the largest gRPC request message read
    dynamo: DynamoSettings = field(default_factory=DynamoSettings)   # a Dynamo fleet's worker (off by default)
    auto_pull: bool = False     # a request's missing Hub reference is pulled first (loractld.core.ondemand)
    prefetch: bool = False      # waiting requests' adapters loaded to host RAM (loractld.serving.prefetch): off, measured
    # --keep-alive: idle seconds before the engine sleeps (loractld.serving.keep_alive); None: the
    # device's default (5 minutes on CUDA, never on the CPU), 0: never.
    keep_alive_s: float | None = None
    sleep_level: int = 1        # vLLM's sleep mode level on CUDA (1: weights to host RAM; 2: dropped)
    # Controls kept for the benchmarks' comparisons (docs/benchmarks.md): grpclib's own server,
    # one write per frame, instead of coalesced writes; the collector left as it was at start.
    grpc_coalesce: bool = True
    gc_freeze: bool = True


def resolve_model(model: str, home: str | None, report: Report | None = None) -> str:
    """The folder or Hub id to give vLLM for ``--model``.

    ``demo`` is the embedded default (SmolLM2-135M-Instruct with trained adapters, built on
    first use), ``tiny`` the random two-layer model the fast tests use (built offline in
    seconds), a ``.gguf`` file is converted once into a Hugging Face folder; anything else goes
    to vLLM as is. ``report`` hears the stages and their progress (``loractld.startup``).
    """
    report = report or (lambda *args, **kwargs: None)
    layout = paths.layout(home)
    if model == "demo":
        from loractld.models.demo import build_in_child

        _log.info("preparing the demo model under %s (the first start fetches, converts and trains: minutes)",
                  layout.data_dir)
        report("model", "preparing the demo model")
        return str(build_in_child(layout.data_dir, report=report))
    if model == "tiny":
        from loractld.models.tiny import ensure_demo

        _log.info("building the tiny test model under %s (first start only)", layout.tiny_dir)
        report("model", "preparing the tiny test model")
        return str(ensure_demo(layout.tiny_dir) / "model")
    if model.lower().endswith(".gguf"):
        from loractld.models.gguf import download_hub_gguf, ensure_converted, hub_gguf

        on_hub = hub_gguf(model)
        if on_hub:
            repo, filename = on_hub
            report("fetch", f"downloading {filename} from the Hub repo {repo}")
            return str(ensure_converted(download_hub_gguf(repo, filename), layout.models_dir, name_or_path=repo,
                                        report=report))
        return str(ensure_converted(Path(model), layout.models_dir, report=report))
    check_model_folder(model)
    return model


def check_model_folder(model: str) -> None:
    """Refuse at once, in one short line, a --model written as a path that names no model
    folder: vLLM would take it for a Hub repo id (seconds of look-ups, then a message about
    repo ids), or fail deep in its config parsing with a message hundreds of characters long."""
    from loractld.models.gguf import ModelRefused

    path = Path(model).expanduser()
    looks_like_path = model.startswith(("/", "./", "../", "~")) or model in (".", "..") or path.exists()
    if not looks_like_path:
        return  # a Hub repo id: vLLM resolves it
    if not path.exists():
        raise ModelRefused(f"no model folder at {path.absolute()}",
                           "Check the path; --model takes a model folder, a Hub repo id, a .gguf file, 'demo' or 'tiny'.")
    if not path.is_dir():
        raise ModelRefused(f"{path} is a file, not a model folder",
                           "Pass the folder that holds config.json, or a .gguf file.")
    if not (path / "config.json").is_file():
        raise ModelRefused(f"{path} is not a model folder: it has no config.json",
                           "Pass the folder that holds the model's config.json and weights (a Hugging Face folder).")


def _expert_device(requested: str, model: str) -> str:
    """Where the engine will run, asked only for a mixture-of-experts base (whose expert
    adapters a GPU serves and the CPU does not): vLLM's platform detection is an import the
    dense bases' start-up does not need before the engine's."""
    from loractld.models.moe import folder_expert_count

    if requested != "auto" or not folder_expert_count(model):
        return requested if requested == "cuda" else "cpu"
    from loractld.engine.device import resolve_device

    return resolve_device(requested)


def open_catalog(settings: DaemonSettings, store_dir: Path, model: str) -> Catalog:
    """The disk side: the store (recovered from any interrupted pull), validation, pulls."""
    base = describe(settings.engine.model, model, served_name=settings.served_model_name,
                    device=_expert_device(settings.engine.device, model))
    store = Store(store_dir, snapshot_budget=settings.snapshot_budget)
    for leftover in store.recover():
        _log.info("removed a leftover of an interrupted pull: %s", leftover)
    for leftover in clear_leftovers(store_dir):
        _log.info("removed a leftover of an interrupted upload or create: %s", leftover)
    profiles = Profiles(store_dir)
    for name in undo_unfinished(store, profiles):
        _log.info("removed %s: a create the last run never finished had pulled it", name)
    store.stamp_format()
    adapters = store.list()
    limit = rank_limit.from_store(adapters, settings.engine.max_lora_rank)
    if limit.outlier:
        _log.warning("%s", limit.outlier)

    def validate(folder: Path, force: bool):
        return validate_adapter(folder, max_lora_rank=limit.rank, base_shapes=base.shapes,
                                model_names=base.names, force=force, max_weights_bytes=settings.max_adapter_bytes,
                                experts=base.moe)

    fingerprints: dict[tuple, str] = {}

    def fingerprint() -> str:
        """What ``validate`` checks against now (the shapes can come after the engine's download:
        ``refresh_shapes``), for the facts kept across starts (``store.known``)."""
        now = (id(base.shapes), len(base.names), base.moe)
        if now not in fingerprints:
            fingerprints.clear()
            fingerprints[now] = validation_fingerprint(VALIDATION_VERSION, __version__, limit.rank, base.shapes or {},
                                                       base.names, base.experts, settings.max_adapter_bytes,
                                                       *((base.moe.form,) if base.moe else ()))
        return fingerprints[now]

    preflight = Preflight()
    catalog = Catalog(store=store, resolver=AdapterResolver(store, validate, settings.max_adapter_bytes, fingerprint),
                      puller=Puller(store, load_sources(), validate, preflight), base_model=base, preflight=preflight,
                      max_lora_rank=limit.rank, profiles=profiles)
    _log.info("store %s: %d adapter(s); base model %s (shapes %s%s); max LoRA rank %d", store_dir, len(adapters), model,
              "known" if base.shapes else "unknown",
              f"; quantized: {base.quantization}, adapters checked against its float layers" if base.quantization
              else "", limit.rank)
    return catalog


def open_state(path: Path, store: Store) -> PersistentState:
    """The persisted pins, minus what a daemon killed mid-write or mid-``rm`` left: a temporary
    beside state.json, and the pin of an adapter the store no longer has (``rm`` unlinks the name
    before it drops the pin; kept, such a pin would hold one of the few pin places for good, and
    ``unpin`` could not name it)."""
    for leftover in remove_partial_writes(path):
        _log.info("removed a leftover of an interrupted write: %s", leftover)
    state = PersistentState(path)
    gone = [name for name in state.pins + state.device_pins if not store.has(name)]
    if gone:
        _log.warning("dropping the pin(s) of %s: no longer in the store", ", ".join(gone))
        state.pins = [name for name in state.pins if name not in gone]
        state.device_pins = [name for name in state.device_pins if name not in gone]
        state.save()
    return state


def _listeners(systemd: SystemdEnv, settings: DaemonSettings, layout: paths.Layout) -> tuple[
        Path, socket.socket | None, socket.socket | None, int]:
    """The gRPC socket's path, the Unix socket systemd passed (if any), the HTTP API's
    listening socket (systemd's TCP socket, else one bound for --http, else None), and the
    home's lock (:func:`lock_home`, taken once the settings are checked and before anything in
    the home is touched): all claimed or checked before the engine starts, so a taken port, a
    missing API key or a home in use fails fast."""
    sock_path = paths.socket_path(settings.socket, settings.home)
    passed = systemd.activated_sockets()
    activated = next((s for s in passed if s.family == socket.AF_UNIX), None)
    http_sock = next((s for s in passed if http_settings.is_tcp(s)), None)
    if http_sock is not None:
        http_settings.check_listener(settings.http, *http_sock.getsockname()[:2])
    if activated is not None:
        sock_path = Path(activated.getsockname() or sock_path)
    home_lock = lock_home(layout.data_dir, sock_path)
    try:
        if activated is None:
            claim_socket_path(sock_path)
        if http_sock is None and settings.http.address is not None:
            http_sock = http_settings.bind(*settings.http.address)
    except BaseException:
        os.close(home_lock)
        raise
    if http_sock is None and settings.http.api_key is not None:
        _log.warning("--api-key-file has no effect: the HTTP API is off (no --http, no socket from systemd)")
    return sock_path, activated, http_sock, home_lock


async def serve(settings: DaemonSettings) -> int:
    """Run the daemon until stopped; return its exit code. One daemon per home (:func:`lock_home`)."""
    systemd = SystemdEnv.capture()  # before the engine clears NOTIFY_SOCKET / LISTEN_* for its children
    layout = paths.layout(settings.home)
    sock_path, activated, http_sock, home_lock = _listeners(systemd, settings, layout)
    daemon_exit.clear_exit(layout)  # this home has a daemon again (loractl/daemon_exit.py)
    try:
        formats.check_home(layout.store_dir, layout.state_dir / "state.json")  # before anything is touched
        return await _serve_locked(settings, systemd, layout, sock_path, activated, http_sock)
    except LoractlError as e:
        failed_exit(layout, str(sock_path), e, systemd)
        raise
    except Exception as e:  # a bug: the traceback goes to the log, the CLI gets its last line
        failed_exit(layout, str(sock_path), EngineUnavailable(
            f"loractld failed unexpectedly: {type(e).__name__}: {e}",
            "The daemon's log has the traceback; please report it."), systemd)
        raise
    finally:
        os.close(home_lock)


def failed_exit(layout: paths.Layout, sock_path: str, error: LoractlError, systemd: SystemdEnv | None = None) -> None:
    """Say why this daemon stops, where the CLI and systemd read it: ``loractl status`` shows
    the record (loractl/daemon_exit.py), systemd's status line the message."""
    daemon_exit.record_exit(layout, socket=sock_path, message=error.message, hint=error.hint,
                            log=daemon_exit.log_destination())
    if systemd is not None:
        systemd.notify(f"STATUS=failed: {error.message}", "ERRNO=1")


async def _serve_locked(settings: DaemonSettings, systemd: SystemdEnv, layout: paths.Layout, sock_path: Path,
                        activated: socket.socket | None, http_sock: socket.socket | None) -> int:
    loop = asyncio.get_running_loop()

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    socket_gid = None
    if settings.socket_group:
        import grp

        try:
            socket_gid = grp.getgrnam(settings.socket_group).gr_gid
        except KeyError as e:
            raise LoractlError(f"no group {settings.socket_group!r} on this system",
                               f"Create it (groupadd {settings.socket_group}) or drop --socket-group.") from e
    core = Core(socket_path=str(sock_path), home=str(layout.home or layout.data_dir),
                served_model_name=settings.served_model_name or settings.engine.model)
    core.auto_pull = settings.auto_pull
    core.socket_gid = socket_gid
    server_class = CoalescingServer if settings.grpc_coalesce else Server   # --grpc-writes per-frame: grpclib's own
    grpc_deadlines.install()
    quiet_hang_ups()   # a client that hangs up when it has its answer is no INFO line
    service = LoractlService(core, socket_gid=socket_gid, max_message_bytes=settings.max_message_bytes)
    server = server_class([service])
    if activated is not None:
        await server.start(sock=activated)
        _log.info("listening on %s (socket activation)", sock_path)
    else:
        # The socket is born with its final mode: no window in which others can connect.
        old_umask = os.umask(0o117 if settings.socket_group else 0o177)
        try:
            await server.start(path=str(sock_path))
        finally:
            os.umask(old_umask)
        if socket_gid is not None:
            os.chown(sock_path, -1, socket_gid)
        _log.info("listening on %s", sock_path)
    http: HttpFrontEnd | None = None
    if http_sock is not None:
        from loractld.api.http.server import HttpFrontEnd

        try:
            http = await HttpFrontEnd.start(core, settings.http, http_sock, debug=_log.isEnabledFor(logging.DEBUG),
                                            socket_gid=socket_gid)
        except BaseException:
            server.close()
            if activated is None:
                sock_path.unlink(missing_ok=True)
            raise
        core.http_url = http.url
    systemd.notify("STATUS=starting the engine")
    publisher = Publisher(core, home=settings.home, socket_path=str(sock_path))
    _log.info("registered as instance %s", publisher.handle.instance_id())

    async def start_engine() -> Engine:
        model = await asyncio.to_thread(resolve_model, settings.engine.model, settings.home, core.startup.update)
        core.model_name = name_model(settings.engine.model, model, settings.served_model_name)
        core.startup.update("model", "reading the base model")
        core.set_catalog(await asyncio.to_thread(open_catalog, settings, layout.store_dir, model))
        nonlocal listing
        # What the first `ls` would build (1.4 s at 10,000 adapters), built while the engine
        # starts (its own process does most of that work): awaited before READY.
        listing = asyncio.create_task(service.prewarm())
        await asyncio.to_thread(enginepid.clear_stale, layout.state_dir)  # an orphan of a killed daemon
        core.startup.update("engine", "starting the engine (vLLM)", unit="s",
                            expected_s=last_engine_start(layout.state_dir, model))
        started = await Engine.start(EngineSettings(**{**settings.engine.__dict__, "model": model,
                                                        "max_lora_rank": core.catalog.max_lora_rank,
                                                        "sleep_mode": settings.keep_alive_s != 0}))
        await asyncio.to_thread(enginepid.record, layout.state_dir)
        core.catalog.preflight.attach(started)
        await asyncio.to_thread(refresh_shapes, core.catalog.base_model)  # a Hub model is on disk only now
        await asyncio.to_thread(record_engine_start, layout.state_dir, model, started.start_seconds)
        core.startup.update("adapters", "loading the pinned and preloaded adapters")
        return started

    engine: Engine | None = None
    listing: asyncio.Task | None = None
    watchdog: asyncio.Task | None = None
    dynamo = None
    exit_code = 0
    engine_task = asyncio.create_task(start_engine())
    stop_task = asyncio.create_task(stop.wait())
    extender = asyncio.create_task(_extend_start_timeout(systemd, core)) if systemd.notify_socket else None
    engine_task.add_done_callback(lambda _: extender and extender.cancel())
    try:
        await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() and not engine_task.done():
            _log.info("stop requested while the engine starts; waiting for it to come up to stop it")
        try:
            engine = await engine_task
        except LoractlError as e:
            _log.error("%s (hint: %s)", e.message, e.hint)
            failed_exit(layout, str(sock_path), e, systemd)  # first: a waiting CLI learns it at once
            core.set_failed(e)
            exit_code = 1
        else:
            assert core.catalog is not None
            context = PolicyContext(mixing_costly=engine.device == "cpu" and engine.settings.cpu_fixes)
            gate = Gate(engine.settings.max_loras, make_policy(settings.admission_policy,
                                                               settings.admission_max_wait_s, context))
            tiers = Tiers(engine, core.catalog.resolver, open_state(layout.state_dir / "state.json", core.catalog.store),
                          core.events, core.metrics, gate, max_loras=engine.settings.max_loras,
                          max_cpu_loras=engine.settings.max_cpu_loras)
            context.price = lambda: tiers.reader.price.price
            core.policy_context = context
            if settings.prefetch:
                Prefetcher(tiers, gate)   # it watches the gate from now on
            await tiers.sync()
            for failure in await tiers.apply_startup(list(settings.preload), core.catalog.preflight):
                _log.warning("startup: %s", failure)
            core.set_engine(engine, tiers)
            # Every door's requests are rendered by vLLM's serving classes: built (and their
            # renderer warmed) before READY, not by the first requests, which would all wait on it.
            await core.openai_surface()
            core.startup.update("finishing", "finishing start-up (the adapter listing, the heap)")
            if listing is not None:
                await listing
            if settings.gc_freeze:
                _freeze_startup_heap()
            tiers.start_following()
            dynamo = await join_dynamo(core, settings.dynamo)  # None without --dynamo; before READY=1
            await publisher.refresh()
            # `status` says ready from here, with READY=1: a command that waited for it finds the
            # listing built and the heap frozen, not the daemon still doing both.
            core.startup.finish()
            core.set_started()
            core.start_checking()
            publisher.set_ready(True)
            publisher.start()
            model_label = core.model_label

            def ready_status() -> str:
                return f"STATUS=ready: {model_label} on {engine.device}, {len(tiers.pinned_names())} pinned"

            systemd.notify("READY=1", ready_status())
            watchdog = asyncio.create_task(_watchdog(systemd, core, stop))
            core.keep_alive = start_keep_alive(settings, core, engine, tiers, systemd, ready_status)
            _log.info("ready: model %s (%s) on %s (engine start %.1f s)", core.model_label, engine.settings.model,
                      engine.device, engine.start_seconds)
            await stop.wait()
        _log.info("shutting down")
        if core.keep_alive is not None:
            core.keep_alive.stop()   # no sleep now: the engine stops below
        systemd.notify("STOPPING=1", "STATUS=stopping")
        publisher.set_ready(False)
        if dynamo is not None:
            await dynamo.leave()  # the fleet stops routing here before the drain
        if core.engine_died:
            exit_code = 1
            failed_exit(layout, str(sock_path), EngineUnavailable(
                "the engine died while serving; the daemon stopped so that its supervisor starts it again",
                "The log above this line says why (an out-of-memory kill, a crash in vLLM)."), systemd)
        cancelled = await core.drain(settings.shutdown_grace_s)
        if cancelled:
            _log.info("cancelled %d generation(s) still running after %.0f s", cancelled, settings.shutdown_grace_s)
    finally:
        stop_task.cancel()
        if core.tiers is not None:
            core.tiers.stop_following()
        if watchdog is not None:
            watchdog.cancel()
        if listing is not None:
            listing.cancel()
        publisher.close()
        if dynamo is not None:
            await dynamo.close()
        if http is not None:
            await http.close()
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), timeout=5)
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        if core.catalog is not None:   # what this run validated, for the next start (store.known)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(core.catalog.store.save_known)
            enginepid.forget(layout.state_dir)
        if activated is None:
            sock_path.unlink(missing_ok=True)  # an activated socket belongs to systemd
        _log.info("stopped")
    return exit_code


def start_keep_alive(settings: DaemonSettings, core: Core, engine: Engine, tiers: Tiers, systemd: SystemdEnv,
                     ready_status) -> KeepAlive | None:
    """The engine's sleep after ``--keep-alive`` idle (loractld.serving.keep_alive), its idle
    clock started now; None where it is off (the default on the CPU)."""
    idle = resolve_idle(settings.keep_alive_s, engine.device)
    if idle is None:
        _log.info("keep-alive: off, the engine stays up%s", "" if settings.keep_alive_s == 0 else
                  " (the default on the CPU, where a sleep is a full stop; --keep-alive 5m turns it on)")
        return None
    how = f"vLLM's sleep mode, level {settings.sleep_level}" if engine.has_sleep_mode else "a full stop of the engine"
    _log.info("keep-alive: after %s with no request the engine sleeps (%s); the next request wakes it",
              describe_idle(idle), how)
    catalog = core.catalog
    keeper = KeepAlive(engine, tiers, core.events, core.metrics, idle_s=idle, level=settings.sleep_level,
                       busy=lambda: "a preflight" if catalog is not None and catalog.preflight.running else "",
                       notify=systemd.notify, awake_status=ready_status)
    keeper.start()
    return keeper


START_EXTENSION_S = 300  # what each sign of progress adds to systemd's start timeout


async def _extend_start_timeout(systemd: SystemdEnv, core: Core) -> None:
    """While the model is prepared, each sign of progress (a new stage, a step, a tensor, a
    megabyte) extends systemd's start timeout (``EXTEND_TIMEOUT_USEC``): a first ``--model demo``
    start that trains for minutes on a loaded machine outlasts ``TimeoutStartSec=600`` and is
    not killed for it, while a start that stops moving still fails when the extension runs out.
    The unit's status line shows the stage."""
    last = None
    while True:
        view = core.startup.view()
        mark = (view.stage, view.message, view.detail, None if view.unit == "s" else view.done)
        if view.stage and mark != last:
            systemd.notify(f"EXTEND_TIMEOUT_USEC={START_EXTENSION_S * 1_000_000}", f"STATUS={view.message}")
            last = mark
        await asyncio.sleep(1)


async def _watchdog(systemd: SystemdEnv, core: Core, stop: asyncio.Event) -> None:
    """Feed systemd's watchdog while the engine is healthy; stop the daemon when it died.

    A dead engine (its process killed, say) cannot be revived in place: report it, refuse
    work, and exit non-zero so the supervisor (systemd's Restart=on-failure) starts afresh.
    """
    interval = min(systemd.watchdog_interval_s or 1.0, 1.0)
    while not stop.is_set():
        engine = core.engine
        if engine is not None and engine.errored:
            _log.error("the engine died; stopping so that the service manager restarts the daemon")
            core.engine_died = True
            systemd.notify("STATUS=engine died; restarting")
            stop.set()
            return
        systemd.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def _freeze_startup_heap() -> None:
    """Move what start-up allocated (vLLM, torch, transformers: millions of objects) out of the
    garbage collector's sight, as vLLM's own server does once it is up (``freeze_gc_heap``):
    otherwise each full collection walks all of it while requests wait on the event loop
    (``--no-gc-freeze`` keeps the collector as it was: the benchmarks' control)."""
    gc.collect()
    gc.freeze()
