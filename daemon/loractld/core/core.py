"""The daemon's operations, knowing nothing of gRPC or HTTP.

Every front end — the gRPC servicer on the Unix socket (``loractld.api.grpc_service``), the
OpenAI-compatible HTTP app (``loractld.api.http``), the Ollama routes and the Dynamo worker — is
a thin translation over :class:`Core`: generate, pull, list, show, load, evict, pin, unpin,
remove, events, metrics and status are written once, and fail only with domain errors
(``loractl.errors``), which each door maps to its own status codes and error schema.

``Core`` is composed of one part per concern, each in its own module:

- :mod:`loractld.core.state`: what it holds and how operations wait for it (draining, a dead engine);
- :mod:`loractld.core.requests`: the request path (resolve, prepare, run, admission) for every door;
- :mod:`loractld.core.tier_ops` and :mod:`loractld.core.disk_ops`: the engine's tiers and the disk's;
- :mod:`loractld.core.merges`: weighted merges of stored adapters, installed as a pull installs;
- :mod:`loractld.core.profiles`: profiles (named models made of adapters), and what they add to a request;
- :mod:`loractld.core.reports`: status and metrics, read-only, apart from the request path.

Each module states its own invariants; the store owns the adapter folders' leases and their GC
(``loractld.store.leases``), and deletes a replaced or removed revision's folder once no name
and no lease holds it.
"""

from __future__ import annotations

from loractld.core.disk_ops import DiskOps
from loractld.core.merges import MergeOps
from loractld.core.profiles import ProfileOps
from loractld.core.reports import Reports
from loractld.core.requests import RequestPath
from loractld.core.state import CoreState
from loractld.core.tier_ops import TierOps


class Core(RequestPath, ProfileOps, TierOps, DiskOps, MergeOps, Reports, CoreState):
    """The daemon's state (catalog, engine, tiers, events, metrics, work in flight) and its
    operations; the front ends hold no state of their own beyond their connections."""
