"""Files written whole or not at all."""
import os
import tempfile
from typing import IO, Callable


def atomic_write(path: "os.PathLike[str] | str", write: Callable[[IO[bytes]], None]) -> None:
    """Calls write(f) on a temporary file beside path, then renames it over path: a crash leaves
    the old file (or none). Errors name the caller's path."""
    path = os.fsdecode(path)  # str, bytes or os.PathLike
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot save to {path!r}: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".cmlp-", suffix=".tmp", dir=directory)
    except OSError as e:  # said of the caller's path, not of the temporary file's
        raise type(e)(e.errno, f"cannot save to {path!r}: {e.strerror} (directory {directory!r})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
