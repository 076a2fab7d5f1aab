"""CPU patch for ``megatron/core/tensor_parallel/utils.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device.

Why: ``split_tensor_into_1d_equal_chunks`` / ``gather_split_1d_tensor`` allocate with
``device=torch.cuda.current_device()`` (tensor_parallel/utils.py:70,91).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.tensor_parallel.utils"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
