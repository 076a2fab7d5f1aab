"""megatron-core's `jit_fuser` compiles on the first call of a fused function, not at import.

`megatron.core.jit` binds `jit_fuser = torch.compile` when megatron-core is imported, and the
fusion modules decorate their functions with it as they are imported. The decoration alone
imports torch's compiler stack (`torch._dynamo`, inductor): about 2.1 of the 5.5 CPU seconds
that `import megatron_hexi.training` takes on a 2-core VM (3.4 s with it deferred), in every
process, whether a fused kernel ever runs (GPU) or not (CPU runs switch the fusions off).
`torch.compile(fn)` itself only compiles at the first call, so deferring the `torch.compile`
call to that first call runs the same compiled function; only the compiler's import moves.

`install()` (from megatron_hexi/__init__.py, which imports no torch) adds an import hook:
when `megatron.core.jit` is first imported, its `jit_fuser` is replaced by `lazy_compile` if it
is `torch.compile`. A process that imported megatron-core before megatron_hexi keeps the
upstream binding. Checked against megatron-core 0.16.1.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_TARGET = "megatron.core.jit"


def lazy_compile(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """`torch.compile(fn, **kwargs)`, called at fn's first call instead of now."""
    if fn is None:
        return lambda f: lazy_compile(f, **kwargs)
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **kwargs)
        return compiled(*args, **kw)

    return call


class _Loader(importlib.abc.Loader):
    """megatron.core.jit's own loader, then `jit_fuser` made lazy."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.__dict__["jit_fuser"] = lazy_compile


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Add the import hook once, unless megatron.core.jit is imported already."""
    if _TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
