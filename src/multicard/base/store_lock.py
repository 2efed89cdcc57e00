"""One run per checkpoint folder, wherever it is: a lock made of objects on the store, so that it holds on
object storage (which has no file locks) as on a shared or local disk.

Each run that wants the folder writes its own lock object, `.multicard-lock-<ns>-<random>`, naming its
holder (host, pid, start) and when it was last renewed, then lists the folder: it holds the lock if no
other live lock object is there, and else removes its own and is refused. Two runs that start at once
may both be refused (run one again), never both admitted: each lists after its own write, so the later
lister sees the other's object (object stores and local disks list what was written before; S3, GCS and
Azure are strongly consistent).

The holder renews its object every RENEW_S seconds. A lock object is stale — its run ended without
releasing it (killed, its node lost) — once it has not been renewed for STALE_S seconds, or at once
where it names this host and a process that is no longer running; a stale one is removed, and the run
taking over says so. A run that ends releases its lock (removes its object).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from multicard.base.errors import UserError
from multicard.base.store import Store

PREFIX = ".multicard-lock-"
RENEW_S = 30.0  # the holder rewrites its lock object this often
STALE_S = 120.0  # a lock object not renewed for this long belongs to a run that is gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def stale(holder: dict[str, Any], now: float) -> bool:
    """Whether a lock object's holder is gone: not renewed for STALE_S, or a process of this host no
    longer running."""
    if now - float(holder.get("renewed", 0)) > STALE_S:
        return True
    return holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0)))


def described(holder: dict[str, Any], now: float) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(float(holder.get("since", 0))))
    renewed = max(0.0, now - float(holder.get("renewed", 0)))
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {since}, renewed {renewed:.0f} s ago"


class StoreLock:
    """The lock of the folder `store`, given for `key` (checkpoint.dir): `acquire`, then `release`."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key
        self.name = f"{PREFIX}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
        self.since = time.time()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self) -> bytes:
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": self.since, "renewed": time.time()}
        return json.dumps(holder).encode()

    def _others(self, say: Callable[[str], None]) -> list[dict[str, Any]]:
        """The live lock objects of other runs; stale ones removed, and said."""
        live = []
        for name in sorted(n for n in self.store.listing() if n.startswith(PREFIX) and n != self.name):
            try:
                holder = json.loads(self.store.read(name))
            except (UserError, ValueError):
                continue  # removed meanwhile (its run released it), or half-written: not a holder
            now = time.time()
            if stale(holder, now):
                self.store.remove(name)
                say(f"{self.key}={self.store.url}: taking over from a run that ended without releasing it "
                    f"({described(holder, now)})")  # fmt: skip
            else:
                live.append(holder)
        return live

    def acquire(self, say: Callable[[str], None]) -> None:
        """Hold the lock, or fail in one line naming the run that holds it."""
        others = self._others(say)
        if not others:
            self.store.write(self.name, self._record())
            others = self._others(say)
            if others:
                self.store.remove(self.name)
        if others:
            raise UserError(
                f"{self.key}={self.store.url} is in use by another run ({described(others[0], time.time())}); "
                f"wait for it to end, stop it, or choose another {self.key} (a lock not renewed for {STALE_S:g} s "
                f"is taken over: docs/cloud.md)"
            )
        self._renewer = threading.Thread(target=self._renew, name="multicard-lock", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            with contextlib.suppress(UserError):  # the store is unreachable now: the next renewal tries again
                self.store.write(self.name, self._record())

    def release(self) -> None:
        """Stop renewing and remove the lock object (once; a store gone by now leaves it to go stale)."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        retries, self.store.retries = self.store.retries, 0
        try:
            with contextlib.suppress(UserError):
                self.store.remove(self.name)
        finally:
            self.store.retries = retries
