"""CPU patch for ``megatron/core/tensor_parallel/mappings.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device (via a module-local
``torch`` stand-in, see ``_util.cpu_torch``).

Why: the all-gather / reduce-scatter output buffers of the tensor-parallel mappings are allocated
with ``device=torch.cuda.current_device()`` (mappings.py:91,141,148,181,442), which raises on a
CPU build and, on a GPU host, puts a CPU run's buffers on the GPU. Hit by sequence parallelism
and by gathering logits/outputs across TP ranks.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.tensor_parallel.mappings"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
