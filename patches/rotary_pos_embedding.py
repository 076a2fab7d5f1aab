"""CPU patch for ``megatron/core/models/common/embeddings/rotary_pos_embedding.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device.

Why: ``RotaryEmbedding.__init__`` puts ``inv_freq`` on ``torch.cuda.current_device()`` unless
``use_cpu_initialization`` (rotary_pos_embedding.py:78), ``RotaryEmbedding.forward`` moves it there
when it is on CPU (:162), and the multimodal RoPE does the same (:297).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.models.common.embeddings.rotary_pos_embedding"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
