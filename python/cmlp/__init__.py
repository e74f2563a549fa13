"""cmlp: train multilayer perceptrons from NumPy arrays on the CPU or an NVIDIA GPU, with every
byte owned by a caching allocator, so that running out of memory is planned for and survived.

    import cmlp
    model = cmlp.MLP([784, 512, 256, 10], seed=0)
    opt = cmlp.optim.Adam(model, lr=1e-3)
    history = cmlp.Trainer(model, opt, batch_size=32).fit(x_train, y_train, epochs=5)
"""
from ._blas import preload as _preload

_preload()

from . import _cmlp  # noqa: E402
import atexit as _atexit  # noqa: E402

# At exit, the calls other threads have under way end before the C libraries' own exit handlers
# run (the CUDA runtime's among them); cmlp's C handler waits again after them.
_atexit.register(_cmlp.wait_for_calls)
from ._cmlp import OutOfMemoryError  # noqa: E402
from . import amp, cuda, datasets, distributed, memory, nn, optim  # noqa: E402
from .memory import MemoryWarning, empty_cache  # noqa: E402


def _register_fork_handler() -> None:
    import os

    # a model that another thread was using when the process forked is refused in the child
    # instead of waiting for ever for that thread's lock
    os.register_at_fork(after_in_child=_cmlp.after_fork_child)


_register_fork_handler()


def _run_as_command() -> bool:
    """This import is python -m cmlp's, before its command line runs (while the module is being
    found, sys.argv[0] is "-m")."""
    import sys

    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(a == "-m" and b == "cmlp" for a, b in zip(argv, argv[1:]))


def _configure_from_environment() -> None:
    import os

    # CMLP_ALLOC_CONF, when set (even empty), is cmlp's own and PyTorch's variables are not read;
    # of those, the first set is read, in PyTorch's order. The first GPU to open reads them again
    # (the C core), as PyTorch does when CUDA starts: one set after import applies from there,
    # unless memory.configure() was called in between.
    for var in ("CMLP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var)
        if conf is None:
            continue
        try:
            memory.configure(conf)
        except ValueError as e:
            hint = ("; set CMLP_ALLOC_CONF (it takes precedence, and may be empty) to give cmlp settings of its "
                    "own" if var != "CMLP_ALLOC_CONF" else "")
            _environment_error(f"{var}={conf!r}: {e}{hint}")
        _cmlp.note_env(f"{var}={conf}")
        break
    else:
        _cmlp.note_env(None)
    # the CPU threads (the pool starts with the first parallel call): a count the run's bits depend on
    threads = os.environ.get("CMLP_NUM_THREADS", "")
    count = threads.strip()
    if count and not (count.isascii() and count.isdigit() and int(count) >= 1):
        _environment_error(f"CMLP_NUM_THREADS={threads!r}: expected a count of CPU threads (an int >= 1), "
                           "or unset for every CPU the process may run on")


def _environment_error(error: str) -> None:
    if _run_as_command():  # python -m cmlp: its errors are a line and status 2, this one too
        import sys

        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    raise ValueError(error) from None


_configure_from_environment()
from .model import MLP  # noqa: E402
from .trainer import Trainer  # noqa: E402

__version__ = _cmlp.build_info()["version"]


def build_info() -> dict:
    """Version, BLAS (library and the kernel it runs), CUDA version or None, compiler."""
    import platform

    import numpy

    info = dict(_cmlp.build_info())
    info["python"] = platform.python_version()
    info["numpy"] = numpy.__version__
    return info


__all__ = ["MLP", "Trainer", "OutOfMemoryError", "MemoryWarning", "build_info", "empty_cache",
           "amp", "cuda", "datasets", "distributed", "memory", "nn", "optim"]
