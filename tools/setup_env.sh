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
  # pip compiles what it installs one file after another; compileall does the same files on
  # every core (about 20 s less on 2 cores). Like pip, it leaves a file that does not compile to
  # the interpreter, hence `|| true`.
  .venv/bin/python -m pip install -q --no-compile -c tools/constraints-cpu.txt -e ".[test]"
  .venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null || true
  touch .venv/.hexi-installed
fi
# The checkout's bytecode, written once: the editable install leaves it uncompiled, and an
# environment with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every imported module in
# every fresh interpreter (each rank, each CLI call; about 0.6 CPU s each). compileall rewrites
# only what changed, and Python checks each file's size and mtime before it uses its bytecode.
.venv/bin/python -m compileall -q megatron_hexi planner patches tests tools pretrain_gpt.py >/dev/null
