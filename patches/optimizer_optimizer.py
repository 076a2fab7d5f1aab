"""CPU patch for ``megatron/core/optimizer/optimizer.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device and its tensor factories
map ``device="cuda"`` to the CPU; in ``Float16OptimizerWithFloat16Params.__init__`` the legacy type
strings ``'torch.cuda.HalfTensor'``, ``'torch.cuda.BFloat16Tensor'``, ``'torch.cuda.FloatTensor'``
(optimizer.py:671,690) become their CPU names (string constants of that one function swapped).

Why: ``MixedPrecisionOptimizer.__init__`` (optimizer.py:473-485), ``FP32Optimizer.__init__``
(:907) and ``ChainedOptimizer.get_loss_scale`` (:1141) allocate on CUDA; the bf16/fp16 optimizer
rejects parameters whose type string is not a CUDA one. The fp32 optimizer (``FP32Optimizer``)
needs only the device part. Not patched: ``offload_to_cpu``/``restore_from_cpu`` (RL only).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.optimizer.optimizer"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
    _util.replace_code_constants(
        log,
        module.Float16OptimizerWithFloat16Params.__init__,
        {
            "torch.cuda.HalfTensor": "torch.HalfTensor",
            "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor",
            "torch.cuda.FloatTensor": "torch.FloatTensor",
        },
    )
