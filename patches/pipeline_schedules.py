"""CPU patch for ``megatron/core/pipeline_parallel/schedules.py``.

What: the module's tensor factories map ``device="cuda"`` to the CPU.

Why: every schedule allocates its token counter as
``torch.zeros([], dtype=torch.int, device="cuda")``: ``forward_backward_no_pipelining``
(schedules.py:596), ``forward_backward_pipelining_with_interleaving`` (:983) and
``forward_backward_pipelining_without_interleaving`` (:2138).

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.pipeline_parallel.schedules"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.proxy_module_torch(log, module)
