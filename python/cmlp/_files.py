"""Files written whole or not at all."""
import errno
import os
import stat
import tempfile
from typing import IO, Callable


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting (briefly) and restoring
    os.umask(mask)
    return mask


def atomic_write(path: "os.PathLike[str] | str", write: Callable[[IO[bytes]], None]) -> None:
    """Calls write(f) on a temporary file beside path, then renames it over path: a crash leaves
    the old file (or none). A symbolic link's target is what is replaced (the link stays); a path
    that is not a regular file (/dev/null, a FIFO) is written through, as open() would. The new
    file takes the old one's permissions, or those the umask gives a new file. Errors name the
    caller's path."""
    path = os.fsdecode(path)  # str, bytes or os.PathLike
    if os.path.isdir(path) or not os.path.basename(path):
        raise IsADirectoryError(f"cannot save to {path!r}: it {'is' if os.path.isdir(path) else 'names'} a directory")
    target = os.path.realpath(path)
    if os.path.islink(target):  # realpath stops at a loop of links
        raise OSError(errno.ELOOP, f"cannot save to {path!r}: too many levels of symbolic links")
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "wb") as f:
            write(f)
        return
    directory = os.path.dirname(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".cmlp-", suffix=".tmp", dir=directory)
    except OSError as e:  # said of the caller's path, not of the temporary file's
        raise type(e)(e.errno, f"cannot save to {path!r}: {e.strerror} (directory {directory!r})") from None
    try:
        try:
            os.fchmod(fd, mode & 0o777 if mode is not None else 0o666 & ~_umask())  # never set-id bits
        except BaseException:
            os.close(fd)  # fdopen has not taken it over
            raise
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
