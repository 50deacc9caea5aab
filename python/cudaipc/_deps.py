"""Optional packages: imported where first needed, and when missing, an error that says
in one line what to install (Debian's package and pip's)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Dict, Tuple

from .errors import CudaipcError

__all__ = ["MissingDependency", "require", "available", "INSTALL"]

# module -> (what it is, Debian package, pip package)
INSTALL: Dict[str, Tuple[str, str, str]] = {
    "google.protobuf": ("protobuf", "python3-protobuf", "protobuf"),
    "numpy": ("NumPy", "python3-numpy", "numpy"),
    "torch": ("PyTorch", "python3-torch", "torch"),
    "cupy": ("CuPy", "", "cupy-cuda12x (or cupy-cuda13x, after your CUDA)"),
    "cuda.bindings": ("NVIDIA's cuda-bindings", "", "cuda-bindings"),
    "pytest": ("pytest", "python3-pytest", "pytest"),
    "mypy": ("mypy", "python3-mypy", "mypy"),
}


class MissingDependency(CudaipcError, ImportError):
    """An optional package a call needs is not installed; the message names it."""


def install_hint(module: str) -> str:
    """What to install for ``module``, as one line: "apt-get install python3-torch
    (Debian) or pip install torch"."""
    _, deb, pip = INSTALL.get(module, (module, "", module))
    if deb:
        return "apt-get install %s (Debian) or pip install %s" % (deb, pip)
    return "pip install %s (Debian has no package)" % pip


def require(module: str, for_what: str) -> Any:
    """``module`` imported, or MissingDependency saying that ``for_what`` needs it and
    how to install it."""
    m = sys.modules.get(module)
    if m is not None:
        return m
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and not module.startswith(e.name) and not e.name.startswith(module):
            raise   # the package is there but one of its own imports failed: show that
        raise MissingDependency("cudaipc: %s needs %s: %s" % (for_what, INSTALL.get(module, (module,))[0],
                                                            install_hint(module))) from None


def available(module: str) -> bool:
    """Whether ``module`` can be imported (it is, as a side effect)."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False
