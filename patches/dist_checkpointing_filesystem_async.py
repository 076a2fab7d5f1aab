"""CPU patch for ``megatron/core/dist_checkpointing/strategies/filesystem_async.py``.

What: the module's ``torch.cuda.synchronize()`` is a no-op.

Why: ``FileSystemWriterAsync.preload_tensors`` copies every tensor to the host with
``non_blocking=True`` and then synchronizes CUDA unconditionally (filesystem_async.py:229-230),
which fails on a torch without CUDA. Only ``hexi-convert``'s Megatron-LM saves use it (the
runtime's own checkpoints do not), so it is applied by ``apply_conversion_patches``, not with
the training patches.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
