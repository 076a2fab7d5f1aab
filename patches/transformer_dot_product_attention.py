"""CPU patch for ``megatron/core/transformer/dot_product_attention.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device.

Why: with ``softmax_type`` "off-by-one" or "learnable" the softmax offset is allocated on
``torch.cuda.current_device()`` (dot_product_attention.py:123,132). The default ("vanilla")
needs no patch here; its CPU obstacles are the memory buffer (``core_utils``) and the RNG fork
(``tensor_parallel_random``).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.transformer.dot_product_attention"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
