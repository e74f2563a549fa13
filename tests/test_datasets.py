"""Tests for cmlp.datasets: IDX parsing (every type code, raw and gzip, every malformed
case) and the MNIST / Fashion-MNIST loaders on tiny fake data sets in tmp_path, plus the
real Fashion-MNIST from /usr/share/datasets/fashion-mnist when it is installed."""

import gzip
import os
import struct

import numpy as np
import pytest

from cmlp import datasets

TYPE_CODES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
SYSTEM_FASHION = "/usr/share/datasets/fashion-mnist"


def idx_bytes(arr, code):
    """The IDX encoding of arr, written independently of the module under test."""
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    return header + np.ascontiguousarray(arr, dtype=TYPE_CODES[code]).tobytes()


def write(path, data, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def sample(code, shape=(2, 3, 4)):
    n = int(np.prod(shape))
    dt = np.dtype(TYPE_CODES[code])
    if dt.kind == "f":
        vals = np.linspace(-1e3, 1e3, n) + 0.25
    else:
        info = np.iinfo(dt)
        vals = np.linspace(info.min, info.max, n).round()
    return vals.astype(dt.newbyteorder("=")).reshape(shape)


# ---------------------------------------------------------------- load_idx: valid files

@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("code", sorted(TYPE_CODES), ids=lambda c: f"0x{c:02X}")
def test_round_trip_every_type(tmp_path, code, gz):
    arr = sample(code)
    p = write(tmp_path / "a.idx", idx_bytes(arr, code), gz)
    out = datasets.load_idx(p)
    assert out.shape == arr.shape
    assert out.dtype == np.dtype(TYPE_CODES[code]).newbyteorder("=")
    assert out.dtype.isnative
    np.testing.assert_array_equal(out, arr)
    assert out.flags.writeable
    out[...] = 0  # writing to the result must not change what the next load returns
    np.testing.assert_array_equal(datasets.load_idx(p), arr)


def test_big_endian_decoding(tmp_path):
    raw = bytes([0, 0, 0x0B, 1, 0, 0, 0, 2]) + bytes([0x01, 0x02, 0xFF, 0xFE])
    out = datasets.load_idx(write(tmp_path / "x", raw))
    assert out.tolist() == [0x0102, -2]
    raw = bytes([0, 0, 0x0D, 1, 0, 0, 0, 1]) + struct.pack(">f", 1.5)
    assert datasets.load_idx(write(tmp_path / "y", raw)).tolist() == [1.5]
    raw = bytes([0, 0, 0x0C, 2, 0, 0, 0, 1, 0, 0, 0, 2]) + struct.pack(">ii", 1 << 20, -7)
    out = datasets.load_idx(write(tmp_path / "z", raw))
    assert out.shape == (1, 2) and out.tolist() == [[1 << 20, -7]]


def test_gzip_detected_by_magic_not_name(tmp_path):
    arr = sample(0x08, (3, 5))
    data = idx_bytes(arr, 0x08)
    np.testing.assert_array_equal(
        datasets.load_idx(write(tmp_path / "plain.gz", data, gz=False)), arr)
    np.testing.assert_array_equal(
        datasets.load_idx(write(tmp_path / "packed", data, gz=True)), arr)


def test_one_dim_and_empty(tmp_path):
    arr = np.arange(7, dtype=np.uint8)
    np.testing.assert_array_equal(
        datasets.load_idx(write(tmp_path / "a", idx_bytes(arr, 0x08))), arr)
    empty = np.zeros((0, 28, 28), np.uint8)
    out = datasets.load_idx(write(tmp_path / "b", idx_bytes(empty, 0x08), gz=True))
    assert out.shape == (0, 28, 28) and out.dtype == np.uint8


def test_accepts_str_and_pathlike(tmp_path):
    arr = sample(0x09, (4,))
    p = write(tmp_path / "a", idx_bytes(arr, 0x09))
    np.testing.assert_array_equal(datasets.load_idx(str(p)), arr)
    np.testing.assert_array_equal(datasets.load_idx(p), arr)


# ---------------------------------------------------------------- load_idx: bad files

@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_truncated_reports_expected_and_found(tmp_path, gz):
    data = idx_bytes(np.zeros((2, 3), np.int32), 0x0C)  # 12 header + 24 data
    p = write(tmp_path / "t.idx", data[:-5], gz)
    with pytest.raises(ValueError, match="truncated") as e:
        datasets.load_idx(p)
    msg = str(e.value)
    assert str(p) in msg
    assert ("36" in msg and "31" in msg) if not gz else ("24" in msg and "19" in msg)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_trailing_bytes(tmp_path, gz):
    data = idx_bytes(np.zeros((2, 3), np.uint8), 0x08) + b"\x00junk"
    p = write(tmp_path / "t.idx", data, gz)
    with pytest.raises(ValueError, match="trailing") as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value)


def test_garbage_after_gzip_member(tmp_path):
    data = gzip.compress(idx_bytes(np.zeros(4, np.uint8), 0x08)) + b"garbage!"
    p = write(tmp_path / "t.gz", data)
    with pytest.raises(ValueError, match="gzip"):
        datasets.load_idx(p)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("head, pattern", [
    (bytes([0, 1, 0x08, 1, 0, 0, 0, 1, 7]), "00 00"),
    (bytes([9, 0, 0x08, 1, 0, 0, 0, 1, 7]), "00 00"),
    (bytes([0, 0, 0x0A, 1, 0, 0, 0, 1, 7]), "type code 0x0A"),
    (bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 7]), "type code 0x07"),
    (bytes([0, 0, 0x08, 0]), "0 dimensions"),
    (bytes([0, 0, 0x08, 0, 7]), "0 dimensions"),
    (bytes([0, 0]), "4-byte header"),
    (b"", "4-byte header"),
    (bytes([0, 0, 0x08, 3, 0, 0, 0, 1, 0, 0]), "truncated IDX header"),
], ids=["magic1", "magic0", "code0A", "code07", "ndim0", "ndim0data", "short", "empty",
        "shortdims"])
def test_bad_header(tmp_path, head, pattern, gz):
    p = write(tmp_path / "bad", head, gz)
    with pytest.raises(ValueError, match=pattern) as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value)


def test_absurd_dims_raw_rejected_before_reading(tmp_path, monkeypatch):
    head = bytes([0, 0, 0x0E, 4]) + struct.pack(">IIII", *[0xFFFFFFFF] * 4)
    p = write(tmp_path / "huge", head + b"\x00" * 64)
    monkeypatch.setattr(datasets, "_read_exact", lambda *a: pytest.fail("read payload"))
    with pytest.raises(ValueError, match="truncated") as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value)


def test_absurd_dims_gzip_rejected_before_reading(tmp_path, monkeypatch):
    head = bytes([0, 0, 0x08, 2]) + struct.pack(">II", 1 << 20, 1 << 20)
    p = write(tmp_path / "huge.gz", head + b"\x00" * 64, gz=True)
    monkeypatch.setattr(datasets, "_read_exact", lambda *a: pytest.fail("read payload"))
    with pytest.raises(ValueError, match="can hold") as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value)


def test_corrupt_gzip(tmp_path):
    arr = np.arange(4096, dtype=np.int32)
    blob = bytearray(gzip.compress(idx_bytes(arr, 0x0C)))
    for i in range(20, len(blob) - 10, 7):
        blob[i] ^= 0x5A
    p = write(tmp_path / "c.gz", bytes(blob))
    with pytest.raises(ValueError, match="gzip") as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value)


def test_truncated_gzip_stream(tmp_path):
    blob = gzip.compress(idx_bytes(np.arange(4096, dtype=np.int32), 0x0C))
    p = write(tmp_path / "c.gz", blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="gzip") as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value)


def test_gzip_magic_with_bad_header(tmp_path):
    p = write(tmp_path / "c", b"\x1f\x8b\x00\x00garbage")
    with pytest.raises(ValueError, match="gzip"):
        datasets.load_idx(p)


def test_missing_file(tmp_path):
    p = tmp_path / "nope-idx3-ubyte"
    with pytest.raises(FileNotFoundError) as e:
        datasets.load_idx(p)
    assert "nope-idx3-ubyte" in str(e.value)


def test_not_a_regular_file_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "pipe-idx1-ubyte"
    os.mkfifo(fifo)  # opening a pipe for reading would wait for a writer forever
    for p in (fifo, tmp_path):
        with pytest.raises(ValueError, match=r"not a regular file"):
            datasets.load_idx(p)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_an_empty_shape_too_large_for_an_array_names_the_file(tmp_path, gz):
    head = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 0, 0xFFFFFFFF, 0xFFFFFFFF)  # no data, an impossible shape
    p = write(tmp_path / "empty-huge", head, gz=gz)
    with pytest.raises(ValueError, match="empty-huge: IDX header gives shape .* too large for an array"):
        datasets.load_idx(p)


@pytest.mark.parametrize("loader", ["mnist", "fashion_mnist"])
def test_a_root_that_is_no_path_is_named(loader):
    with pytest.raises(TypeError, match="root must be a directory's path"):
        getattr(datasets, loader)(root=3)


def test_more_dimensions_than_numpy_takes(tmp_path):
    p = write(tmp_path / "deep", bytes([0, 0, 0x08, 40]) + struct.pack(">" + "I" * 40, *([1] * 40)) + b"\x07")
    with pytest.raises(ValueError, match=r"deep: IDX header gives 40 dimensions \(at most 32"):
        datasets.load_idx(p)


# ---------------------------------------------------------------- mnist / fashion_mnist

def fake_set(d, n_train=5, n_test=3, gz=False, seed=0, labels=None, n_labels=None):
    """Writes the four IDX files into d and returns the arrays written."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i, n in enumerate((n_train, n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, n_labels if n_labels is not None else n, dtype=np.uint8)
        if labels is not None:
            y[:] = labels
        write(d / (NAMES[2 * i] + (".gz" if gz else "")), idx_bytes(x, 0x08), gz)
        write(d / (NAMES[2 * i + 1] + (".gz" if gz else "")), idx_bytes(y, 0x08), gz)
        xs.append(x)
        ys.append(y)
    return (xs[0], ys[0]), (xs[1], ys[1])


def check_loaded(got, want):
    for (gx, gy), (wx, wy) in zip(got, want):
        assert gx.dtype == np.uint8 and gy.dtype == np.uint8
        assert gx.shape == (wx.shape[0], 784) and gy.shape == (wx.shape[0],)
        np.testing.assert_array_equal(gx, wx.reshape(-1, 784))
        np.testing.assert_array_equal(gy, wy)


@pytest.mark.parametrize("sub", ["", "mnist", "MNIST/raw"])
@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_mnist_layouts(tmp_path, sub, gz):
    want = fake_set(tmp_path / sub if sub else tmp_path, gz=gz)
    check_loaded(datasets.mnist(root=tmp_path), want)
    check_loaded(datasets.mnist(root=str(tmp_path)), want)
    check_loaded(datasets.mnist(root=os.fsencode(tmp_path)), want)


def test_mnist_mixed_raw_and_gz(tmp_path):
    want = fake_set(tmp_path)
    for name in NAMES[1::2]:
        p = tmp_path / name
        write(tmp_path / (name + ".gz"), p.read_bytes(), gz=True)
        p.unlink()
    check_loaded(datasets.mnist(root=tmp_path), want)


def test_raw_file_preferred_over_gz(tmp_path):
    fake_set(tmp_path, seed=1, gz=True)
    want = fake_set(tmp_path, seed=0)
    check_loaded(datasets.mnist(root=tmp_path), want)


def test_mnist_default_root_is_cwd_data(tmp_path, monkeypatch):
    want = fake_set(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    check_loaded(datasets.mnist(), want)


def test_mnist_search_order_and_partial_dirs(tmp_path):
    fake_set(tmp_path / "MNIST" / "raw", seed=2)
    want_mnist = fake_set(tmp_path / "mnist", seed=1)
    check_loaded(datasets.mnist(root=tmp_path), want_mnist)
    want_root = fake_set(tmp_path, seed=0)
    check_loaded(datasets.mnist(root=tmp_path), want_root)
    # A directory missing one file is skipped in favour of the next complete one.
    (tmp_path / NAMES[3]).unlink()
    check_loaded(datasets.mnist(root=tmp_path), want_mnist)


def test_reads_files_again_on_each_call(tmp_path):
    for seed in (0, 5):
        want = fake_set(tmp_path, seed=seed)
        check_loaded(datasets.mnist(root=tmp_path), want)


@pytest.mark.parametrize("sub", ["", "fashion-mnist", "FashionMNIST/raw"])
def test_fashion_mnist_explicit_root(tmp_path, sub):
    want = fake_set(tmp_path / sub if sub else tmp_path, gz=True)
    check_loaded(datasets.fashion_mnist(root=tmp_path), want)


@pytest.fixture
def fashion_env(tmp_path, monkeypatch):
    """Isolates fashion_mnist(root=None) from this machine: cwd, HOME, CMLP_DATA_DIR
    and the system directory all point into tmp_path."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("CMLP_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets, "_FASHION_SYSTEM_DIR", str(tmp_path / "system"))
    return tmp_path


def test_fashion_mnist_default_search_order(fashion_env, monkeypatch):
    t = fashion_env
    candidates = [t / "env" / "fashion-mnist", t / "work" / "data" / "fashion-mnist",
                  t / "work" / "data" / "FashionMNIST" / "raw",
                  t / "home" / ".cache" / "cmlp" / "fashion-mnist", t / "system"]
    wants = [fake_set(d, seed=i, gz=i % 2 == 0) for i, d in enumerate(candidates)]
    monkeypatch.setenv("CMLP_DATA_DIR", str(t / "env"))
    # Remove the highest-priority directory each round: the next one must win.
    for d, want in zip(candidates, wants):
        check_loaded(datasets.fashion_mnist(), want)
        for f in d.iterdir():
            f.unlink()


def test_fashion_mnist_env_unset_skips_env_dir(fashion_env):
    fake_set(fashion_env / "fashion-mnist", seed=9)  # would match "$CMLP_DATA_DIR" = ""
    want = fake_set(fashion_env / "system", seed=3)
    check_loaded(datasets.fashion_mnist(), want)


def test_fashion_mnist_missing_lists_every_dir(fashion_env, monkeypatch):
    t = fashion_env
    monkeypatch.setenv("CMLP_DATA_DIR", str(t / "env"))
    write(t / "work" / "data" / "fashion-mnist" / NAMES[0], b"")  # a partial directory
    with pytest.raises(FileNotFoundError) as e:
        datasets.fashion_mnist()
    msg = str(e.value)
    for d in [t / "env" / "fashion-mnist", t / "work" / "data" / "fashion-mnist",
              t / "work" / "data" / "FashionMNIST" / "raw",
              t / "home" / ".cache" / "cmlp" / "fashion-mnist", t / "system"]:
        assert str(d) in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert NAMES[1] in msg  # says what the partial directory lacks


def test_mnist_missing_lists_every_dir(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        datasets.mnist(root=tmp_path / "nowhere")
    msg = str(e.value)
    for d in ["nowhere", os.path.join("nowhere", "mnist"), os.path.join("nowhere", "MNIST", "raw")]:
        assert str(tmp_path / d) in msg
    for name in NAMES:
        assert name in msg
    assert "Place the four MNIST IDX files" in msg


@pytest.mark.parametrize("loader", ["mnist", "fashion_mnist"])
def test_download_reads_the_files_that_are_there_and_fetches_none(tmp_path, loader):
    # torchvision's download=True with the files in place reads them: ported code runs as it is
    fake_set(tmp_path / "here")
    (x, y), _ = getattr(datasets, loader)(root=tmp_path / "here", download=True)
    assert x.shape == (5, 784) and y.shape == (5,)
    with pytest.raises(FileNotFoundError, match="not supported") as e:  # missing, as API.md says
        getattr(datasets, loader)(root=tmp_path / "empty", download=True)
    assert str(tmp_path / "empty") in str(e.value)
    assert isinstance(e.value, RuntimeError)  # and as torchvision's download that fails
    with pytest.raises(TypeError, match="download must be a bool"):
        getattr(datasets, loader)(root=tmp_path / "here", download="yes")


def test_a_bytes_root_is_named_as_text(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        datasets.mnist(root=os.fsencode(tmp_path / "nowhere"))
    assert f"in {tmp_path / 'nowhere'}." in str(e.value) and "b'" not in str(e.value)


@pytest.mark.parametrize("kw, pattern", [
    (dict(n_labels=4), "5 images but .* 4 labels"),
    (dict(labels=10), "0..9, found 10"),
    (dict(labels=255), "0..9, found 255"),
])
def test_invalid_sets(tmp_path, kw, pattern):
    fake_set(tmp_path, **kw)
    with pytest.raises(ValueError, match=pattern):
        datasets.mnist(root=tmp_path)
    with pytest.raises(ValueError, match=pattern):
        datasets.fashion_mnist(root=tmp_path)


def test_invalid_test_split_counts(tmp_path):
    fake_set(tmp_path)
    write(tmp_path / NAMES[3], idx_bytes(np.zeros(4, np.uint8), 0x08))
    with pytest.raises(ValueError, match="3 images but .* 4 labels"):
        datasets.mnist(root=tmp_path)


@pytest.mark.parametrize("name, arr, pattern", [
    (NAMES[0], np.zeros((5, 28, 27), np.uint8), r"\[N, 28, 28\]"),
    (NAMES[0], np.zeros((5, 784), np.uint8), r"\[N, 28, 28\]"),
    (NAMES[0], np.zeros((5, 28, 28), np.int16), "uint8 images"),
    (NAMES[1], np.zeros((5, 1), np.uint8), "uint8 labels"),
    (NAMES[1], np.zeros(5, np.int32), "uint8 labels"),
])
def test_wrong_shapes_or_types(tmp_path, name, arr, pattern):
    fake_set(tmp_path)
    code = {np.uint8: 0x08, np.int16: 0x0B, np.int32: 0x0C}[arr.dtype.type]
    write(tmp_path / name, idx_bytes(arr, code))
    with pytest.raises(ValueError, match=pattern):
        datasets.mnist(root=tmp_path)


def test_a_set_whose_images_claim_another_count_is_refused_before_they_are_read(tmp_path):
    """A gzip file of about 1 MB can claim 1.4 million images (1 GB): the header is checked
    against the labels' count first, so that nothing of that size is read."""
    import gzip
    import resource
    fake_set(tmp_path)
    n = 1 << 20
    with gzip.open(tmp_path / (NAMES[0] + ".gz"), "wb", 9) as g:
        g.write(bytes([0, 0, 8, 3]) + np.array([n, 28, 28], ">u4").tobytes())
        zeros = bytes(784 * 1024)
        for _ in range(n // 1024):
            g.write(zeros)
    (tmp_path / NAMES[0]).unlink()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=f"has {n} images but .* has 5 labels"):
        datasets.mnist(root=tmp_path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: far from 800 MiB


def test_fashion_mnist_with_a_root_that_lacks_it_points_to_the_installed_copy(fashion_env):
    t = fashion_env
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        datasets.fashion_mnist(root=t / "empty")
    fake_set(t / "system")
    with pytest.raises(FileNotFoundError) as e:
        datasets.fashion_mnist(root=t / "empty")
    msg = str(e.value)
    assert f"It is installed in {t / 'system'}" in msg and "root=None" in msg and "apt-get" not in msg
    assert datasets.fashion_mnist()[0][0].shape == (5, 784)  # where root=None finds it


def test_corrupt_file_in_set_raises_value_error(tmp_path):
    fake_set(tmp_path)
    data = (tmp_path / NAMES[2]).read_bytes()
    write(tmp_path / NAMES[2], data[:-1])
    with pytest.raises(ValueError, match="truncated"):
        datasets.mnist(root=tmp_path)


@pytest.mark.skipif(not os.path.isdir(SYSTEM_FASHION),
                    reason=f"{SYSTEM_FASHION} absent (apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist(monkeypatch, tmp_path):
    # Isolate from ./data and ~/.cache so the system copy is the one read.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("CMLP_DATA_DIR", raising=False)
    (x_tr, y_tr), (x_te, y_te) = datasets.fashion_mnist()
    assert x_tr.shape == (60000, 784) and x_tr.dtype == np.uint8
    assert y_tr.shape == (60000,) and y_tr.dtype == np.uint8
    assert x_te.shape == (10000, 784) and x_te.dtype == np.uint8
    assert y_te.shape == (10000,) and y_te.dtype == np.uint8
    for y, per_class in ((y_tr, 6000), (y_te, 1000)):
        np.testing.assert_array_equal(np.bincount(y, minlength=10), [per_class] * 10)
    assert x_tr.max() == 255 and x_tr.min() == 0


def test_a_gzip_file_with_bytes_after_its_stream_says_so(tmp_path):
    # the data is whole (gunzip reads it, warning of the rest): not "corrupt or truncated"
    arr = np.arange(60, dtype=np.uint8).reshape(3, 4, 5)
    p = write(tmp_path / "t.gz", gzip.compress(idx_bytes(arr, 0x08)) + b"garbage")
    with pytest.raises(ValueError, match=r"bytes that are not gzip data follow its gzip stream") as e:
        datasets.load_idx(p)
    assert str(p) in str(e.value) and "truncated" not in str(e.value)
