"""CPU patch for ``megatron/core/distributed/param_and_grad_buffer.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device.

Why: megatron's ``DistributedDataParallel`` allocates its contiguous param / grad buffers on
``torch.cuda.current_device()`` (param_and_grad_buffer.py:783,800,806). Not patched: the NCCL
user-buffer warm-up (:768), NCCL only.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.distributed.param_and_grad_buffer"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
