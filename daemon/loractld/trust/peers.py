"""Who is calling, as the kernel reports it, and who may change the daemon's state.

One rule for every door: root, the daemon's own user, and members of its socket group may
change state (pull, load, evict, pin, unpin, rm, generation from a folder); everyone else
may read and generate from stored adapters. The socket learns the caller from SO_PEERCRED;
loopback HTTP from the kernel's table of TCP sockets (``/proc/net/tcp{,6}`` names the owner
of the client's end of the connection).

Invariant: an unknown caller (no table, no matching row, not loopback) is never allowed to
change state: a lookup that fails refuses, it never grants.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import struct
from pathlib import Path

PROC_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def may_change_state(uid: int, gid: int | None, socket_gid: int | None) -> bool:
    """The socket's rule: root, the daemon's own user, or a member of its socket group.

    ``gid`` is the caller's primary group when the kernel reported it (the socket), else
    None and the user database's primary group counts (HTTP)."""
    if uid in (0, os.getuid()):
        return True
    if socket_gid is None:
        return False
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return gid == socket_gid
    if (gid if gid is not None else user.pw_gid) == socket_gid:
        return True
    try:
        return user.pw_name in grp.getgrgid(socket_gid).gr_mem
    except KeyError:
        return False


def tcp_peer_uid(client: tuple[str, int], server: tuple[str, int], tables=PROC_TABLES) -> int | None:
    """The uid owning the loopback TCP socket ``client`` connected to ``server``, or None.

    Both ends of a loopback connection are rows of this host's table; the client's row is the
    one whose local address is ``client`` and whose remote address is ``server``. Only loopback
    clients are looked up: another machine's user ids mean nothing here."""
    try:
        want = (_address(*client), _address(*server))
    except ValueError:
        return None
    if not want[0][0].is_loopback:
        return None
    for table in tables:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            try:
                if (_proc_address(fields[1]), _proc_address(fields[2])) == want:
                    return int(fields[7])
            except (IndexError, ValueError):
                continue
    return None


def _address(host: str, port: int) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(port)


def _proc_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``0100007F:1F90`` (the kernel prints each 32-bit word of the address in host byte order)."""
    hex_ip, hex_port = text.split(":")
    raw = b"".join(struct.pack("=I", int(hex_ip[i:i + 8], 16)) for i in range(0, len(hex_ip), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hex_port, 16)
