"""Ollama's API on the HTTP door (``loractld --http``), beside OpenAI's, as Ollama serves both on
one port: ``loractld --http 127.0.0.1:11434`` stands in for Ollama.

Routes: ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``, ``POST /api/pull``,
``DELETE /api/delete``, ``POST /api/chat``, ``POST /api/generate``, ``POST /api/create``,
``POST /api/copy``, ``HEAD``/``POST /api/blobs/sha256:<hex>`` (``create``: profiles made of
uploaded adapter files), ``GET /api/version``, and ``GET``/``HEAD /`` ("Ollama is running").
Every stored adapter and profile is a model (``names``: how the
names map), generation is the OpenAI door's (``generation``; ``dicts`` reads its answers as
dicts), options are mapped or refused by
name (``options``), ``keep_alive`` moves adapters between the tiers within the trust rules
(``residency``), failures are in Ollama's shape (``errors``). Not served: embeddings, image
inputs, ``push``, and ``create`` of a new base model (``files``) or ``quantize``: the daemon
serves the one base model it started with.

The door's guard applies here as on every route (API key or loopback Host names); which
routes change state, for its socket rule, is said here: :data:`ONLY_READ_OR_GENERATE` (POST
routes that do not) and :data:`OPERATIONS` (the audit's name for those that do).
"""

from __future__ import annotations

# POST routes that only read or generate from stored adapters: the guard treats them as GETs.
ONLY_READ_OR_GENERATE = frozenset({"/api/chat", "/api/generate", "/api/show"})
# Routes that change state, as the audit log names their operation.
OPERATIONS = {"/api/pull": "pull", "/api/delete": "rm", "/api/create": "create", "/api/copy": "copy"}


def operation_of(path: str) -> str:
    """The audit's name for a state-changing route whose path carries a value (a blob's digest)."""
    return "upload" if path.startswith("/api/blobs/") else path


def register(app, core, settings, *, openai=None) -> None:
    """Add Ollama's routes to the HTTP door's FastAPI ``app``; ``openai``: the OpenAI door whose
    ``chat_dict``/``completion_dict`` answer generation. Imported here, not at the top: the
    routes use the door's body reader, and the door imports this package."""
    from loractld.api.ollama.routes import add_routes

    add_routes(app, core, settings, openai)


def wrap(asgi_app):
    """The door's ASGI app with failures on Ollama's routes in Ollama's shape (``errors``)."""
    from loractld.api.ollama.errors import OllamaErrors

    return OllamaErrors(asgi_app)
