"""Files written whole or not at all."""
import errno
import os
import stat
import secrets
from typing import IO, Callable, List


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
    made: List[str] = []  # the temporary file's name, known before the file exists
    try:
        fd = _open_temporary(path, directory, made)
        try:
            os.fchmod(fd, mode & 0o777 if mode is not None else 0o666 & ~_umask())  # never set-id bits
        except BaseException:
            os.close(fd)  # fdopen has not taken it over
            raise
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(made[0], target)
    except BaseException:  # Ctrl-C too, wherever it comes: no temporary file stays behind, nor its descriptor
        for name in made:
            _close_descriptors_of(name)
            try:
                os.unlink(name)
            except OSError:
                pass
        raise


def _close_descriptors_of(name: str) -> None:
    """Closes this process's descriptors of the file `name`: one that an interrupt left unnamed
    (it came as os.open returned, before its number was kept) is found by its file (Linux's
    /proc; elsewhere nothing is done). A file object's descriptor is closed already."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == name:
                os.close(int(fd))
        except (OSError, ValueError):
            pass


def _open_temporary(path: str, directory: str, made: List[str]) -> int:
    """A new file of a random name in directory, opened for writing; its name goes into `made`
    before it is created. Errors name the caller's path, not the temporary file."""
    for _ in range(100):
        name = os.path.join(directory, f".cmlp-{secrets.token_hex(8)}.tmp")
        made[:] = [name]
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except FileExistsError:
            made.clear()  # another's file
        except OSError as e:
            made.clear()
            raise type(e)(e.errno, f"cannot save to {path!r}: {e.strerror} (directory {directory!r})") from None
    raise FileExistsError(errno.EEXIST, f"cannot save to {path!r}: no free temporary name in {directory!r}")
