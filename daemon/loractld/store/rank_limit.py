"""``--max-lora-rank`` from the installed set, when the user does not give it (issue 48).

vLLM sizes every device slot (and its CPU copies) at ``max_lora_rank``, so the limit is a cost
every adapter pays, not only the largest: one rank-64 adapter among rank-8 ones pads every slot
to 64. The default therefore comes from the store at start:

- it is never below :data:`FLOOR` (16, the fixed default before), so a store that used to be
  served still is, and an adapter pulled later is refused no more often than before;
- it is the smallest rank vLLM supports that covers the largest installed adapter, so an
  adapter placed in the store is served instead of refused at its first request;
- when few adapters force it up (an outlier), the daemon says which adapter, its rank, and what
  the rest would need, so a user can choose between padding and refusing it.

Reading a config costs one small file per adapter (10,000 adapters: one JSON read each, at
start only). A config that cannot be read is skipped here; the adapter's own validation names
the fault when it is used.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from loractl.errors import LoractlError
from loractld.store.disk import StoredAdapter
from loractld.store.peft import CONFIG_FILE, Ranks, next_supported_rank

FLOOR = 16
# Above the floor, a limit forced by at most this share of the adapters is called an outlier.
OUTLIER_SHARE = 0.1
_log = logging.getLogger("loractld.store")


@dataclass(frozen=True)
class RankLimit:
    rank: int
    outlier: str | None = None    # the warning, when a few adapters force the limit up


def largest_rank(adapter: StoredAdapter) -> int | None:
    try:
        config = json.loads((adapter.path / CONFIG_FILE).read_text())
        return Ranks.of(config).largest
    except (OSError, ValueError, LoractlError, AttributeError, TypeError):
        return None


def from_store(adapters: Iterable[StoredAdapter], given: int | None) -> RankLimit:
    """The engine's rank limit: ``given`` when the user gave one, else chosen from ``adapters``."""
    if given:
        return RankLimit(given)
    ranks = {a.name: r for a in adapters if not a.manifest.get("damaged") and (r := largest_rank(a)) is not None}
    if not ranks or max(ranks.values()) <= FLOOR:
        return RankLimit(FLOOR)
    limit = next_supported_rank(max(ranks.values()))
    above = sorted((name for name, r in ranks.items() if r > FLOOR), key=lambda n: (-ranks[n], n))
    if len(above) > OUTLIER_SHARE * len(ranks):
        return RankLimit(limit)
    rest = next_supported_rank(max([FLOOR, *(r for n, r in ranks.items() if n not in above)]))
    named = ", ".join(f"{n} (rank {ranks[n]})" for n in above[:3]) + (f" and {len(above) - 3} more" if len(above) > 3 else "")
    message = (f"--max-lora-rank {limit}, from the store: {named} force it up, and every adapter slot is padded "
               f"to rank {limit}; the other {len(ranks) - len(above)} of {len(ranks)} adapters need {rest}. "
               f"Pass --max-lora-rank {rest} to keep slots small (the larger adapters are then refused by name).")
    return RankLimit(limit, message)
