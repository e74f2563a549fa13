"""Dataset loading for cmlp: the IDX file format (raw or gzip) and the MNIST and
Fashion-MNIST sets, read from local files only. Nothing is downloaded and nothing is
cached; every call reads the files again."""

import gzip
import math
import os
import sys
import zlib
from typing import Callable, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

from ._arrays import as_flag

__all__ = ["load_idx", "mnist", "fashion_mnist"]

# (x_train, y_train), (x_test, y_test): uint8 images [N, 784] and uint8 labels [N]
Split = Tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]
Dataset = Tuple[Split, Split]

# IDX type code -> big-endian dtype of the payload.
_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"
# Deflate cannot expand data by more than about 1032:1, so a gzip file of n bytes
# decompresses to at most this many times n; used to reject absurd dims up front.
_GZIP_MAX_RATIO = 1100
_CHUNK = 1 << 22

_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_FASHION_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


def _read_exact(f, n):
    """Reads up to n bytes, growing the buffer only as data arrives (so a header that
    lies about its size cannot force a huge allocation). Returns fewer on EOF."""
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(min(_CHUNK, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return buf


def _parse_idx(f, path, stored_size, compressed, check=None):
    """Reads an IDX stream whose stored (on-disk) size is stored_size bytes; check(dims, dtype)
    refuses a header before its payload is read."""
    head = f.read(4)
    if len(head) < 4:
        raise ValueError(
            f"{path}: not an IDX file: expected a 4-byte header, found {len(head)} bytes")
    if head[0] != 0 or head[1] != 0:
        raise ValueError(
            f"{path}: not an IDX file: expected the first two bytes to be 00 00, "
            f"found {head[0]:02x} {head[1]:02x}")
    code, ndim = head[2], head[3]
    if code not in _IDX_TYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_TYPES)
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02X} (expected one of {known})")
    if ndim < 1:
        raise ValueError(f"{path}: IDX header gives 0 dimensions (expected at least 1)")
    if ndim > 32:  # NumPy's limit is 32 or 64 dimensions; images and labels have 3 and 1
        raise ValueError(f"{path}: IDX header gives {ndim} dimensions (at most 32 are supported)")
    raw_dims = f.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise ValueError(
            f"{path}: truncated IDX header: expected {4 * ndim} bytes of dimensions "
            f"for ndim={ndim}, found {len(raw_dims)}")
    dims = tuple(int(d) for d in np.frombuffer(raw_dims, dtype=">u4"))
    dtype = _IDX_TYPES[code]
    header = 4 + 4 * ndim
    # Python ints: the product cannot overflow, and it is checked before allocating.
    expected = math.prod(dims) * dtype.itemsize

    if not compressed and header + expected != stored_size:
        what = "truncated" if header + expected > stored_size else "trailing bytes"
        raise ValueError(
            f"{path}: {what}: shape {dims} of {dtype.name} needs {header + expected} bytes "
            f"({header} header + {expected} data), found {stored_size} bytes")
    if compressed and expected > _GZIP_MAX_RATIO * stored_size + 1024:
        raise ValueError(
            f"{path}: IDX header claims shape {dims} of {dtype.name} ({expected} bytes of "
            f"data), more than a {stored_size}-byte gzip file can hold: truncated, or not an IDX file")

    if math.prod(d for d in dims if d) * dtype.itemsize > sys.maxsize:  # (NumPy refuses such a shape, even empty)
        raise ValueError(f"{path}: IDX header gives shape {dims}, too large for an array")
    if check is not None:
        check(dims, dtype.newbyteorder("="))
    payload = _read_exact(f, expected)
    if len(payload) < expected:
        raise ValueError(
            f"{path}: truncated: shape {dims} of {dtype.name} needs {expected} bytes of data "
            f"after the {header}-byte header, found {len(payload)}")
    if compressed and f.read(1):
        raise ValueError(
            f"{path}: trailing bytes after the {expected} bytes of data that shape {dims} "
            f"of {dtype.name} needs")
    arr = np.frombuffer(payload, dtype=dtype).reshape(dims)
    # frombuffer on a bytearray is writable; convert only when the byte order differs.
    return arr.astype(dtype.newbyteorder("="), copy=False)


def load_idx(path: "Union[str, bytes, os.PathLike[str], os.PathLike[bytes]]",
             _check: Optional[Callable[[Tuple[int, ...], np.dtype], None]] = None) -> np.ndarray:
    """Reads an IDX file (the MNIST format), raw or gzip-compressed (detected by its
    magic bytes, not its name), and returns a native-endian array of the stored shape.

    Raises FileNotFoundError if path does not exist and ValueError if the file is not a
    well-formed IDX file: bad magic, unknown type code, no dimensions, a size that does
    not match the header exactly, or a corrupt gzip stream. (_check(dims, dtype): the caller's
    own test of the header, made before the payload is read.)"""
    path = os.fsdecode(path)
    if os.path.exists(path) and not os.path.isfile(path):  # a directory, a pipe, a device: not opened
        raise ValueError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        stored_size = os.fstat(f.fileno()).st_size
        compressed = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        if not compressed:
            return _parse_idx(f, path, stored_size, compressed=False, check=_check)
        try:
            with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                return _parse_idx(gz, path, stored_size, compressed=True, check=_check)
        except (OSError, EOFError, zlib.error) as e:
            if isinstance(e, gzip.BadGzipFile) and str(e).startswith("Not a gzipped file"):
                # (the file starts as gzip: this is what follows its stream)
                raise ValueError(f"{path}: bytes that are not gzip data follow its gzip stream ({e}); gunzip "
                                 "drops them with a warning") from e
            raise ValueError(f"{path}: corrupt or truncated gzip data: {e}") from e


def _find_dir(dirs):
    """Returns (dir, {name: path}) for the first directory holding all four files, raw
    or .gz (raw preferred), or (None, report) where report says what each dir lacked."""
    report = []
    for d in dirs:
        found, missing = {}, []
        for name in _MNIST_FILES:
            for candidate in (name, name + ".gz"):
                p = os.path.join(d, candidate)
                if os.path.isfile(p):
                    found[name] = p
                    break
                if os.path.isdir(d) and not os.access(d, os.X_OK):  # (isfile says False: it cannot look)
                    raise PermissionError(f"{d}: permission denied: its files cannot be looked up (the "
                                          "directory lacks search permission)")
            else:
                missing.append(name)
        if not missing:
            return d, found
        if os.path.exists(d) and not os.path.isdir(d):
            report.append(f"  {d} (not a directory)")
        elif not os.path.isdir(d):
            report.append(f"  {d} (no such directory)")
        elif found:
            report.append(f"  {d} (missing {', '.join(missing)})")
        else:
            report.append(f"  {d} (none of the files)")
    return None, report


class _NotDownloaded(FileNotFoundError, RuntimeError):
    """download=True with no files to read: a FileNotFoundError as every missing set's, and a
    RuntimeError as torchvision's failed download (code written for either catches it)."""


def _load_set(title, dirs, how_to_get, download):
    download = as_flag("download", download)
    dirs = [os.path.abspath(d) for d in dirs]
    d, found = _find_dir(dirs)
    if d is None and download:  # (where the files are, download=True reads them, as torchvision's)
        raise _NotDownloaded(
            f"{title}: download=True is not supported; cmlp never fetches data from the "
            f"internet. Searched, in order:\n" + "\n".join(f"  {d}" for d in dirs)
            + f"\n{how_to_get}")
    if d is None:
        raise FileNotFoundError(
            f"{title} not found. Looked for {', '.join(_MNIST_FILES)} (each raw or .gz) "
            f"in:\n" + "\n".join(found) + f"\n{how_to_get}")

    def pair(images_name, labels_name):
        xp, yp = found[images_name], found[labels_name]

        # each file's header is checked before its payload is read (a gzip file of a few MB can
        # claim gigabytes): the labels first, whose count the images must have
        def labels(dims, dtype):
            if dtype != np.uint8 or len(dims) != 1:
                raise ValueError(f"{yp}: expected uint8 labels of shape [N], found {dtype} of shape {dims}")

        def images(dims, dtype):
            if dtype != np.uint8 or len(dims) != 3 or dims[1:] != (28, 28):
                raise ValueError(
                    f"{xp}: expected uint8 images of shape [N, 28, 28], "
                    f"found {dtype} of shape {dims}")
            if dims[0] != y.shape[0]:
                raise ValueError(
                    f"{title}: {xp} has {dims[0]} images but {yp} has {y.shape[0]} labels")

        y = load_idx(yp, _check=labels)
        x = load_idx(xp, _check=images)
        if y.size and int(y.max()) >= 10:
            raise ValueError(f"{yp}: labels must be in 0..9, found {int(y.max())}")
        return x.reshape(x.shape[0], 28 * 28), y

    return pair(*_MNIST_FILES[:2]), pair(*_MNIST_FILES[2:])


def _candidate_dirs(root, subdirs):
    if not isinstance(root, (str, bytes, os.PathLike)):
        raise TypeError(f"root must be a directory's path (str, bytes or os.PathLike), got {root!r}")
    root = os.fsdecode(root)
    return [root] + [os.path.join(root, s) for s in subdirs]


def mnist(root: "Union[str, bytes, os.PathLike[str]]" = "data", download: bool = False) -> Dataset:
    """Loads MNIST from root, root/mnist or root/MNIST/raw (the first holding all four
    IDX files, raw or .gz). Returns (x_train, y_train), (x_test, y_test): images uint8
    [N, 784], labels uint8 [N]. download=True reads the files where they are, and raises
    RuntimeError where they are not (nothing is fetched)."""
    dirs = _candidate_dirs(root, ["mnist", os.path.join("MNIST", "raw")])
    how = (f"Place the four MNIST IDX files ({', '.join(_MNIST_FILES)}, raw or .gz) "
           f"in {os.path.abspath(dirs[0])}.")
    return _load_set("MNIST", dirs, how, download)


def fashion_mnist(root: "Optional[Union[str, bytes, os.PathLike[str]]]" = None, download: bool = False) -> Dataset:
    """Loads Fashion-MNIST. With root given, looks in root, root/fashion-mnist and
    root/FashionMNIST/raw; with root=None, in $CMLP_DATA_DIR/fashion-mnist (if set),
    ./data/fashion-mnist, ./data/FashionMNIST/raw, ~/.cache/cmlp/fashion-mnist and
    /usr/share/datasets/fashion-mnist. Returns as mnist() does."""
    if root is not None:
        dirs = _candidate_dirs(root, ["fashion-mnist", os.path.join("FashionMNIST", "raw")])
    else:
        dirs = []
        env = os.environ.get("CMLP_DATA_DIR")
        if env:
            dirs.append(os.path.join(env, "fashion-mnist"))
        dirs += [
            os.path.join("data", "fashion-mnist"),
            os.path.join("data", "FashionMNIST", "raw"),
            os.path.join(os.path.expanduser("~"), ".cache", "cmlp", "fashion-mnist"),
            _FASHION_SYSTEM_DIR,
        ]
    if root is not None and _find_dir([_FASHION_SYSTEM_DIR])[0] is not None:
        how = (f"It is installed in {_FASHION_SYSTEM_DIR} (Debian's dataset-fashion-mnist), where root=None looks "
               f"(or root={_FASHION_SYSTEM_DIR!r}); or place the four IDX files ({', '.join(_MNIST_FILES)}, raw or "
               f".gz) in one of the directories above.")
    else:
        how = (f"To get it: apt-get install dataset-fashion-mnist (installs into "
               f"{_FASHION_SYSTEM_DIR}), or place the four IDX files ({', '.join(_MNIST_FILES)}, "
               f"raw or .gz) in one of the directories above.")
    return _load_set("Fashion-MNIST", dirs, how, download)
