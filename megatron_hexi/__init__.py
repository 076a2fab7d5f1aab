"""megatron-hexi runtime: train under a heterogeneous plan on megatron-core.

Importing this package silences megatron-core's notices about optional GPU extras that are
expected to be absent on CPU machines (Apex, Transformer Engine) and about CUDA-only settings;
every other warning is left alone.
"""

import logging
import warnings

from megatron_hexi import lazy_jit

# megatron-core's fused functions compile when first called: their import does not pull in
# torch's compiler (lazy_jit says why)
lazy_jit.install()

for _message in (
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*full scope is deprecated.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
):
    warnings.filterwarnings("ignore", message=_message)


class _NoMockCacheNotice(logging.Filter):
    """Mock datasets are never cached; megatron-core says so once per split."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "indexes because path_to_cache is None" not in record.getMessage()


logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(_NoMockCacheNotice())
