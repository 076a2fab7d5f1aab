"""CPU patch for ``megatron/core/optimizer/clip_grads.py``.

What: the module's tensor factories map ``device="cuda"`` to the CPU, and the assertion
``param.grad.type() == 'torch.cuda.FloatTensor'`` in ``clip_grad_by_total_norm_fp32``
(clip_grads.py:167) compares with ``'torch.FloatTensor'`` instead (one string constant of that
function's code is swapped; the function object stays the same, so the reference imported by
optimizer.py sees it too).

Why: ``get_grad_norm_fp32`` (clip_grads.py:90,103,115), ``clip_grad_by_total_norm_fp32`` (:174)
and ``count_zeros_fp32`` (:207) allocate on ``device='cuda'``; the legacy type string is the CUDA
one.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.optimizer.clip_grads"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
    _util.replace_code_constants(
        log, module.clip_grad_by_total_norm_fp32, {"torch.cuda.FloatTensor": "torch.FloatTensor"}
    )
