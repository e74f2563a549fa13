"""CoreLock: a reentrant lock that Python code holds across calls into the C core.

Once the process's exit has begun (_cmlp.wait_for_calls, at the package's exit hook), a daemon
thread's next call into the core waits for the process's end without raising: parked, it keeps
every lock its Python frames hold. The exit's own callbacks use cmlp as ever, so one that needs
such a lock takes it over from the parked thread, which never runs again, instead of waiting
for ever. Until then it is a plain reentrant lock."""
import threading
from typing import Any, Optional

from . import _cmlp

_POLL_SECONDS = 0.05  # how often a waiting thread asks whether the holder is parked


class CoreLock:
    __slots__ = ("_lock", "_holder", "_count", "_over")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._holder: Optional[int] = None  # the thread holding it, while one does
        self._count = 0  # its holds (reentrant)
        self._over = threading.local()  # a thread's holds taken over from a parked holder

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if not blocking or timeout >= 0:
            if not self._lock.acquire(blocking, timeout):
                return False
        else:
            while not self._lock.acquire(timeout=_POLL_SECONDS):
                holder = self._holder
                if holder is not None and holder != me and _cmlp.parked(holder):
                    self._over.count = getattr(self._over, "count", 0) + 1
                    return True
        self._holder = me
        self._count += 1
        return True

    def release(self) -> None:
        if getattr(self._over, "count", 0):
            self._over.count -= 1
            return
        self._count -= 1
        if self._count == 0:
            self._holder = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
