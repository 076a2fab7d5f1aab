"""CPU patch for ``megatron/core/dist_checkpointing/strategies/state_dict_saver.py``.

What: the module's ``device='cuda'`` / ``torch.cuda.current_device()`` mean the CPU.

Why: the save's verification and failure flags are one-element tensors made on the CUDA device
(state_dict_saver.py:204, 252) and broadcast; on the CPU they are made and sent there (gloo).
Applied by ``apply_conversion_patches`` only (``hexi-convert export-megatron``).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.dist_checkpointing.strategies.state_dict_saver"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
