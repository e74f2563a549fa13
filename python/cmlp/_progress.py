"""A progress bar for fit(): on a terminal or in a notebook, tqdm when it is installed, otherwise
one line redrawn in place; written to a file or a pipe (a log), whole lines instead: one every 30
seconds and one when the epoch ends, with no carriage returns."""
import sys
import time
from typing import Any, Optional


LOG_INTERVAL = 30.0  # seconds between the lines of a bar written to a log


class _PlainBar:
    def __init__(self, total: int, desc: str, lines: bool = False) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.post = ""
        self._lines = lines  # whole lines (a log), not one redrawn in place (a terminal)
        self._start = time.perf_counter()
        self._last = self._start if lines else 0.0

    def update(self, k: int) -> None:
        self.n += k
        now = time.perf_counter()
        if self._lines:
            if now - self._last >= LOG_INTERVAL and self.n < self.total:
                self._last = now
                self._draw()
        elif now - self._last >= 0.1 or self.n >= self.total:
            self._last = now
            self._draw()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.post = s  # drawn at the next update (which the loop makes next)

    def _draw(self) -> None:
        frac = self.n / self.total if self.total else 1.0
        filled = int(frac * 30)
        bar = "#" * filled + "." * (30 - filled)
        secs = time.perf_counter() - self._start
        if self._lines:
            sys.stderr.write(f"{self.desc} [{bar}] {self.n}/{self.total} steps {secs:.1f}s {self.post}".rstrip() + "\n")
        else:
            sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total} {secs:5.1f}s {self.post}   ")
        sys.stderr.flush()

    def close(self) -> None:
        self._draw()
        if not self._lines:
            sys.stderr.write("\n")
        sys.stderr.flush()


class _Guarded:
    """A bar whose drawing cannot end the training: where stderr fails (closed, a broken pipe,
    a full disk, a binary stream that takes no text), the bar stops drawing and training goes on."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def _call(self, name: str, *args: Any) -> None:
        if self._bar is None:
            return
        try:
            getattr(self._bar, name)(*args)
        except (OSError, ValueError, AttributeError, TypeError):  # ValueError: a closed file; TypeError: bytes only
            self._bar = None

    def update(self, k: int) -> None:
        self._call("update", k)

    def set_postfix_str(self, s: str) -> None:
        """Drawn with the next update: tqdm's redraw now would show it beside the old count."""
        self._call("set_postfix_str", s, False)

    def close(self) -> None:
        self._call("close")


def make_bar(total: int, desc: str, enabled: bool) -> Optional[Any]:
    if not enabled or sys.stderr is None:  # pythonw, or stderr closed (2>&-)
        return None
    try:  # a notebook's stderr is no terminal, but draws tqdm's widget (and redraws a line)
        terminal = sys.stderr.isatty() or "ipykernel" in sys.modules
    except (OSError, ValueError, AttributeError):  # ValueError: a closed file
        return None
    if not terminal:
        return _Guarded(_PlainBar(total, desc, lines=True))
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]  # (an optional dependency without stubs)
    except ImportError:
        return _Guarded(_PlainBar(total, desc))
    try:
        return _Guarded(tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True))
    except (OSError, ValueError, AttributeError):
        return None
