"""CPU patch for ``megatron/core/utils.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device and its tensor factories
map ``device="cuda"`` to the CPU.

Why: ``GlobalMemoryBuffer.get_tensor`` (utils.py:631) allocates with
``device=torch.cuda.current_device()``; it is used by every ``DotProductAttention`` forward
(dot_product_attention.py:189). ``local_multi_tensor_l2_norm`` (utils.py:1207, the fallback used
by grad clipping when apex / TE are absent) returns ``torch.tensor(..., device="cuda")``.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.utils"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
