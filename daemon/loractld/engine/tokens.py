"""Tokenizing on the daemon's event loop, at the cost of the tokenizer itself.

A short prompt is tokenized on the loop (``Engine._off_loop``). For an HF fast tokenizer,
``tokenizer.encode`` spends more time in transformers' Python (its keyword handling and a
``BatchEncoding`` per call) than in the Rust tokenizer it calls: 29 µs against 17 µs for a
25-token chat prompt on the tiny model. ``encoder`` calls the Rust tokenizer directly where that
gives the very ids transformers gives for this tokenizer, checked at start on probes that cover
special-token text, spacing and non-ASCII; otherwise (a slow tokenizer, or one whose wrapper
changes the ids) it keeps ``tokenizer.encode``. Invariant: both paths give the same ids.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

_log = logging.getLogger(__name__)

Encode = Callable[[str, bool], list[int]]

_PROBES = ("Hello, world!", "  leading and trailing spaces  ", "line one\nline two\n\n\ttab",
           "naïve café — 東京 🙂", "a" * 300, "")


def _probes(tokenizer: Any) -> list[str]:
    specials = [t for t in (getattr(tokenizer, "all_special_tokens", None) or []) if isinstance(t, str)][:4]
    return [*_PROBES, *(f"{s}text after {s}" for s in specials)]


def encoder(tokenizer: Any) -> Encode:
    """``encode(text, add_special_tokens)`` for ``tokenizer`` (see the module's doc)."""

    def through_transformers(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return through_transformers

    def through_backend(text: str, add_special_tokens: bool) -> list[int]:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    try:
        same = all(through_backend(text, special) == through_transformers(text, special)
                   for text in _probes(tokenizer) for special in (True, False))
    except Exception:  # noqa: BLE001 - any doubt keeps transformers' own path
        _log.debug("the tokenizer's backend could not be checked", exc_info=True)
        same = False
    if not same:
        _log.info("tokenizing through transformers: the Rust tokenizer alone did not give its ids for this model")
        return through_transformers
    return through_backend
