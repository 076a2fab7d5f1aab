#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the project with its test extras, at the exact CPU
# versions of tools/constraints-cpu.txt (torch 2.13.0 CPU build). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# megatron-core, torch and pytest-xdist are found, not imported: importing them takes seconds, and
# this runs before every test run (and twice in the README's test).
if ! .venv/bin/python -c "import megatron_hexi, planner, pytest, jsonschema, importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('megatron.core', 'torch', 'xdist')))" 2>/dev/null \
   || [ setup.py -nt .venv/.hexi-installed ] || [ tools/constraints-cpu.txt -nt .venv/.hexi-installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q --no-compile -c tools/constraints-cpu.txt -e ".[test]"
  # Bytecode for what the project's processes import, and only that: one interpreter imports
  # the entry points, a rank's modules (megatron_hexi.rank_imports, which the tests' forkserver
  # preloads too) and the test runner with bytecode writing on, so each
  # of those modules is compiled once (about 2,400 of the environment's 13,000 files: 16 s on
  # one core, where compiling every file took 45 CPU s). A module imported later is compiled
  # by its first importer, or by every importer where PYTHONDONTWRITEBYTECODE is set.
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -W ignore -c "import importlib
from megatron_hexi.rank_imports import rank_modules
for m in (*rank_modules(), 'megatron_hexi.entry', 'megatron_hexi.launch.cli',
          'megatron_hexi.profile.cli', 'megatron_hexi.convert.cli', 'megatron_hexi.cluster_tools.cli',
          'planner.cli', 'torch.distributed.run', 'pytest', 'xdist.remote'):
    importlib.import_module(m)"
  touch .venv/.hexi-installed
fi
# The checkout's bytecode, written once: the editable install leaves it uncompiled, and an
# environment with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every imported module in
# every fresh interpreter (each rank, each CLI call; about 0.6 CPU s each). compileall rewrites
# only what changed, and Python checks each file's size and mtime before it uses its bytecode.
.venv/bin/python -m compileall -q megatron_hexi planner patches tests tools pretrain_gpt.py >/dev/null
