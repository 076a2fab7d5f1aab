"""CPU patch for ``megatron/core/tensor_parallel/layers.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device.

Why: with ``use_cpu_initialization=False`` (the default) the parallel layers allocate their
weights and biases with ``device=torch.cuda.current_device()`` (layers.py:261,597,607,873,899,
1197,1218), and the sequence-parallel all-gather buffer does too (layers.py:552). With the patch
the default "GPU" initialisation path runs on CPU (under the RNG tracker of
``tensor_parallel_random``). ``use_cpu_initialization=True`` needs no patch here.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.tensor_parallel.layers"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
