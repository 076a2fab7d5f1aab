"""CPU patch for ``megatron/core/transformer/utils.py``.

What: the module's tensor factories map ``device="cuda"`` to the CPU.

Why: ``get_default_causal_mask`` (transformer/utils.py:35) and ``get_sliding_window_causal_mask``
(:40) build their masks with ``device="cuda"``. The torch softmax fallback (used when the fused
kernels are absent, i.e. always on CPU) calls ``get_default_causal_mask`` whenever a causal layer
gets ``attention_mask=None`` (fused_softmax.py:327).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.transformer.utils"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
