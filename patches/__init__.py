"""The changes megatron-core needs to run on the CPU (gloo), with or without a GPU in the machine.

One small module per patched upstream module; each one's docstring says what it changes, why, and
which megatron-core versions it was checked against (README.md has the table). Nothing happens on
import: a process that runs on the CPU calls :func:`apply_cpu_patches` once at start-up, before
building models, optimizers or schedules. The patches follow the run's device, not CUDA's
visibility: a CPU run on a GPU host is patched too (otherwise megatron-core would put its buffers
on the GPU next to a CPU model), and a CUDA run never calls it, so it sees upstream code unchanged.

    from megatron_hexi.patches import apply_cpu_patches
    apply_cpu_patches()   # idempotent; returns the names of the applied patches
"""

from __future__ import annotations

import importlib
from typing import Tuple

from . import _util

TESTED_MEGATRON_CORE_VERSIONS = frozenset({"0.16.1"})

# Our patch module name, in the order they are applied.
PATCH_MODULES: Tuple[str, ...] = (
    "tensor_parallel_random",
    "tensor_parallel_mappings",
    "tensor_parallel_layers",
    "tensor_parallel_utils",
    "core_utils",
    "rotary_pos_embedding",
    "transformer_dot_product_attention",
    "transformer_utils",
    "language_module",
    "pipeline_p2p_communication",
    "pipeline_schedules",
    "optimizer_clip_grads",
    "optimizer_optimizer",
    "optimizer_grad_scaler",
    "distributed_param_and_grad_buffer",
)

_applied: Tuple[str, ...] | None = None
_log: _util.UndoLog | None = None


def megatron_core_version() -> str:
    """The version of the megatron-core that ``import megatron.core`` gives."""
    import megatron.core

    version = getattr(megatron.core, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("megatron-core")
    return str(version)


def patched_megatron_version() -> str:
    """The installed megatron-core version, checked against the versions these patches were
    tested with. Raises RuntimeError naming the version when it is not one of them."""
    version = megatron_core_version()
    if version not in TESTED_MEGATRON_CORE_VERSIONS:
        raise RuntimeError(
            f"megatron_hexi: installed megatron-core {version} is not one the CPU patches were "
            f"checked against ({', '.join(sorted(TESTED_MEGATRON_CORE_VERSIONS))}); install "
            "megatron-core==0.16.1, or re-check every module in megatron_hexi/patches against "
            f"{version} and add it to TESTED_MEGATRON_CORE_VERSIONS"
        )
    return version


def apply_cpu_patches() -> Tuple[str, ...]:
    """Apply every CPU patch, whether or not CUDA is visible. Idempotent.

    Only for a process whose model runs on the CPU: the patches send megatron-core's CUDA
    allocations of the whole process to the CPU. Checks the megatron-core version first
    (RuntimeError if untested). Returns the names of the applied patch modules. If one patch
    fails, the ones already applied are reverted before the error propagates.
    """
    global _applied, _log
    patched_megatron_version()
    if _applied is not None:
        return _applied
    log = _util.UndoLog()
    try:
        for name in PATCH_MODULES:
            patch = importlib.import_module(f"{__name__}.{name}")
            patch.apply(log, importlib.import_module(patch.UPSTREAM))
    except BaseException:
        log.undo_all()
        raise
    _log, _applied = log, PATCH_MODULES
    return _applied


# Applied on top of the training patches by `apply_conversion_patches` only: they patch modules
# the runtime never imports, so training processes do not pay for importing them.
CONVERSION_PATCH_MODULES: Tuple[str, ...] = (
    "dist_checkpointing_filesystem_async",
    "dist_checkpointing_state_dict_saver",
)
_conversion_applied = False


def apply_conversion_patches() -> Tuple[str, ...]:
    """The CPU patches plus those a one-process checkpoint conversion on the CPU needs
    (megatron-core's dist_checkpointing save). Idempotent; reverted by remove_cpu_patches."""
    global _conversion_applied
    applied = apply_cpu_patches()
    if not _conversion_applied:
        assert _log is not None
        for name in CONVERSION_PATCH_MODULES:
            patch = importlib.import_module(f"{__name__}.{name}")
            patch.apply(_log, importlib.import_module(patch.UPSTREAM))
        _conversion_applied = True
    return applied + CONVERSION_PATCH_MODULES


def applied_cpu_patches() -> Tuple[str, ...]:
    """Names of the applied patches (empty before :func:`apply_cpu_patches` or after removal)."""
    return _applied or ()


def remove_cpu_patches() -> None:
    """Revert every patch (for tests)."""
    global _applied, _log, _conversion_applied
    if _log is not None:
        _log.undo_all()
    _applied, _log, _conversion_applied = None, None, False


__all__ = [
    "TESTED_MEGATRON_CORE_VERSIONS",
    "PATCH_MODULES",
    "CONVERSION_PATCH_MODULES",
    "apply_cpu_patches",
    "apply_conversion_patches",
    "applied_cpu_patches",
    "megatron_core_version",
    "patched_megatron_version",
    "remove_cpu_patches",
]
