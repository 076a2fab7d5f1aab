"""CPU patch for ``megatron/core/tensor_parallel/random.py`` (the RNG states tracker).

What: in a CPU run (whether or not CUDA is visible), the "device" generator that the tracker
saves, seeds, forks and restores is the CPU default generator (the one dropout uses on CPU):

* ``_get_cuda_rng_state`` (random.py:41-69) -> ``torch.get_rng_state()``;
* ``_set_cuda_rng_state`` (random.py:72-109) -> ``torch.set_rng_state()``;
* the module's ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` (used by
  ``CudaRNGStatesTracker.add``, random.py:235-240, and ``model_parallel_cuda_manual_seed``,
  random.py:422) -> their CPU counterparts;
* the warning "CPU RNG state changed within GPU RNG context" (``fork``, random.py:266) is dropped:
  on CPU the forked state *is* the CPU state, so it changing is the expected behaviour.

Why: ``DotProductAttention.forward`` forks the 'model-parallel-rng' state on every call, even with
dropout 0 (dot_product_attention.py:217); ``model_parallel_cuda_manual_seed`` and the GPU weight
initialisation path (layers.py:142) use the tracker too. Upstream goes through
``torch.cuda.default_generators`` and ``torch.cuda.manual_seed``, which fail on a CPU build and,
on a GPU host, would fork a GPU generator that a CPU run's dropout never reads.
Note: ``model_parallel_cuda_manual_seed(seed)`` therefore also re-seeds the CPU generator with
``seed`` (on GPU it seeds the CUDA generator with the same value). Graph-safe (cudagraphable)
RNG needs CUDA and raises.

Checked against megatron-core 0.16.1.
"""

import logging
import types

import torch

from . import _util

UPSTREAM = "megatron.core.tensor_parallel.random"
_WARNING = "CPU RNG state changed within GPU RNG context"


def _get_cpu_rng_state(
    device: str | int | torch.device = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    if graph_safe:
        raise RuntimeError("graph-safe (cudagraphable) RNG states need CUDA")
    return torch.get_rng_state()


def _set_cpu_rng_state(
    new_state: torch.Tensor, device: str | int | torch.device = -1, graph_safe: bool = False
) -> None:
    if graph_safe:
        raise RuntimeError("graph-safe (cudagraphable) RNG states need CUDA")
    torch.set_rng_state(new_state)


def _cuda_get_rng_state(device: str | int | torch.device = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cuda_set_rng_state(new_state: torch.Tensor, device: str | int | torch.device = "cuda") -> None:
    torch.set_rng_state(new_state)


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _WARNING


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    log.set_attr(module, "_get_cuda_rng_state", _get_cpu_rng_state)
    log.set_attr(module, "_set_cuda_rng_state", _set_cpu_rng_state)
    _util.proxy_module_torch(
        log,
        module,
        extra_cuda={
            "get_rng_state": _cuda_get_rng_state,
            "set_rng_state": _cuda_set_rng_state,
            "manual_seed": torch.manual_seed,
        },
    )
    logger = logging.getLogger(module.__name__)
    flt = _DropForkWarning()
    logger.addFilter(flt)
    log.add(lambda: logger.removeFilter(flt))
