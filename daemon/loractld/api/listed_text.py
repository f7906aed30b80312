"""``loractl ls --json``'s text, written by the daemon (``ListRequest.json``) and kept between
listings, so that a listing of 10,000 adapters costs neither side the writing of 10,000 entries.

Invariants:
- :meth:`ListedText.reply` gives exactly ``loractl.message_json.list_json`` of each view's
  text (``write``), the text the CLI writes from the listing's messages (tests/test_store.py
  compares the two through a real daemon; tests/test_store_listing.py over changing listings).
- An entry's text is reused only for a view that is an unchanged copy of the same base view
  (``AdapterView.changes() == {}``): the base is the manifest's view, the same object while its
  store entry is unchanged. Any other view is written afresh.
- Only the last listing is held: one bytes object (about 10 MB at 10,000 adapters) and each
  reusable entry's span in it. Kept as one object rather than 10,000 strings, the texts cost
  their size and no allocator's overhead, and an unchanged listing is answered with the same
  object, no copy made.
"""

from __future__ import annotations

from collections.abc import Callable

from loractl.message_json import LIST_CLOSE, LIST_OPEN, LIST_SEPARATOR
from loractld.views import AdapterView

_OPEN, _SEPARATOR, _CLOSE = LIST_OPEN.encode(), LIST_SEPARATOR.encode(), LIST_CLOSE.encode()


class ListedText:
    """``write(view)``: one view's entry as text (``loractl.message_json.message_json``), or
    None where a field cannot be written as text (the caller then sends the messages)."""

    def __init__(self, write: Callable[[AdapterView], str | None]) -> None:
        self._write = write
        self._text = b"[]"                  # the last listing's text
        self._spans: dict[int, tuple[AdapterView, int, int]] = {}   # id(base): (base, start, end) in _text
        self._bases: list[AdapterView | None] = []   # each entry's base, None where written afresh

    def reply(self, views: list[AdapterView]) -> bytes | None:
        """``views`` as ``ls --json`` prints them (without the final new line), or None."""
        if not views:
            self._text, self._spans, self._bases = b"[]", {}, []
            return self._text
        if len(views) == len(self._bases) and all(map(_unchanged_copy, views, self._bases)):
            return self._text          # the same listing, the same object (10,000 at rest: 16-17 ms)
        old, old_spans, spans, bases = memoryview(self._text), self._spans, {}, []
        pieces: list = []              # bytes written now, or [start, end] runs of the last text
        at = len(_OPEN)                # where the next entry starts in the new text
        for view in views:
            base = view.base if view.changes() == {} else None   # None: not reusable
            held = old_spans.get(id(base)) if base is not None else None
            if held is not None and held[0] is base:   # id() is a key only while the view lives: kept
                start, end = held[1], held[2]
                size, last = end - start, pieces[-1] if pieces else None
                if type(last) is list and last[1] + len(_SEPARATOR) == start:
                    last[1] = end      # the run goes on: its separator is in the old text already
                else:
                    pieces.append([start, end])
            else:
                text = self._write(view)
                if text is None:
                    return None
                encoded = text.encode()
                pieces.append(encoded)
                size = len(encoded)
            if base is not None:
                spans[id(base)] = (base, at, at + size)
            bases.append(base)
            at += size + len(_SEPARATOR)
        text = _OPEN + _SEPARATOR.join([p if type(p) is bytes else old[p[0]:p[1]] for p in pieces]) + _CLOSE
        old.release()
        self._text, self._spans, self._bases = text, spans, bases
        return text


def _unchanged_copy(view: AdapterView, base: AdapterView | None) -> bool:
    return base is not None and view.__dict__.get("base") is base and view.changes() == {}
