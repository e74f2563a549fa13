"""Model tensors and files: state_dict names, shapes and dtypes as PyTorch's SimpleMLP has them;
nn.Linear's initialisation; seeds; load_state_dict (checks, float64, a real PyTorch
state_dict); save/load round trips; atomic save; bitwise-deterministic training.
"""

import math
import os

import numpy as np
import pytest

import cmlp

SIZES = [784, 512, 256, 10]
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
SHAPES = {"fc1.weight": (512, 784), "fc1.bias": (512,), "fc2.weight": (256, 512), "fc2.bias": (256,),
          "fc3.weight": (10, 256), "fc3.bias": (10,)}
FAN_IN = {"fc1": 784, "fc2": 512, "fc3": 256}


def assert_params_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def batch(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 784)).astype(np.float32), rng.integers(0, 10, n)


@pytest.fixture(scope="module")
def model():
    return cmlp.MLP(SIZES, seed=0)


def test_state_dict_names_shapes_dtypes(model):
    sd = model.state_dict()
    assert list(sd) == NAMES
    for k, v in sd.items():
        assert isinstance(v, np.ndarray)
        assert v.shape == SHAPES[k], k
        assert v.dtype == np.float32, k
    assert model.layer_sizes == (784, 512, 256, 10)
    assert model.device == "cpu"
    assert list(model.grads()) == NAMES
    assert all(g.shape == SHAPES[k] and g.dtype == np.float32 for k, g in model.grads().items())


def test_num_parameters(model):
    assert model.num_parameters() == 535818
    assert sum(v.size for v in model.state_dict().values()) == 535818
    assert cmlp.MLP([3, 2]).num_parameters() == 8


@pytest.mark.parametrize("name", NAMES)
def test_init_matches_nn_linear(model, name):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights AND biases (bounds 0.0357, 0.0442, 0.0625)."""
    v = model.state_dict()[name].astype(np.float64).ravel()
    bound = 1.0 / math.sqrt(FAN_IN[name.split(".")[0]])
    n = v.size
    assert np.abs(v).max() <= bound * (1 + 1e-7)  # float32 rounding of a draw just below the bound
    # the largest of n uniform draws misses the bound by about bound / n
    assert np.abs(v).max() >= bound * (1.0 - 8.0 / n)
    std = bound / math.sqrt(3.0)
    assert abs(v.mean()) <= 5.0 * std / math.sqrt(n)
    if n >= 1000:
        assert v.std() == pytest.approx(std, rel=0.03)
        counts, _ = np.histogram(v, bins=10, range=(-bound, bound))
        np.testing.assert_allclose(counts, n / 10, rtol=0.1)
    assert len(np.unique(v)) >= 0.99 * n


def test_same_seed_same_weights_different_seed_different(model):
    assert_params_equal(cmlp.MLP(SIZES, seed=0).state_dict(), model.state_dict())
    other = cmlp.MLP(SIZES, seed=1).state_dict()
    for k, v in model.state_dict().items():
        assert np.mean(other[k] == v) < 0.01, k
    assert not np.array_equal(cmlp.MLP(SIZES, seed=2).state_dict()["fc1.weight"], other["fc1.weight"])


def test_load_state_dict_round_trip(model):
    x, _ = batch()
    other = cmlp.MLP(SIZES, seed=7)
    assert not np.array_equal(other(x), model(x))
    other.load_state_dict(model.state_dict())
    assert_params_equal(other.state_dict(), model.state_dict())
    np.testing.assert_array_equal(other(x), model(x))


def test_load_state_dict_copies_its_input():
    m = cmlp.MLP([4, 3, 2], seed=0)
    sd = m.state_dict()
    src = {k: v.copy() for k, v in sd.items()}
    m.load_state_dict(src)
    src["fc1.weight"][...] = 5.0
    assert_params_equal(m.state_dict(), sd)


@pytest.mark.parametrize("change,match", [
    pytest.param(lambda d: d.pop("fc2.bias"), r"missing keys \['fc2.bias'\]", id="missing"),
    pytest.param(lambda d: d.update({"fc4.weight": np.zeros((1, 1), np.float32)}), r"unexpected keys \['fc4.weight'\]",
                 id="unexpected"),
    pytest.param(lambda d: d.update({"module.fc1.weight": d.pop("fc1.weight")}), r"missing keys \['fc1.weight'\]",
                 id="prefixed"),
    pytest.param(lambda d: d.update({"fc1.weight": d["fc1.weight"].T.copy()}), r"fc1.weight.*\(784, 512\)",
                 id="transposed"),
    pytest.param(lambda d: d.update({"fc3.bias": np.zeros(11, np.float32)}), r"fc3.bias.*\(11,\)", id="bias-shape"),
    pytest.param(lambda d: d.update({"fc2.bias": np.zeros((256, 1), np.float32)}), r"fc2.bias.*\(256, 1\)",
                 id="bias-2d"),
    pytest.param(lambda d: d.update({"fc3.bias": np.full(10, np.nan, np.float32)}), r"NaN or inf", id="nan"),
])
def test_load_state_dict_rejects_and_keeps_parameters(change, match):
    m = cmlp.MLP(SIZES, seed=3)
    before = m.state_dict()
    bad = dict(cmlp.MLP(SIZES, seed=4).state_dict())
    change(bad)
    with pytest.raises(ValueError, match=match):
        m.load_state_dict(bad)
    assert_params_equal(m.state_dict(), before)


@pytest.mark.parametrize("prefix", ["{}.", "net.{}.", "module.fc{}."])
def test_load_state_dict_takes_any_modules_linear_layers_in_order(prefix):
    # an nn.Sequential(Flatten, Linear, ReLU, Linear, ReLU, Linear) names them 1, 3, 5
    src = cmlp.MLP(SIZES, seed=4).state_dict()
    renamed = {}
    for i, (name, arr) in enumerate(src.items()):
        layer = 2 * (i // 2) + 1
        renamed[prefix.format(layer) + name.split(".")[1]] = arr
    m = cmlp.MLP(SIZES, seed=3)
    result = m.load_state_dict(renamed)
    assert result.missing_keys == [] and result.unexpected_keys == [] and repr(result) == "<All keys matched successfully>"
    assert_params_equal(m.state_dict(), src)
    # keys sorted (each bias before its weight), or in reverse: the modules' numbers order them
    for keys in (sorted(renamed), list(reversed(renamed))):
        m = cmlp.MLP(SIZES, seed=3)
        m.load_state_dict({k: renamed[k] for k in keys})
        assert_params_equal(m.state_dict(), src)
    # names that do not order the layers, out of order: nothing is guessed
    unordered = {f"{name}.{kind}": src[f"fc{i}.{kind}"] for i, name in ((3, "a"), (2, "b"), (1, "c"))
                 for kind in ("weight", "bias")}
    with pytest.raises(ValueError, match="missing keys"):
        m.load_state_dict(unordered)
    # a layer without its bias, or a weight of another shape
    with pytest.raises(ValueError, match="missing keys"):
        m.load_state_dict({**{k: v for k, v in renamed.items() if not k.endswith("5.bias")}, "x.weight": src["fc3.bias"]})
    with pytest.raises(ValueError, match="missing keys"):
        m.load_state_dict({k: v.T if k.endswith("3.weight") else v for k, v in renamed.items()})


def test_a_mismatch_says_why_a_modules_layers_were_not_taken():
    """torch's Linear(bias=False), or another number of layers: the error says so beside the
    keys (it listed them alone, which left the reason to be guessed)."""
    src = cmlp.MLP(SIZES, seed=4).state_dict()
    layers = len(SIZES) - 1
    no_bias = {f"{2 * i}.weight": src[f"fc{i + 1}.weight"] for i in range(layers)}
    m = cmlp.MLP(SIZES, seed=3)
    before = m.state_dict()
    names = ", ".join(repr(str(2 * i)) for i in range(layers))
    with pytest.raises(ValueError, match=f"modules {names} have a weight and no bias"):
        m.load_state_dict(no_bias)
    one_bias = {**no_bias, **{f"{2 * i}.bias": src[f"fc{i + 1}.bias"] for i in range(1, layers)}}
    with pytest.raises(ValueError, match="module '0' has a weight and no bias"):
        m.load_state_dict(one_bias)
    fewer = {f"{2 * i}.{kind}": src[f"fc{i + 1}.{kind}"] for i in range(layers - 1) for kind in ("weight", "bias")}
    with pytest.raises(ValueError, match=f"holds {layers - 1} layers' weights; the model has {layers} layers"):
        m.load_state_dict(fewer)
    assert_params_equal(m.state_dict(), before)
    # this model's own names, one missing: the keys alone say it
    with pytest.raises(ValueError, match=r"missing keys \['fc1.bias'\], unexpected keys \[\]$"):
        m.load_state_dict({k: v for k, v in src.items() if k != "fc1.bias"})


def test_load_state_dict_orders_numbered_modules_by_number():
    # twelve layers named 0, 2, ..., 22 (an nn.Sequential's), keys sorted as text: "10" before "2"
    sizes = [20] + [9 + i for i in range(11)] + [3]
    src = cmlp.MLP(sizes, seed=4).state_dict()
    renamed = {f"{2 * (int(name.split('.')[0][2:]) - 1)}.{name.split('.')[1]}": arr for name, arr in src.items()}
    assert sorted(renamed)[:4] == ["0.bias", "0.weight", "10.bias", "10.weight"]
    m = cmlp.MLP(sizes, seed=3)
    m.load_state_dict(dict(sorted(renamed.items())))
    assert_params_equal(m.state_dict(), src)


def test_numbered_modules_of_one_width_sorted_as_text_load_by_number():
    # layers of one width fit their shapes in any order: only the numbers say which is which
    sizes = [8] * 7
    src = cmlp.MLP(sizes, seed=4).state_dict()
    renamed = {f"{2 * (int(name.split('.')[0][2:]) - 1)}.{name.split('.')[1]}": arr for name, arr in src.items()}
    m = cmlp.MLP(sizes, seed=3)
    m.load_state_dict(dict(sorted(renamed.items())))  # "0", "10", "2", ...
    assert_params_equal(m.state_dict(), src)


@pytest.mark.parametrize("names", [["layers.0", "layers.2", "head"], ["input", "hidden", "output"]])
def test_modules_named_otherwise_than_by_number_load_as_they_come(names):
    # layers of one width fit in any order: names that are not numbers keep the order given
    sd = {}
    for i, name in enumerate(names):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = np.full((8, 8), i, np.float32), np.full(8, i, np.float32)
    m = cmlp.MLP([8, 8, 8, 8])
    m.load_state_dict(sd)
    assert [float(v[0, 0]) for k, v in m.state_dict().items() if k.endswith("weight")] == [0.0, 1.0, 2.0]


def test_modules_some_of_them_named_as_this_models_load_in_order():
    """torch's common fc1, fc2 and out: the layers in order, fc1 and fc2 where their names say."""
    src = cmlp.MLP([6, 5, 4, 3], seed=4).state_dict()
    theirs = {("out" if k.startswith("fc3") else k.split(".")[0]) + "." + k.split(".")[1]: v for k, v in src.items()}
    m = cmlp.MLP([6, 5, 4, 3], seed=3)
    assert tuple(m.load_state_dict(theirs)) == ([], [])
    assert_params_equal(m.state_dict(), src)


def test_load_state_dict_reads_its_own_names_as_themselves():
    # fc2 and fc3 of this model under their names, beside two other keys: never shifted by position
    m = cmlp.MLP([8, 8, 8, 8], seed=3)
    before = m.state_dict()
    src = cmlp.MLP([8, 8, 8, 8], seed=4).state_dict()
    mixed = {"fc2.weight": src["fc2.weight"], "fc2.bias": src["fc2.bias"], "fc3.weight": src["fc3.weight"],
             "fc3.bias": src["fc3.bias"], "head.weight": src["fc1.weight"], "head.bias": src["fc1.bias"]}
    with pytest.raises(ValueError, match=r"missing keys \['fc1.weight', 'fc1.bias'\]"):
        m.load_state_dict(mixed)
    # however the other name sorts beside this model's ("encoder" before "fc2")
    encoder = {("encoder." + k.split(".")[1] if k.startswith("head") else k): v for k, v in mixed.items()}
    with pytest.raises(ValueError, match=r"missing keys \['fc1.weight', 'fc1.bias'\]"):
        m.load_state_dict(encoder)
    missing, unexpected = m.load_state_dict(mixed, strict=False)
    assert missing == ["fc1.weight", "fc1.bias"] and unexpected == ["head.weight", "head.bias"]
    after = m.state_dict()
    np.testing.assert_array_equal(after["fc1.weight"], before["fc1.weight"])
    np.testing.assert_array_equal(after["fc2.weight"], src["fc2.weight"])


def test_load_state_dict_not_strict_loads_what_matches_and_reports_the_rest():
    m = cmlp.MLP(SIZES, seed=3)
    before = m.state_dict()
    src = dict(cmlp.MLP(SIZES, seed=4).state_dict())
    del src["fc3.bias"]
    src["head.scale"] = np.ones(3, np.float32)
    missing, unexpected = m.load_state_dict(src, strict=False)
    assert missing == ["fc3.bias"] and unexpected == ["head.scale"]
    after = m.state_dict()
    np.testing.assert_array_equal(after["fc3.bias"], before["fc3.bias"])
    for k in src:
        if k in after:
            np.testing.assert_array_equal(after[k], src[k])
    with pytest.raises(ValueError, match="fc2.bias"):  # a wrong shape raises all the same, changing nothing
        m.load_state_dict({"fc1.bias": np.zeros(512, np.float32), "fc2.bias": np.zeros(3, np.float32)}, strict=False)
    assert_params_equal(m.state_dict(), after)
    # what torch's raises (RuntimeError) catches them too, for code written for it
    with pytest.raises(RuntimeError, match="fc2.bias"):
        m.load_state_dict({"fc2.bias": np.zeros(3, np.float32)}, strict=False)
    with pytest.raises(RuntimeError, match="missing keys"):
        m.load_state_dict({"fc2.bias": src["fc2.bias"]})
    assert_params_equal(m.state_dict(), after)
    with pytest.raises(TypeError, match="strict"):
        m.load_state_dict(src, strict="no")


def test_load_state_dict_accepts_float64(model):
    sd64 = {k: v.astype(np.float64) + 1e-3 for k, v in model.state_dict().items()}
    m = cmlp.MLP(SIZES, seed=9)
    m.load_state_dict(sd64)
    for k, v in m.state_dict().items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, sd64[k].astype(np.float32), err_msg=k)


def test_torch_style_model_calls_and_image_batches():
    m = cmlp.MLP([784, 32, 10], seed=0)
    assert m.training and m.eval() is m and not m.training and m.train() is m and m.training
    assert m.cpu() is m and m.device == "cpu"
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 1, 28, 28), dtype=np.uint8)  # what a torch DataLoader gives
    flat = images.reshape(5, 784)
    np.testing.assert_array_equal(m(images), m(flat))
    labels = rng.integers(0, 10, 5)
    assert m.evaluate(images, labels) == m.evaluate(flat, labels)
    with pytest.raises(ValueError, match="784 values a sample"):
        m(rng.random((5, 2, 28, 28)))
    for name, arr in m.named_parameters():  # copies: a write to one fails rather than doing nothing
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
    with pytest.raises(ValueError, match="read-only"):
        next(iter(m.parameters()))[0] = 1.0
    torch = pytest.importorskip("torch")
    assert cmlp.MLP([4, 2], device=torch.device("cpu")).to(torch.device("cpu")).device == "cpu"


def test_torch_state_dict_gives_torch_logits():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class SimpleMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(784, 512)
            self.fc2 = nn.Linear(512, 256)
            self.fc3 = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    torch.manual_seed(0)
    net = SimpleMLP().eval()
    sd = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    assert list(sd) == NAMES
    m = cmlp.MLP(SIZES, seed=0)
    m.load_state_dict(sd)
    x = np.random.default_rng(0).standard_normal((128, 784)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(m(x), want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(m.predict(x), want.argmax(1))
    # a float64 copy (net.double()) loads too and gives the same
    m64 = cmlp.MLP(SIZES, seed=1)
    m64.load_state_dict({k: v.detach().numpy() for k, v in net.double().state_dict().items()})
    np.testing.assert_allclose(m64(x), want, rtol=0, atol=1e-5)



def test_torch_tensors_load_and_compute_as_their_values_whatever_torch_converts():
    """Tensors as they come: a state_dict in bfloat16 (NumPy has no such type: float32 holds
    each value), parameters that require grad, and inputs that do; a complex one is refused by
    name."""
    torch = pytest.importorskip("torch")
    m = cmlp.MLP([4, 8, 3], seed=0)
    sd = m.state_dict()
    bf16 = {k: torch.from_numpy(v.copy()).bfloat16() for k, v in sd.items()}
    m.load_state_dict(bf16)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, bf16[k].float().numpy())
    m.load_state_dict({k: torch.from_numpy(v.copy()).requires_grad_() for k, v in sd.items()})
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
    x = torch.randn(5, 4, requires_grad=True)
    np.testing.assert_array_equal(m(x), m(x.detach().numpy()))
    np.testing.assert_array_equal(m.predict(x.bfloat16()), m.predict(x.detach().bfloat16().float().numpy()))
    with pytest.raises(TypeError, match=r"state_dict\['fc1.weight'\] must be numeric"):
        m.load_state_dict({k: torch.from_numpy(v.copy()).to(torch.complex64) for k, v in sd.items()})
    # a meta tensor has no values (torch raises NotImplementedError for them)
    with pytest.raises(TypeError, match=r"state_dict\['fc2.weight'\] must be an array of numbers.*meta"):
        m.load_state_dict({**sd, "fc2.weight": torch.empty(3, 8, device="meta")})
    with pytest.raises(TypeError, match="x must be an array of numbers"):
        m.predict(torch.empty(5, 4, device="meta"))
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])


# ---- files ----

@pytest.mark.parametrize("as_str", [False, True])
def test_save_load_round_trip(tmp_path, model, as_str):
    path = tmp_path / "m.npz"
    model.save(str(path) if as_str else path)
    loaded = cmlp.MLP.load(str(path) if as_str else path)
    assert loaded.layer_sizes == model.layer_sizes
    assert loaded.device == "cpu"
    assert_params_equal(loaded.state_dict(), model.state_dict())
    x, y = batch()
    np.testing.assert_array_equal(loaded(x), model(x))
    assert sorted(os.listdir(tmp_path)) == ["m.npz"]


def test_save_load_keeps_normalize_for_uint8_inputs(tmp_path):
    m = cmlp.MLP([20, 8, 4], seed=2, normalize=(0.1307, 0.3081))
    m.save(tmp_path / "n.npz")
    loaded = cmlp.MLP.load(tmp_path / "n.npz")
    assert loaded.normalize == (0.1307, 0.3081)
    u8 = np.random.default_rng(3).integers(0, 256, (5, 20), dtype=np.uint8)
    np.testing.assert_array_equal(loaded(u8), m(u8))
    # a file written without it (older) means the default
    with np.load(tmp_path / "n.npz") as z:
        arrays = {k: z[k] for k in z.files if k != "__normalize__"}
    np.savez(tmp_path / "old.npz", **arrays)
    assert cmlp.MLP.load(tmp_path / "old.npz").normalize == (0.5, 0.5)


def test_save_load_other_sizes_and_trained(tmp_path):
    m = cmlp.MLP([30, 7, 7, 7, 3], seed=11)
    opt = cmlp.optim.SGD(m, lr=0.5)
    x = np.random.default_rng(1).standard_normal((16, 30)).astype(np.float32)
    cmlp.Trainer(m, opt, batch_size=4).fit(x, np.arange(16) % 3, epochs=2, progress=False)
    path = tmp_path / "small.npz"
    m.save(path)
    loaded = cmlp.MLP.load(path, device="cpu")
    assert loaded.layer_sizes == (30, 7, 7, 7, 3)
    assert_params_equal(loaded.state_dict(), m.state_dict())


def test_save_overwrites(tmp_path):
    path = tmp_path / "m.npz"
    cmlp.MLP([8, 4], seed=1).save(path)
    second = cmlp.MLP([8, 4], seed=2)
    second.save(path)
    assert_params_equal(cmlp.MLP.load(path).state_dict(), second.state_dict())


def _boom_savez(file, *args, **kwargs):
    file.write(b"PK\x03\x04 half of a zip file")
    raise OSError("disk full (simulated)")


def _boom_replace(src, dst):
    raise OSError("rename failed (simulated)")


@pytest.mark.parametrize("target,fake", [("numpy.savez", _boom_savez), ("os.replace", _boom_replace)],
                         ids=["savez-fails", "replace-fails"])
def test_save_is_atomic(tmp_path, monkeypatch, target, fake):
    path = tmp_path / "m.npz"
    old = cmlp.MLP([8, 4], seed=1)
    old.save(path)
    old_bytes = path.read_bytes()
    monkeypatch.setattr(target, fake)
    with pytest.raises(OSError, match="simulated"):
        cmlp.MLP([8, 4], seed=2).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["m.npz"], "a temporary file was left behind"
    assert_params_equal(cmlp.MLP.load(path).state_dict(), old.state_dict())
    # a failed first save leaves nothing at all
    fresh = tmp_path / "new.npz"
    monkeypatch.setattr(target, fake)
    with pytest.raises(OSError):
        old.save(fresh)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["m.npz"]


def test_ctrl_c_anywhere_in_a_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """A KeyboardInterrupt right after the temporary file is created (before its descriptor is
    even returned), or at any later call of the save, leaves the old file and nothing else: no
    temporary file, and no descriptor open (Linux)."""
    import cmlp._files as files

    path = tmp_path / "m.npz"
    old = cmlp.MLP([8, 4], seed=1)
    old.save(path)
    old_bytes = path.read_bytes()
    real_open = os.open

    def open_then_interrupt(*args, **kwargs):
        real_open(*args, **kwargs)  # created (its descriptor lost with the interrupt)
        raise KeyboardInterrupt

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    for target, fake in ((files.os, ("open", open_then_interrupt)), (files.os, ("fchmod", interrupt)),
                         (files.os, ("fsync", interrupt)), (files.os, ("replace", interrupt))):
        with monkeypatch.context() as mp:
            mp.setattr(target, *fake)
            with pytest.raises(KeyboardInterrupt):
                cmlp.MLP([8, 4], seed=2).save(path)
        assert sorted(os.listdir(tmp_path)) == ["m.npz"], fake[0]
        assert path.read_bytes() == old_bytes
        assert not [f for f in _open_files() if ".cmlp-" in f], fake[0]


def _open_files():
    """The files this process holds open (Linux; elsewhere none)."""
    held = []
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own)
            pass
    return held


# ---- determinism of training ----

@pytest.fixture(scope="module")
def fashion_subset():
    try:
        (x, y), _ = cmlp.datasets.fashion_mnist()
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST is not installed")
    return x[:3000], y[:3000]


def train_one_epoch(data, model_seed=0, trainer_seed=0):
    model = cmlp.MLP(SIZES, seed=model_seed)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    hist = cmlp.Trainer(model, opt, batch_size=32, shuffle=True, seed=trainer_seed).fit(*data, epochs=1,
                                                                                       progress=False)
    return model.state_dict(), hist[0]["loss"]


def test_training_is_bitwise_deterministic(fashion_subset):
    a, loss_a = train_one_epoch(fashion_subset)
    b, loss_b = train_one_epoch(fashion_subset)
    assert_params_equal(a, b)
    assert loss_a == loss_b
    start = cmlp.MLP(SIZES, seed=0).state_dict()
    assert not np.array_equal(a["fc1.weight"], start["fc1.weight"])
    c, loss_c = train_one_epoch(fashion_subset, trainer_seed=1)
    for k in a:
        assert not np.array_equal(a[k], c[k]), f"{k}: another shuffle seed gave the same weights"
    assert loss_c != loss_a


def test_deepcopy_is_an_independent_model_with_the_same_parameters():
    import copy

    model = cmlp.MLP([6, 5, 3], seed=4, normalize=(0.1, 0.2))
    x = np.random.default_rng(0).random((3, 6), dtype=np.float32)
    twin = copy.deepcopy(model)
    assert twin is not model and twin.layer_sizes == model.layer_sizes and twin.normalize == model.normalize
    assert np.array_equal(twin.forward(x), model.forward(x))
    opt = cmlp.optim.SGD(twin, lr=0.5)  # training the copy leaves the original alone
    twin.forward_backward(x, np.array([0, 1, 2]))
    opt.step()
    assert not np.array_equal(twin.forward(x), model.forward(x))
    assert np.array_equal(model.forward(x), copy.deepcopy(model).forward(x))


class _Tagged(cmlp.MLP):
    def __init__(self, sizes, tag):
        super().__init__(sizes, seed=1)
        self.tag, self.history = tag, [1.0]


def test_deepcopy_keeps_the_class_and_the_attributes_and_copies_optimizers_as_torch():
    import copy

    model = _Tagged([6, 5, 3], "mine")
    twin = copy.deepcopy(model)
    assert type(twin) is _Tagged and twin.tag == "mine" and twin.history == [1.0]
    assert twin.history is not model.history
    x, y = np.random.default_rng(0).random((4, 6), dtype=np.float32), np.array([0, 1, 2, 0])
    for make in (lambda m: cmlp.optim.Adam(m, lr=1e-2, betas=(0.8, 0.9), fused=True),
                 lambda m: cmlp.optim.AdamW(m, weight_decay=0.3),
                 lambda m: cmlp.optim.SGD(m, lr=0.1, momentum=0.9, nesterov=True)):
        model = cmlp.MLP([6, 5, 3], seed=2)
        opt = make(model)
        model.forward_backward(x, y)
        opt.step()
        opt.param_groups[0]["note"] = ["kept"]
        m2, o2 = copy.deepcopy([model, opt])  # torch's idiom: the copy steps the copied model
        assert type(o2) is type(opt) and o2.model is m2 and o2 is not opt
        (s1, b1), (s2, b2) = opt._c.get_state(), o2._c.get_state()
        assert s1 == s2 and len(b1) == len(b2) and all(np.array_equal(u, v) for u, v in zip(b1, b2))
        assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
        assert o2.param_groups[0]["note"] == ["kept"]
        for m, o in ((model, opt), (m2, o2)):
            m.forward_backward(x, y)
            o.step()
        assert np.array_equal(m2._c.get_params(), model._c.get_params())
        alone = copy.deepcopy(opt)  # with a copy of its model
        assert alone.model is not model and np.array_equal(alone.model._c.get_params(), model._c.get_params())


def test_deepcopy_of_a_diverged_model_keeps_its_nans():
    import copy

    model = cmlp.MLP([2, 3, 2], seed=0, normalize=(0.0, 1.0))
    model.forward_backward(np.full((1, 2), 1e30, np.float32), np.array([0]), loss_scale=3e38)
    cmlp.optim.SGD(model, lr=1.0).step()
    p = model._c.get_params()
    assert not np.isfinite(p).all()
    assert np.array_equal(copy.deepcopy(model)._c.get_params(), p, equal_nan=True)


def diverged(kind):
    """A model and optimizer whose run went to NaN and inf: parameters and state."""
    model = cmlp.MLP([8, 4, 3], seed=0)
    opt = cmlp.optim.SGD(model, lr=1e38, momentum=0.9) if kind == "sgd" else \
        cmlp.optim.Adam(model, lr=1e38, amsgrad=kind == "amsgrad")
    x, y = np.random.default_rng(0).random((16, 8), dtype=np.float32), np.arange(16) % 3
    for _ in range(30):
        model.zero_grad()
        model.forward_backward(x, y)
        opt.step()
    assert not np.isfinite(model._c.get_params()).all()
    assert not all(np.isfinite(b).all() for b in opt._c.get_state()[1])
    return model, opt


@pytest.mark.parametrize("kind", ["adam", "amsgrad", "sgd"])
def test_copies_and_pickles_of_a_diverged_optimizer_are_it_as_it_was(kind):
    import copy
    import pickle

    model, opt = diverged(kind)
    step, bufs = opt._c.get_state()
    model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    for twin in (opt2, copy.deepcopy(opt)):
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(twin._c.get_state()[1], bufs))
    assert np.array_equal(model2._c.get_params(), model._c.get_params(), equal_nan=True)
    with pytest.raises(ValueError, match="holds inf or NaN"):  # a state_dict given to load: checked
        opt.load_state_dict(opt.state_dict())
    assert opt._c.get_state()[0] == step
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(opt._c.get_state()[1], bufs))


def test_a_saved_diverged_model_loads_as_it_was(tmp_path):
    model, _ = diverged("adam")
    model.save(tmp_path / "m.npz")
    back = cmlp.MLP.load(tmp_path / "m.npz")
    assert np.array_equal(back._c.get_params(), model._c.get_params(), equal_nan=True)
    with pytest.raises(ValueError, match="holds NaN or inf"):  # a state_dict given to load: checked
        cmlp.MLP([8, 4, 3]).load_state_dict(model.state_dict())


def test_a_file_claiming_layers_it_does_not_hold_is_refused_before_the_model_is_made(tmp_path):
    np.savez(tmp_path / "big.npz", __layer_sizes__=np.array([2**24, 16]))  # 1 GiB of weights claimed in 300 bytes
    np.savez(tmp_path / "other.npz", __layer_sizes__=np.array([2**24, 16]),
             **{"0.weight": np.zeros((16, 3), np.float32), "0.bias": np.zeros(16, np.float32)})
    cmlp.memory.reset_peak_memory_stats("cpu")
    for name in ("big.npz", "other.npz"):
        # (a ValueError, and a RuntimeError as torch's mismatch is)
        with pytest.raises(ValueError, match=f"{name}: its arrays .* are not the weights and biases") as e:
            cmlp.MLP.load(tmp_path / name)
        assert isinstance(e.value, RuntimeError)
    assert cmlp.memory.max_memory_allocated("cpu") < 2**24  # no model of 2**24 inputs was made
    np.savez(tmp_path / "seq.npz", __layer_sizes__=np.array([3, 16]),  # a module's names that fit: loaded
             **{"0.weight": np.ones((16, 3), np.float32), "0.bias": np.zeros(16, np.float32)})
    assert cmlp.MLP.load(tmp_path / "seq.npz").state_dict()["fc1.weight"].sum() == 48


def test_pickle_makes_models_optimizers_and_schedules_again_as_torch_save_does():
    """pickle (torch.save of whole objects, or sending them to another process): a model comes
    back of its class, with its attributes, parameters (NaNs too) and gradients; pickled with its
    optimizer and schedule, they come back bound to each other and train on bit for bit; an
    optimizer alone brings a copy of its model. A Trainer refuses, saying what to pickle instead;
    copy.copy stays a shallow copy."""
    import copy
    import pickle

    from cmlp.optim import lr_scheduler as S

    model = _Tagged([6, 5, 3], "mine")
    x, y = np.random.default_rng(0).random((48, 6), dtype=np.float32), np.arange(48) % 3
    model.forward_backward(x[:4], y[:4])
    back = pickle.loads(pickle.dumps(model))
    assert type(back) is _Tagged and (back.tag, back.history) == ("mine", [1.0])
    assert np.array_equal(back._c.get_params(), model._c.get_params())
    assert np.array_equal(back._c.get_grads(), model._c.get_grads()) and not back._grads_none
    for make in (lambda m: cmlp.optim.Adam(m, lr=1e-2, betas=(0.8, 0.9), amsgrad=True),
                 lambda m: cmlp.optim.AdamW(m, param_groups=[{"params": ["fc1.weight"], "lr": 5e-3, "tag": 1},
                                                             {"params": ["fc1.bias", "fc2.weight", "fc2.bias"]}]),
                 lambda m: cmlp.optim.SGD(m, lr=0.1, momentum=0.9, nesterov=True)):
        model = cmlp.MLP([6, 5, 3], seed=2)
        opt = make(model)
        sched = S.CosineAnnealingLR(opt, T_max=5)
        cmlp.Trainer(model, opt, batch_size=8, shuffle=False).fit(x, y, epochs=1, progress=False, scheduler=sched)
        m2, o2, s2 = pickle.loads(pickle.dumps([model, opt, sched]))
        assert type(o2) is type(opt) and o2.model is m2 and s2.optimizer is o2
        assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"] and o2.defaults == opt.defaults
        for m, o, s in ((model, opt, sched), (m2, o2, s2)):
            cmlp.Trainer(m, o, batch_size=8, shuffle=False).fit(x, y, epochs=2, progress=False, scheduler=s)
        assert np.array_equal(m2._c.get_params(), model._c.get_params())
        alone = pickle.loads(pickle.dumps(opt))
        assert alone.model is not model and np.array_equal(alone.model._c.get_params(), model._c.get_params())
    diverged = cmlp.MLP([2, 3, 2], seed=0)
    diverged._c.set_params(np.full(diverged.num_parameters(), np.nan, np.float32), False)
    assert np.isnan(pickle.loads(pickle.dumps(diverged))._c.get_params()).all()
    trainer = cmlp.Trainer(model, opt)
    for refused in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="Trainer cannot be pickled.*trainer.state_dict"):
            refused(trainer)
    assert copy.copy(trainer)._c is trainer._c and copy.copy(model)._c is model._c and copy.copy(opt)._c is opt._c


@pytest.mark.parametrize("how", ["deflate", "method", "encrypted", "bools"])
def test_a_damaged_compressed_file_is_a_value_error(tmp_path, how):
    """Corrupt deflate data, a compression method or encryption the zip reader lacks, or arrays
    of bools: "not a readable cmlp model file" (ValueError), as every other damaged file."""
    import io
    import zipfile

    model = cmlp.MLP([20, 16, 5], seed=0)
    arrays = dict(model.state_dict())
    arrays["__layer_sizes__"] = np.array([20, 16, 5])
    if how == "bools":
        arrays["fc1.bias"] = arrays["fc1.bias"] > 0
    good_path = tmp_path / "good.npz"
    np.savez_compressed(good_path, **arrays)
    good = good_path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        info = z.infolist()[0]
    local, central = info.header_offset, good.find(b"PK\x01\x02")
    data = local + 30 + len(info.filename.encode()) + len(info.extra)
    bad = bytearray(good)
    if how == "deflate":  # flip bytes of the compressed data until zlib (not the CRC) refuses it
        for off in range(info.compress_size):
            trial = bytearray(good)
            trial[data + off] ^= 0xFF
            try:
                zipfile.ZipFile(io.BytesIO(bytes(trial))).read(info.filename)
            except zipfile.BadZipFile:
                continue
            except zipfile.zlib.error:
                bad = trial
                break
        assert bad != bytearray(good)
    elif how == "method":
        bad[local + 8] = bad[central + 10] = 99
    elif how == "encrypted":
        bad[local + 6] |= 1
        bad[central + 8] |= 1
    path = tmp_path / "bad.npz"
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="not a readable cmlp model file"):
        cmlp.MLP.load(path)


@pytest.mark.parametrize("content", [b"junk", b"", b"\x93NUMPY", b"\x80\x04K\x01."])
def test_a_file_that_is_no_zip_is_named_as_such(tmp_path, content):
    """Text, an empty file, an .npy array or a pickle: not read by NumPy (which would call a
    non-archive a refused pickle), but refused as no zip archive."""
    path = tmp_path / "model.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"model.npz is not a readable cmlp model file \(.npz\): it is not a zip "
                                         "archive"):
        cmlp.MLP.load(path)


def test_state_dict_takes_torchs_keywords():
    model = cmlp.MLP([4, 3, 2], seed=0)
    plain = model.state_dict()
    named = model.state_dict(prefix="net.")
    assert list(named) == ["net." + k for k in plain] and all(np.array_equal(named["net." + k], v)
                                                               for k, v in plain.items())
    into = {"step": 3}
    assert model.state_dict(destination=into, prefix="m.", keep_vars=True) is into
    assert list(into) == ["step"] + ["m." + k for k in plain]
    with pytest.raises(TypeError, match="prefix must be a str"):
        model.state_dict(prefix=1)
    with pytest.raises(TypeError, match="keep_vars must be a bool"):
        model.state_dict(keep_vars="yes")
    other = cmlp.MLP([4, 3, 2], seed=1)
    result = other.load_state_dict(plain, assign=True)  # copied in, as without assign
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_params_equal(other.state_dict(), plain)
    with pytest.raises(TypeError, match="assign must be a bool"):
        other.load_state_dict(plain, assign="yes")


def test_to_and_cuda_take_torchs_arguments():
    torch = pytest.importorskip("torch")
    model = cmlp.MLP([4, 3, 2], seed=0)
    before = model.state_dict()
    for call in (lambda: model.to("cpu", non_blocking=True), lambda: model.to(torch.float32),
                 lambda: model.to("cpu", np.float32), lambda: model.to(dtype=torch.float32), lambda: model.to()):
        assert call() is model and model.device == "cpu"
    with pytest.raises(TypeError, match="dtype float32 only"):
        model.to("cpu", torch.float64)
    with pytest.raises(TypeError, match="dtype float32 only"):
        model.to(np.float16)
    with pytest.raises(TypeError, match="non_blocking must be a bool"):
        model.to("cpu", non_blocking="yes")
    with pytest.raises(RuntimeError, match="Invalid device, must be cuda device"):  # torch's words
        model.cuda("cpu")
    with pytest.raises(TypeError, match="device must be a str"):
        model.cuda(1.5)
    with pytest.raises(ValueError, match="Invalid device argument -1"):  # (as torch's allocator says)
        model.cuda(-1)
    assert model.device == "cpu"
    assert_params_equal(model.state_dict(), before)


def test_save_and_load_take_binary_file_objects_as_torch_save_does(tmp_path):
    import io

    model = cmlp.MLP([4, 3, 2], seed=0, normalize=(0.25, 0.75))
    buf = io.BytesIO()
    model.save(buf)
    buf.seek(0)
    back = cmlp.MLP.load(buf)
    assert_params_equal(back.state_dict(), model.state_dict())
    assert back.normalize == (0.25, 0.75)
    with open(tmp_path / "m.npz", "wb") as f:
        model.save(f)
    with open(tmp_path / "m.npz", "rb") as f:
        assert_params_equal(cmlp.MLP.load(f).state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="BytesIO.* is not a readable cmlp model file .*not a zip archive"):
        cmlp.MLP.load(io.BytesIO(b"not a model"))
    with pytest.raises(TypeError, match="binary file object"):
        cmlp.MLP.load(io.StringIO("text"))
