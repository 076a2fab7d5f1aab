"""CPU patch for ``megatron/core/pipeline_parallel/p2p_communication.py``.

What: the module's ``torch.cuda.current_device()`` returns the CPU device and its
``torch.cuda.synchronize()`` does nothing.

Why: the shape exchange and the receive buffers are allocated on
``torch.cuda.current_device()`` (p2p_communication.py:190-202,311-321), and after a batched
``batch_isend_irecv`` upstream calls ``torch.cuda.synchronize()`` (:242,398) to work around an
NCCL race. With gloo the requests are complete once ``wait()`` returns.

Note (not fixed here, a trap): with interleaved (virtual) pipelines, PP=2 and
``batch_p2p_comm=True`` on gloo, prev and next are the same peer and messages are matched in
posting order: activations and gradients swap silently. Use ``batch_p2p_comm=False`` on gloo.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.pipeline_parallel.p2p_communication"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
