"""What the kernel says about a test's processes (read from /proc, independent of the code under test):
a process tree, whether a pid is alive (or gone within a bound), the TCP sockets a process holds."""

from __future__ import annotations

import os
import time
from pathlib import Path


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def survivors(pids: set[int], within_s: float) -> list[int]:
    """The pids still alive ``within_s`` seconds from now ([] as soon as none is: no fixed sleep)."""
    deadline = time.monotonic() + within_s
    while (left := sorted(p for p in pids if alive(p))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _ip(hex_addr: str) -> str:
    """'0200007F:1F90' (/proc/net/tcp, little-endian IPv4) -> '127.0.0.2'."""
    return ".".join(str(b) for b in reversed(bytes.fromhex(hex_addr.split(":")[0])))


def tcp_sockets(pid: int) -> list[tuple[str, int, str, int, str]]:
    """(local ip, local port, remote ip, remote port, state hex) of every TCP socket process ``pid`` holds,
    read from /proc (the kernel's view, independent of the code under test); IPv6 sockets as 'v6'."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                if table == "tcp6":
                    out.append(("v6", 0, "v6", 0, f[3]))
                    continue
                out.append((_ip(f[1]), int(f[1][-4:], 16), _ip(f[2]), int(f[2][-4:], 16), f[3]))
    return out


def listeners(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of every listening TCP socket of process ``pid``, from /proc: IPv4 dotted,
    IPv6 as '::' (any), '::1' or the hex of the address; '0.0.0.0' and '::' are the wildcards."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and f[3] == "0A":
                addr, port = f[1].split(":")
                ip = _ip(f[1]) if table == "tcp" else {"0" * 32: "::", "0" * 24 + "01000000": "::1"}.get(addr, addr)
                out.append((ip, int(port, 16)))
    return out


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes
