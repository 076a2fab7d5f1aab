"""Shared helpers for the CPU patches (not a patch itself).

Three tools, all reversible through :class:`UndoLog`:

* :func:`cpu_torch` builds a stand-in for the ``torch`` module that one upstream module sees as its
  global ``torch``.  Everything is forwarded to the real ``torch`` except:
  ``torch.cuda.current_device()`` returns ``torch.device("cpu")``, ``torch.cuda.synchronize()``
  does nothing, and the tensor factories (``torch.tensor``, ``zeros``, ``empty``, ...) turn a
  ``device="cuda"`` / ``"cuda:N"`` / ordinal argument into the CPU.  Only that one module is
  affected; the real ``torch`` and every other module are untouched.
* :func:`replace_code_constants` / :func:`replace_code_names` swap a string constant (such as the
  legacy type string ``'torch.cuda.FloatTensor'``) or an attribute name inside one function's code
  object, in place, so that every existing reference to the function sees the change.  They
  raise if the expected constant/name is missing, which is how a changed upstream is detected.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Dict, List, Tuple

import torch

_CPU = torch.device("cpu")

# Factories that upstream calls with device="cuda" or device=torch.cuda.current_device().
_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn")


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, bool):
        return device
    if isinstance(device, int):  # a CUDA ordinal
        return _CPU
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


def _cpu_current_device() -> torch.device:
    return _CPU


def _no_synchronize(device: Any = None) -> None:
    """CPU collectives (gloo) are complete when their wait() returns: nothing to synchronize."""


class NamespaceProxy:
    """Forwards attribute reads to ``real`` except for the names in ``overrides``."""

    def __init__(self, real: Any, overrides: Dict[str, Any]):
        object.__setattr__(self, "_hexi_real", real)
        object.__setattr__(self, "_hexi_overrides", dict(overrides))

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_hexi_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_hexi_real"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"megatron_hexi CPU torch proxy is read-only (tried to set {name!r})")

    def __dir__(self) -> list[str]:
        return dir(object.__getattribute__(self, "_hexi_real"))

    def __repr__(self) -> str:
        return f"<megatron_hexi CPU proxy of {object.__getattribute__(self, '_hexi_real')!r}>"


def cpu_torch(extra_cuda: Dict[str, Any] | None = None) -> NamespaceProxy:
    """A ``torch`` stand-in for one upstream module of a CPU run (see module doc).

    Nothing in it asks whether CUDA is visible: on a GPU host the module still gets the CPU."""
    cuda_overrides = {"current_device": _cpu_current_device, "synchronize": _no_synchronize}
    cuda_overrides.update(extra_cuda or {})
    overrides: Dict[str, Any] = {"cuda": NamespaceProxy(torch.cuda, cuda_overrides)}
    for name in _FACTORIES:
        overrides[name] = _cpu_factory(getattr(torch, name))
    return NamespaceProxy(torch, overrides)


class UndoLog:
    """Records every change, so that :func:`megatron_hexi.patches.remove_cpu_patches` can
    revert it."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        if not hasattr(owner, name):
            raise RuntimeError(f"megatron_hexi patch: {owner!r} has no attribute {name!r}")
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def set_code(self, fn: Callable, code: types.CodeType) -> None:
        old = fn.__code__
        fn.__code__ = code
        self._undo.append(lambda: setattr(fn, "__code__", old))

    def add(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def undo_all(self) -> None:
        while self._undo:
            self._undo.pop()()


def _swap(value: Any, mapping: Dict[str, str], hits: set) -> Any:
    if isinstance(value, str) and value in mapping:
        hits.add(value)
        return mapping[value]
    if isinstance(value, tuple):
        return tuple(_swap(v, mapping, hits) for v in value)
    return value


def replace_code_constants(log: UndoLog, fn: Callable, mapping: Dict[str, str]) -> None:
    """Replace exact string constants (also inside constant tuples) in ``fn``'s own code."""
    code = fn.__code__
    hits: set = set()
    consts: Tuple = tuple(_swap(c, mapping, hits) for c in code.co_consts)
    missing = set(mapping) - hits
    if missing:
        raise RuntimeError(
            f"megatron_hexi patch: {fn.__module__}.{fn.__qualname__} no longer contains "
            f"{sorted(missing)}; the upstream code changed, re-check the patch"
        )
    log.set_code(fn, code.replace(co_consts=consts))


def replace_code_names(log: UndoLog, fn: Callable, mapping: Dict[str, str]) -> None:
    """Replace global/attribute names (``co_names``) in ``fn``'s own code."""
    code = fn.__code__
    missing = set(mapping) - set(code.co_names)
    if missing:
        raise RuntimeError(
            f"megatron_hexi patch: {fn.__module__}.{fn.__qualname__} no longer uses the names "
            f"{sorted(missing)}; the upstream code changed, re-check the patch"
        )
    names = tuple(mapping.get(n, n) for n in code.co_names)
    log.set_code(fn, code.replace(co_names=names))


def proxy_module_torch(log: UndoLog, module: types.ModuleType, **kwargs: Any) -> None:
    """Make ``module``'s global ``torch`` the CPU stand-in of :func:`cpu_torch`."""
    if getattr(module, "torch", None) is not torch:
        raise RuntimeError(
            f"megatron_hexi patch: {module.__name__}.torch is not the torch module; "
            "the upstream code changed, re-check the patch"
        )
    log.set_attr(module, "torch", cpu_torch(**kwargs))
