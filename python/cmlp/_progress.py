"""A progress bar for fit(): tqdm when it is installed, otherwise one line redrawn in place."""
import sys
import time
from typing import Any, Optional


class _PlainBar:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.post = ""
        self._last = 0.0
        self._start = time.perf_counter()

    def update(self, k: int) -> None:
        self.n += k
        now = time.perf_counter()
        if now - self._last >= 0.1 or self.n >= self.total:
            self._last = now
            self._draw()

    def set_postfix_str(self, s: str) -> None:
        self.post = s

    def _draw(self) -> None:
        frac = self.n / self.total if self.total else 1.0
        filled = int(frac * 30)
        bar = "#" * filled + "." * (30 - filled)
        secs = time.perf_counter() - self._start
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total} {secs:5.1f}s {self.post}   ")
        sys.stderr.flush()

    def close(self) -> None:
        self._draw()
        sys.stderr.write("\n")
        sys.stderr.flush()


class _Guarded:
    """A bar whose drawing cannot end the training: where stderr fails (closed, a broken pipe,
    a full disk), the bar stops drawing and training goes on."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def _call(self, name: str, *args: Any) -> None:
        if self._bar is None:
            return
        try:
            getattr(self._bar, name)(*args)
        except (OSError, ValueError, AttributeError):  # ValueError: a closed file
            self._bar = None

    def update(self, k: int) -> None:
        self._call("update", k)

    def set_postfix_str(self, s: str) -> None:
        self._call("set_postfix_str", s)

    def close(self) -> None:
        self._call("close")


def make_bar(total: int, desc: str, enabled: bool) -> Optional[Any]:
    if not enabled or sys.stderr is None:  # pythonw, or stderr closed (2>&-)
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Guarded(_PlainBar(total, desc))
    try:
        return _Guarded(tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True))
    except (OSError, ValueError, AttributeError):
        return None
