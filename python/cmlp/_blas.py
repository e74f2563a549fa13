"""Loads the BLAS the extension was linked against before the extension itself, so that the
extension finds it wherever pip put it (its build-time rpath may point into a build tree)."""
import ctypes
import os


def preload() -> None:
    try:
        import scipy_openblas32 as sob  # type: ignore[import-untyped]  # (no stubs)
    except ImportError:  # built against a system BLAS found by the dynamic loader
        return
    path = os.path.join(sob.get_lib_dir(), "lib" + sob.get_library() + ".so")
    if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
