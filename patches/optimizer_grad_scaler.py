"""CPU patch for ``megatron/core/optimizer/grad_scaler.py``.

What: the module's tensor factories map ``device="cuda"`` to the CPU.

Why: the loss scalers keep their scale and factors on ``device='cuda'`` (grad_scaler.py:15,88,91,
94); only used with fp16 / a loss scaler. Not patched: ``load_state_dict`` (:140) calls
``Tensor.cuda()``.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.optimizer.grad_scaler"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
