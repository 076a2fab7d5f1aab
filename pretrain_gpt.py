"""Pretrain a GPT under a heterogeneous plan (Megatron-LM's entry point name and flags).

    torchrun --nproc-per-node 4 pretrain_gpt.py --hetero-plan-path plan.json --mock-data \
        --train-iters 3 --lr 1e-3 --lr-decay-style constant
"""

from megatron_hexi.entry import cli

if __name__ == "__main__":
    cli()
