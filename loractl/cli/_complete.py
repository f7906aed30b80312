"""Shell completion of adapter names, asked of the running daemon at TAB time.

The committed completion scripts are thin shims that call back into ``loractl``, so this
runs on every TAB: it must be quick and silent, and a daemon that is down completes nothing.
"""

from __future__ import annotations

import asyncio


def adapter_names(incomplete: str) -> list[str]:
    from loractl.client import Client

    async def names() -> list[str]:
        async with Client(timeout=1.0) as client:
            return [a["name"] for a in await client.list()]

    try:
        return [n for n in asyncio.run(asyncio.wait_for(names(), 1.5)) if n.startswith(incomplete)]
    except Exception:  # noqa: BLE001 - completion must never print an error into the shell
        return []
