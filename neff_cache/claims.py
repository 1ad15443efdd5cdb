"""Who holds a compile claim: the process record a claim stores, and whether it is stale.

Note [Claims]
"One compile per key across processes" is a claim row ``claim/v{N}/{key}`` added with
``Cache.add`` (atomic: exactly one concurrent add succeeds) and an expiry. Claims and the
persistent event counters live in a second cache (``<directory>/control``) with no size limit: LRU
pressure from artifacts must never evict a live claim, and ``clear()`` of artifacts must not drop
them.

Note [Claim holders]
A claim records the process holding it: its host (hostname, boot id and pid namespace), pid and
start time (``/proc/<pid>/stat`` field 22, clock ticks since boot). On the holder's own host a
claim whose process is gone, is a zombie, or is another process under a reused pid (another start
time) is stale: ``claim`` takes it over at once and ``is_claimed`` says False, so a holder killed
by SIGKILL, SIGTERM or the OOM killer blocks neither new processes nor those already waiting for
it. Only a claim made on another host (a network directory) cannot be checked; it holds until its
``ttl_s``. ``hand_over`` passes a claim to another process (the compile worker that finishes a
compile after its program exited, Note [Compiles that outlive the program] in neff_cache.jobs):
the claim then belongs to that process rather than to a store instance, and ``release`` in that
process frees it.
"""

from __future__ import annotations

import functools
import json
import os
import socket


@functools.cache
def _host() -> str:
    """This machine and pid namespace, as claims record it (Note [Claim holders])."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            parts.append(boot_id.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "|".join(parts)


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if no such process is alive.
    Without /proc (macOS), "" for any live process: liveness by pid only."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        if os.path.exists("/proc/self/stat"):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    fields = text[text.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return fields[19].decode()


def _holder(pid: int, owner: str | None) -> str | None:
    """The claim value naming process ``pid`` (None if it is not alive); ``owner`` names the store
    instance, None for a claim that belongs to the process (Note [Claim holders])."""
    start = _process_start(pid)
    if start is None:
        return None
    return json.dumps({"owner": owner, "host": _host(), "pid": pid, "start": start}, sort_keys=True)


def _stale(held: str) -> bool:
    """Whether the claim value ``held`` names a process of this host that is gone."""
    try:
        holder = json.loads(held)
        host, pid, start = holder["host"], holder["pid"], holder["start"]
    except (ValueError, TypeError, KeyError):
        return False  # not a holder record (an older version's claim): it lapses with its ttl
    return host == _host() and type(pid) is int and _process_start(pid) != start
