"""Job launchers generated from a plan: `hexi-launch slurm` (sbatch script) and `hexi-launch
torchrun` (per-node commands). Plain Python, no torch import: generating a script is instant.
"""
