"""cmlp.MLP: the model users hold. Parameters live in the C core's flat buffer; this class
validates and converts inputs, names tensors as PyTorch does, and saves atomically."""
import copy
import io
import itertools
import os
import re
import stat
import weakref
import zipfile
import zlib
from collections import OrderedDict
from typing import IO, Any, Dict, Iterable, Iterator, List, MutableMapping, Optional, Sequence, Sized, Tuple, Type, cast

import numpy as np

from . import _cmlp
from ._args import Device
from ._files import atomic_write
from ._cmlp import CoreLock
from ._arrays import _as_array, as_flag, as_inputs, as_labels, as_normalize, as_number, check_amp, check_seed

_SIZES_KEY = "__layer_sizes__"
_NORMALIZE_KEY = "__normalize__"  # (mean, std) for uint8 inputs; files without it mean (0.5, 0.5)


_MAX_WIDTH = 1 << 24  # the C core's widest layer


def _as_sizes(layer_sizes: Any) -> Tuple[int, ...]:
    if isinstance(layer_sizes, (str, bytes)) or not isinstance(layer_sizes, Iterable):
        raise TypeError(f"layer_sizes must be a sequence of ints such as [784, 512, 256, 10], got {layer_sizes!r}")
    sizes = tuple(itertools.islice(layer_sizes, _cmlp.MAX_LAYERS + 2))  # (an endless iterator: refused too)
    if len(sizes) > _cmlp.MAX_LAYERS + 1:
        got = len(cast(Sized, layer_sizes)) if hasattr(layer_sizes, "__len__") else "more"
        raise ValueError(f"at most {_cmlp.MAX_LAYERS + 1} layer sizes are supported, got {got}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"layer_sizes must hold ints, got {s!r} in {list(sizes)!r}")
    if len(sizes) < 2:
        raise ValueError(f"layer_sizes needs at least an input and an output size, got {list(sizes)!r}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"every layer size must be >= 1, got {list(sizes)!r}")
    for i, s in enumerate(sizes):
        if s > _MAX_WIDTH:
            raise ValueError(f"layer_sizes[{i}] = {s}: every size must be in [1, {_MAX_WIDTH}]")
    return tuple(int(s) for s in sizes)


class Parameters:
    """What MLP.parameters() returns: the model's parameters as one handle, so that code written
    for torch ports as it is (cmlp.optim.Adam(model.parameters(), lr=1e-3),
    cmlp.nn.utils.clip_grad_norm_(model.parameters(), 1.0)). Iterating gives copies of the
    tensors in state_dict order, read-only: a write to one would not reach the model (torch's
    share its storage), so it fails instead of doing nothing; load_state_dict writes."""

    __slots__ = ("model",)

    def __init__(self, model: "MLP") -> None:
        self.model = model

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(v for _, v in _read_only(self.model, self.model.state_dict()))

    def __len__(self) -> int:
        return 2 * (len(self.model.layer_sizes) - 1)

    def __repr__(self) -> str:
        return f"<parameters of {self.model!r}>"


# The copies parameters() and named_parameters() gave out, while they live: id -> (the copy, its
# model, its name), so that an optimizer given them (torch's param groups) knows which they are.
_issued: Dict[int, Tuple["weakref.ref[np.ndarray]", "weakref.ref[MLP]", str]] = {}


def _read_only(model: "MLP", state: Dict[str, np.ndarray]) -> Iterator[Tuple[str, np.ndarray]]:
    for name, arr in state.items():
        arr.flags.writeable = False
        key = id(arr)
        # the callback's defaults bind this key (a lambda with defaults is not inferred as weakref's callback)
        gone = cast(Any, lambda _, key=key, issued=_issued: issued.pop(key, None))
        _issued[key] = (weakref.ref(arr, gone), weakref.ref(model), name)
        yield name, arr


def parameter_of(arr: Any) -> Optional[Tuple["MLP", str]]:
    """(model, name) of a copy that parameters() or named_parameters() gave out, else None."""
    entry = _issued.get(id(arr))
    if entry is None or entry[0]() is not arr:
        return None
    model = entry[1]()
    return None if model is None else (model, entry[2])


def model_of(obj: Any, what: str) -> "MLP":
    """The MLP behind obj: an MLP, or what its parameters() returned."""
    if isinstance(obj, MLP):
        return obj
    if isinstance(obj, Parameters):
        return obj.model
    raise TypeError(f"{what} must be a cmlp.MLP or its parameters() (the model's parameters live in one buffer), "
                    f"got {type(obj).__name__}")


class _Default(float):
    """forward_backward's loss_scale when the caller gives none (1.0, told apart from a 1.0 given)."""


_DEFAULT_SCALE = _Default(1.0)


class StateDictMismatch(ValueError, RuntimeError):
    """A state_dict that does not fit the model (keys off with strict, a wrong shape): a
    ValueError, and the RuntimeError torch's load_state_dict raises, for code written for it."""


class IncompatibleKeys(tuple):
    """What load_state_dict did not match (torch's result): missing_keys, unexpected_keys."""

    def __new__(cls, missing_keys: Sequence[str], unexpected_keys: Sequence[str]) -> "IncompatibleKeys":
        return super().__new__(cls, (list(missing_keys), list(unexpected_keys)))

    @property
    def missing_keys(self) -> list:
        return self[0]

    @property
    def unexpected_keys(self) -> list:
        return self[1]

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return f"IncompatibleKeys(missing_keys={self.missing_keys}, unexpected_keys={self.unexpected_keys})"



# The models of this process, copy.copy's twins too: in a forked child each takes a new
# _optimizers_lock (a thread the child does not have may have held it; a move it was making in C
# leaves the model lost there), one for the objects that shared one.
_live: "weakref.WeakSet[MLP]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    fresh: Dict[int, Any] = {}
    models = list(_live)  # (one list: a collection between two would set the pairs apart)
    old = [model.__dict__.get("_optimizers_lock") for model in models]  # (alive: their ids stay theirs)
    for model, lock in zip(models, old):
        if lock is not None:
            model._optimizers_lock = fresh.setdefault(id(lock), CoreLock())


os.register_at_fork(after_in_child=_after_fork_in_child)


class MLP:
    """Linear layers with ReLU between them, initialised like nn.Linear from `seed`."""

    def __init__(self, layer_sizes: Iterable[int], device: Device = "cpu", seed: int = 0,
                 normalize: Tuple[float, float] = (0.5, 0.5)) -> None:
        from ._args import _device_text

        sizes = _as_sizes(layer_sizes)
        seed = check_seed(seed)
        device = _device_text(device)  # torch's forms too: a torch.device, an index
        if not isinstance(device, str):
            raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {device!r}")
        self.normalize = as_normalize(normalize)
        self._c = _cmlp.Model(sizes, device, seed)
        self._sizes = self._c.sizes()
        self._offsets = self._c.offsets()
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # held while an optimizer is made and while the model moves: a move in another thread
        # takes every optimizer along, the one being made too
        self._optimizers_lock = CoreLock()
        _live.add(self)
        # no gradient yet (torch's .grad is None until a backward, and again after
        # zero_grad(set_to_none=True)): an optimizer's step() then changes nothing
        self._grads_none = True
        self._unscaled_grads = False  # forward_backward with loss_scale 1.0 since the last zero_grad
        self.training = True

    # ---- facts ----

    @property
    def normalize(self) -> Tuple[float, float]:
        """The (mean, std) that uint8 inputs are normalised with, after scaling to [0, 1]; set,
        it is checked as the constructor's normalize is."""
        return self._normalize

    @normalize.setter
    def normalize(self, value: Any) -> None:
        self._normalize = as_normalize(value)

    @property
    def layer_sizes(self) -> Tuple[int, ...]:
        return self._sizes

    @property
    def device(self) -> str:
        return self._c.device()

    def num_parameters(self) -> int:
        return self._c.num_parameters()

    def __repr__(self) -> str:
        return f"MLP({list(self._sizes)}, device={self.device!r})"

    # ---- compute ----
    def _in_chunks(self, run: Any, rows: int, n: int) -> Any:
        """run(rows): a pass over n rows, `rows` at a time, fewer where memory is short (see
        _shrinking). The buffers go back to the cache afterwards, as torch frees an inference's
        tensors: allocated memory is the model's again."""
        try:
            return self._shrinking(run, max(1, min(rows, n)))[0]
        finally:
            self._c.release_workspace()

    def _shrinking(self, run: Any, rows: int) -> Tuple[Any, int]:
        """(run(rows), the rows it ran with). Out of memory, the pass starts again once on an
        emptied cache (a GPU loads a kernel's code at its first launch, into memory the cache may
        hold), then with the chunk halved each time, down to one row (as fit's validation)."""
        emptied = False
        while True:
            try:
                return run(rows), rows
            except _cmlp.OutOfMemoryError:
                self._c.release_workspace()
                if not emptied:
                    emptied = True
                    _cmlp.empty_cache(self.device)
                    continue
                if rows == 1:
                    raise
                rows //= 2

    def forward(self, x: Any) -> np.ndarray:
        """Logits, float32 [N, classes], computed 1024 rows at a time (fewer where memory is short:
        see _in_chunks)."""
        xa = as_inputs(x, self._sizes[0])
        return self._in_chunks(lambda rows: self._c.forward(xa, *self.normalize, rows), 1024, xa.shape[0])

    __call__ = forward

    def predict(self, x: Any) -> np.ndarray:
        """Predicted classes, int64 [N]."""
        return np.argmax(self.forward(x), axis=1).astype(np.int64)

    def evaluate(self, x: Any, y: Any, batch_size: int = 1000) -> Dict[str, float]:
        """Mean cross-entropy and accuracy over (x, y), computed batch_size rows at a time (fewer
        where memory is short: see _in_chunks)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or not 1 <= batch_size < 2**63:
            raise ValueError(f"batch_size must be an int in [1, 2**63), got {batch_size!r}")
        xa = as_inputs(x, self._sizes[0])
        ya = as_labels(y, xa.shape[0], self._sizes[-1])
        n = xa.shape[0]
        loss_sum, correct = self._in_chunks(lambda rows: self._c.evaluate(xa, ya, *self.normalize, rows),
                                            int(batch_size), n)
        return {"loss": loss_sum / n, "accuracy": correct / n}

    def forward_backward(self, x: Any, y: Any, loss_scale: float = _DEFAULT_SCALE, amp: Optional[str] = None,
                         label_smoothing: float = 0.0) -> float:
        """Mean cross-entropy of the batch (unscaled). ADDS the gradient of loss_scale * loss to
        the gradient buffer, like loss.backward()."""
        amp_code = check_amp(amp)
        scale_given = loss_scale
        with np.errstate(over="ignore"):  # torch multiplies the loss by it in float32
            loss_scale = float(np.float32(as_number("loss_scale", loss_scale)))
        if not np.isfinite(loss_scale):
            raise ValueError(f"loss_scale must be finite in float32, got {scale_given!r}")
        label_smoothing = as_number("label_smoothing", label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        xa = as_inputs(x, self._sizes[0])
        ya = as_labels(y, xa.shape[0], self._sizes[-1])
        n = xa.shape[0]
        loss_sum = self._c.forward_backward(xa, ya, loss_scale / n, label_smoothing, *self.normalize, amp_code)
        self._grads_none = False
        # gradients of the loss itself, loss_scale left out: see GradScaler.unscale_
        self._unscaled_grads = getattr(self, "_unscaled_grads", False) or scale_given is _DEFAULT_SCALE
        return loss_sum / n

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeros the gradient buffer. With set_to_none (torch's default) the gradients count as
        absent until the next forward_backward, so that an optimizer's step() in between changes
        nothing, as torch's skips parameters whose .grad is None; without it, gradients that are
        there become zeros, and absent ones stay absent (torch leaves a None .grad None)."""
        set_to_none = as_flag("set_to_none", set_to_none)
        self._c.zero_grad()
        self._grads_none = self._grads_none or set_to_none
        self._unscaled_grads = False

    def parameters(self) -> Parameters:
        """The parameters as one handle (see Parameters), for torch-style calls."""
        return Parameters(self)

    def named_parameters(self) -> Iterator[Tuple[str, np.ndarray]]:
        """(name, read-only copy) pairs in state_dict order (see Parameters)."""
        return _read_only(self, self.state_dict())

    # ---- tensors by name ----
    def _split(self, flat: np.ndarray) -> "OrderedDict[str, np.ndarray]":
        out: "OrderedDict[str, np.ndarray]" = OrderedDict()
        for i, (w, b) in enumerate(self._offsets):
            fan_in, fan_out = self._sizes[i], self._sizes[i + 1]
            out[f"fc{i + 1}.weight"] = flat[w:w + fan_in * fan_out].reshape(fan_out, fan_in)
            out[f"fc{i + 1}.bias"] = flat[b:b + fan_out]
        return out

    def state_dict(self, *, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> "OrderedDict[str, np.ndarray]":
        """Copies of the parameters: "fc1.weight" [out, in], "fc1.bias" [out], ... Torch's
        keywords: each name after prefix, put in destination (and it returned) when given;
        keep_vars is taken (copies either way: the parameters live in the model's memory)."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        as_flag("keep_vars", keep_vars)
        if destination is not None and not isinstance(destination, MutableMapping):
            raise TypeError(f"destination must be a dict, got {type(destination).__name__}")
        own = self._split(self._c.get_params())
        named = OrderedDict((prefix + k, v) for k, v in own.items()) if prefix else own
        if destination is None:
            return named
        destination.update(named)
        return destination  # type: ignore[return-value]

    def grads(self) -> "OrderedDict[str, np.ndarray]":
        """Copies of the gradients, with state_dict's names and shapes."""
        return self._split(self._c.get_grads())

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True, assign: bool = False) -> "IncompatibleKeys":
        """Replaces the parameters from a mapping of names to arrays, as torch's: with the names of
        state_dict() ("fc1.weight", ..., a PyTorch SimpleMLP's converted with .numpy()), or those
        of any module whose Linear layers are this model's in order (an nn.Sequential's "0.weight",
        "2.weight", ...: no key one of this model's names, every key a weight or a bias, a weight
        and a bias for each layer, every shape right; see _linear_names). strict=False loads the
        names present and reports the rest. Returns the missing and unexpected keys (torch's
        result); a wrong shape, or any key off with strict, raises ValueError (a RuntimeError too,
        which torch's raises) and changes nothing. assign (torch's: the module takes the tensors
        themselves) is taken; the values are copied either way, into the model's own memory."""
        as_flag("assign", assign)
        return self._load_state(state, strict, finite=True)

    def _load_state(self, state: Dict[str, Any], strict: Any, finite: bool) -> "IncompatibleKeys":
        """load_state_dict; finite=False takes NaN and inf as they are (a file this library wrote
        of a model that diverged: load gives it back as it was)."""
        if not hasattr(state, "keys"):
            raise TypeError(f"state_dict must be a mapping of names to arrays, got {type(state).__name__}")
        strict = as_flag("strict", strict)
        flat = self._c.get_params()
        views = self._split(flat)
        # other names (any of them: fc1, fc2 and out) are read as a module's Linear layers, where
        # the dict holds exactly its layers' weights and biases
        renamed = self._linear_names(state, views) if not all(k in views for k in state.keys()) else None
        if renamed is not None:
            state = renamed
        missing = [k for k in views if k not in state]
        unexpected = [k for k in state.keys() if k not in views]
        if strict and (missing or unexpected):
            raise StateDictMismatch(f"state_dict does not match the model {list(self._sizes)}: missing keys {missing}, "
                                    f"unexpected keys {unexpected}{self._why_not_layers(state, views)}")
        for name, view in views.items():
            if name not in state:
                continue
            arr = _as_array(state[name], f"state_dict[{name!r}]", f"{list(view.shape)}")
            if arr.dtype.kind not in "fiu":
                raise TypeError(f"state_dict[{name!r}] must be numeric, got dtype {arr.dtype}")
            if arr.shape != view.shape:
                raise StateDictMismatch(f"state_dict[{name!r}] has shape {tuple(arr.shape)}; the model needs "
                                        f"{view.shape}")
            with np.errstate(over="ignore", invalid="ignore"):
                view[...] = arr
            lost = ~np.isfinite(view)
            if not finite:
                lost &= np.isfinite(arr)  # NaN and inf as they are; a value float32 cannot hold still refused
            if lost.any():
                what = "values outside float32's range" if np.isfinite(arr)[lost].all() else "NaN or inf"
                raise ValueError(f"state_dict[{name!r}] holds {what}: parameters must be finite in float32")
        self._c.set_params(flat, finite)
        return IncompatibleKeys(missing, unexpected)

    def _linear_names(self, state: Any, views: "OrderedDict[str, np.ndarray]") -> Optional[Dict[str, Any]]:
        """state under this model's names when it holds exactly its layers' weights and biases
        under other names, a module's weight and bias for each layer ("0.weight", "0.bias", ...),
        the modules in order (modules whose names differ only in their numbers, an nn.Sequential's,
        as they sort with their numbers read as numbers, "2" before "10"; others as they come),
        every shape right; else None. The numbers' order comes first where they name the modules:
        a dict whose keys were sorted as text ("0", "10", "2") can fit the shapes in that order too
        (layers of one width), and only the numbers say which layer is which."""
        keys = list(state.keys())
        if len(keys) != len(views) or not all(isinstance(k, str) for k in keys):
            return None
        modules: Dict[str, Dict[str, str]] = {}  # module -> {"weight": its key, "bias": its key}, in order
        for key in keys:
            module, _, kind = key.rpartition(".")
            if kind not in ("weight", "bias"):
                return None
            modules.setdefault(module, {})[kind] = key
        if len(modules) != len(self._sizes) - 1 or any(len(pair) != 2 for pair in modules.values()):
            return None

        def natural(module: str) -> List[Tuple[int, int, str]]:
            # a number by its digits (of any length: no int() of them), shorter first
            return [(0, len(part.lstrip("0")), part.lstrip("0")) if part.isascii() and part.isdigit() else (1, 0, part)
                    for part in re.split(r"([0-9]+)", module)]

        def renamed(order: List[str]) -> Optional[Dict[str, Any]]:
            out: Dict[str, Any] = {}
            for i, module in enumerate(order):
                for kind in ("weight", "bias"):
                    name, key = f"fc{i + 1}.{kind}", modules[module][kind]
                    # (a key of this model's names, among others, names that layer and no other)
                    if np.shape(state[key]) != views[name].shape or (key in views and key != name):
                        return None
                    out[name] = state[key]
            return out

        by_number = sorted(modules, key=natural)
        if len({re.sub(r"[0-9]+", "#", m) for m in modules}) == 1:  # "0", "2", ...; "layers.0", "layers.2", ...
            return renamed(by_number) or renamed(list(modules))
        if any(key in views for key in keys):  # fc1, fc2 and out: in the order given (never by how out sorts)
            return renamed(list(modules))
        return renamed(list(modules)) or renamed(by_number)

    def _why_not_layers(self, state: Any, views: "OrderedDict[str, np.ndarray]") -> str:
        """Why a module's weights and biases (not all of this model's names) were not read as its
        layers, where the keys say: a module with a weight and no bias (torch's
        Linear(bias=False)), or another number of layers; else ""."""
        keys = [k for k in state.keys() if isinstance(k, str)]
        if all(k in views for k in keys) or not keys or not all(k.endswith((".weight", ".bias")) for k in keys):
            return ""
        weights = [k[:-len(".weight")] for k in keys if k.endswith(".weight")]
        biased = {k[:-len(".bias")] for k in keys if k.endswith(".bias")}
        unbiased = [m for m in weights if m not in biased]
        if unbiased:
            return (f" (module{'s' if len(unbiased) > 1 else ''} {', '.join(repr(m) for m in unbiased)} "
                    f"{'have' if len(unbiased) > 1 else 'has'} a weight and no bias: every layer of an MLP here "
                    "has a bias, as torch's Linear(bias=True))")
        if len(weights) != len(self._sizes) - 1:
            return f" (the state_dict holds {len(weights)} layers' weights; the model has {len(self._sizes) - 1} layers)"
        return ""

    # ---- files ----
    def save(self, path: "os.PathLike[str] | str | IO[bytes]") -> None:
        """Writes an .npz of the state_dict, the layer sizes and normalize; atomic: a crash leaves
        the old file. A binary file object (as torch.save takes one) is written as it stands."""
        arrays: Dict[str, Any] = dict(self.state_dict())  # (any values: np.savez's keywords take a bool allow_pickle)
        arrays[_SIZES_KEY] = np.asarray(self._sizes, dtype=np.int64)
        arrays[_NORMALIZE_KEY] = np.asarray(self.normalize, dtype=np.float64)
        if hasattr(path, "write") and not isinstance(path, (str, bytes, os.PathLike)):
            np.savez(path, **arrays)
        else:
            atomic_write(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: "os.PathLike[str] | str | IO[bytes]", device: Device = "cpu") -> "MLP":
        """Reads a file written by save(): a path, or a binary file object (as torch.load takes
        one), read from where it stands."""
        source: Any
        if hasattr(path, "read") and not isinstance(path, (str, bytes, os.PathLike)):
            raw = path.read()
            if not isinstance(raw, (bytes, bytearray)):
                raise TypeError(f"load reads a binary file object (opened 'rb'), got one that gives "
                                f"{type(raw).__name__}")
            path, source, magic = repr(getattr(path, "name", path)), io.BytesIO(raw), bytes(raw[:4])
        else:
            path = source = os.fsdecode(path)  # str, bytes or os.PathLike
        opened = None
        try:
            if isinstance(source, str):
                if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO's open would wait for a writer
                    raise ValueError("it is not a regular file")
                # one handle, closed below whatever happens (NumPy leaves the one it opens open when
                # the archive is broken); the magic first: NumPy would read any other file as a pickle
                source = opened = open(path, "rb")
                magic = opened.read(4)
                opened.seek(0)
            if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # a zip's first entry, or an empty zip
                raise ValueError("it is not a zip archive, which an .npz file is")
            loaded = np.load(source, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ValueError("it holds a single array, not an .npz archive")
            with loaded as z:
                arrays = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError, NotImplementedError,
                RuntimeError) as e:  # the last two: a zip's unknown compression or encryption
            raise ValueError(f"{path} is not a readable cmlp model file (.npz): {e}") from None
        except MemoryError:  # a member whose header claims more than memory holds
            raise ValueError(f"{path} is not a readable cmlp model file (.npz): an array in it is larger than "
                             "the memory left") from None
        finally:
            if opened is not None:
                opened.close()
        if _SIZES_KEY not in arrays:
            raise ValueError(f"{path} is not a cmlp model file: it has no {_SIZES_KEY!r} entry")
        sizes = arrays.pop(_SIZES_KEY)
        if sizes.ndim != 1 or sizes.dtype.kind not in "iu":
            raise ValueError(f"{path}: {_SIZES_KEY!r} must be a 1-D integer array")
        normalize = arrays.pop(_NORMALIZE_KEY, np.array([0.5, 0.5]))
        if normalize.shape != (2,) or normalize.dtype.kind != "f":
            raise ValueError(f"{path}: {_NORMALIZE_KEY!r} must hold two floats (mean, std)")
        claimed = [int(s) for s in sizes]
        shapes: Dict[str, Tuple[int, ...]] = {}
        for i, (n_in, n_out) in enumerate(zip(claimed, claimed[1:])):
            shapes[f"fc{i + 1}.weight"], shapes[f"fc{i + 1}.bias"] = (n_out, n_in), (n_out,)
        if min(claimed, default=0) >= 1 and not any(k in shapes for k in arrays):
            # other names (a module's, "0.weight"): what the model needs, in some order, before
            # a model of the sizes claimed is made (they may claim more memory than there is)
            if sorted(np.shape(a) for a in arrays.values()) != sorted(shapes.values()):
                raise StateDictMismatch(f"{path}: its arrays {sorted(np.shape(a) for a in arrays.values())} are not "
                                        f"the weights and biases of layer sizes {claimed}")
        elif min(claimed, default=0) >= 1:
            # the file's arrays against its layer sizes before a model of those sizes is made (they
            # may claim more memory than there is)
            missing, unexpected = [k for k in shapes if k not in arrays], [k for k in arrays if k not in shapes]
            if missing or unexpected:
                raise StateDictMismatch(f"{path}: state_dict does not match the model {claimed}: missing keys "
                                        f"{missing}, unexpected keys {unexpected}")
            for k, shape in shapes.items():
                if arrays[k].shape != shape:
                    raise StateDictMismatch(f"{path}: {k!r} has shape {arrays[k].shape}; layer sizes {claimed} "
                                            f"need {shape}")
        model = cls(claimed, device=device, normalize=(float(normalize[0]), float(normalize[1])))
        try:
            model._load_state(arrays, True, finite=False)  # a diverged model's NaNs too, as saved
        except TypeError as e:  # an array of bools, strings or records
            raise ValueError(f"{path} is not a readable cmlp model file (.npz): {e}") from None
        return model

    def __deepcopy__(self, memo: Dict[int, Any]) -> "MLP":
        """copy.deepcopy: an independent model of the same class with the same parameters,
        gradients (or none), device, normalisation and other attributes (deep-copied, as torch's
        deepcopy of a module)."""
        cls = type(self)
        twin = cls.__new__(cls)
        memo[id(self)] = twin
        MLP.__init__(twin, self._sizes, device=self.device, normalize=self.normalize)
        twin._c.set_params(self._c.get_params(), False)  # a diverged model's NaNs too
        if not self._grads_none:
            twin._c.set_grads(self._c.get_grads())
            twin._grads_none = False
        twin.training = self.training
        twin._unscaled_grads = self._unscaled_grads
        own = set(twin.__dict__)
        for key, value in self.__dict__.items():
            if key not in own:
                twin.__dict__[key] = copy.deepcopy(value, memo)
        return twin

    def __copy__(self) -> "MLP":
        """copy.copy: another Python object of the same model (as before pickling was defined)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        _live.add(twin)
        return twin

    def __reduce__(self) -> Tuple[Any, ...]:
        """pickle (torch.save of a whole module, or a model sent to another process): a model of
        the same class, layer sizes and device, with the same parameters, gradients (or none),
        normalisation and other attributes; its optimizers are pickled with it only where they
        are pickled too."""
        grads = None if self._grads_none else self._c.get_grads()
        return (_unpickled, (type(self), list(self._sizes), self.device, self.normalize, self._c.get_params(), grads),
                {k: v for k, v in self.__dict__.items() if k not in ("_c", "_optimizers", "_optimizers_lock")})

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.training = state.get("training", True)
        self._unscaled_grads = state.get("_unscaled_grads", False)
        # attributes of its own (a subclass's, a user's); an older pickle's plain "normalize" is
        # the property's now, which _unpickled set
        for key, value in state.items():
            if key not in self.__dict__ and key != "normalize":
                self.__dict__[key] = value

    # ---- devices ----
    def train(self, mode: bool = True) -> "MLP":
        """torch's training/evaluation switch, kept in .training: an MLP of Linear layers and
        ReLUs computes the same either way (no dropout or batch norm)."""
        self.training = as_flag("mode", mode)
        return self

    def eval(self) -> "MLP":
        return self.train(False)

    def cuda(self, device: Any = None, non_blocking: bool = False) -> "MLP":
        """to("cuda"), or to the GPU given as torch's cuda() takes it (an index, a torch.device);
        as torch's, a device that is not a GPU is refused."""
        from ._args import _device_text

        device = "cuda" if device is None else _device_text(device)
        if isinstance(device, str) and not device.startswith("cuda"):
            raise RuntimeError(f"Invalid device, must be cuda device (got {device!r})")
        return self.to(device, non_blocking=non_blocking)

    def cpu(self) -> "MLP":
        return self.to("cpu")

    def to(self, device: Any = None, dtype: Any = None, non_blocking: bool = False) -> "MLP":
        """Moves parameters, gradients and the state of every optimizer of this model, all or
        nothing: when one cannot move (out of memory there), what has moved goes back. Torch's
        other arguments: dtype float32 (the model's; another is refused), non_blocking (taken:
        the move is done when this returns)."""
        from ._args import _device_text

        as_flag("non_blocking", non_blocking)
        if dtype is None and device is not None and _is_dtype(device):  # to(torch.float32)
            device, dtype = None, device
        if dtype is not None and not _is_dtype(dtype, float32_only=True):
            raise TypeError(f"cmlp's models hold float32 parameters: to() takes dtype float32 only, got {dtype!r}")
        if device is None:
            return self
        # one call, under the model's lock: a step in another thread never finds them apart
        with self._optimizers_lock:
            self._c.to(_device_text(device), tuple(opt._c for opt in self._optimizers))
        return self


def _is_dtype(value: Any, float32_only: bool = False) -> bool:
    """Whether value names a dtype (torch's or NumPy's, as to() takes one); float32's only, with
    float32_only."""
    if type(value).__module__.startswith("torch") and type(value).__name__ == "dtype":
        return not float32_only or str(value) == "torch.float32"
    if isinstance(value, str) or not isinstance(value, (type, np.dtype)):
        return False
    try:
        dt = np.dtype(value)
    except TypeError:
        return False
    return not float32_only or dt == np.float32


def _unpickled(cls: Type[MLP], sizes: List[int], device: str, normalize: Tuple[float, float], params: np.ndarray,
               grads: Optional[np.ndarray]) -> MLP:
    """A model of class cls made again from what MLP.__reduce__ gave (its attributes follow:
    __setstate__)."""
    twin = cls.__new__(cls)
    MLP.__init__(twin, sizes, device=device, normalize=normalize)
    twin._c.set_params(params, False)  # a diverged model's NaNs too
    if grads is not None:
        twin._c.set_grads(grads)
        twin._grads_none = False
    return twin
