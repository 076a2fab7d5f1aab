#!/usr/bin/env python
"""The former name of `hexi-convert` (megatron_hexi.convert), kept for a release: the same
commands and messages, under this script's name."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_hexi.convert import cli  # noqa: E402
from megatron_hexi.convert.families import hf_config, model_fields  # noqa: E402, F401
from megatron_hexi.convert.hf import (  # noqa: E402, F401
    export_hf,
    head_dim_warning,
    import_hf,
    read_hf_tensors,
)
from megatron_hexi.convert.tensors import canonical_to_hf, hf_to_canonical  # noqa: E402, F401


def main(argv=None):
    return cli.main(argv, prog="convert_hf_llama.py")


if __name__ == "__main__":
    sys.exit(main())
