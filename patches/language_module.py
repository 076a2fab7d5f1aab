"""CPU patch for ``megatron/core/models/common/language_module/language_module.py``.

What: in ``LanguageModule.setup_embeddings_and_output_layer`` the call
``weight.data = weight.data.cuda()`` (language_module.py:244) becomes ``weight.data.cpu()``
(the attribute name ``cuda`` of that one function's code is swapped for ``cpu``; the function uses
the name nowhere else).

Why: with tied embeddings and more than one pipeline stage, the first and last stages all-reduce
the shared word-embedding weight at construction, after moving it to CUDA.

Checked against megatron-core 0.16.1.
"""

import types

from . import _util

UPSTREAM = "megatron.core.models.common.language_module.language_module"


def apply(log: _util.UndoLog, module: types.ModuleType) -> None:
    _util.replace_code_names(
        log, module.LanguageModule.setup_embeddings_and_output_layer, {"cuda": "cpu"}
    )
