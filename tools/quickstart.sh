#!/usr/bin/env bash
# Quick start: set up, plan a small heterogeneous cluster, train a tiny GPT on CPU under the plan.
#   bash tools/quickstart.sh
# Each GPU of the plan is emulated by one CPU process (gloo) when CUDA is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
PY=.venv/bin/python
OUT=${HEXI_QUICKSTART_DIR:-runs/quickstart}
mkdir -p "$OUT"

echo "== plan: tiny GPT on examples/clusters/mini-hetero.yaml (2x A100, 1x RTX 4090, 1x RTX 3090)"
.venv/bin/hexi-plan plan --cluster examples/clusters/mini-hetero.yaml --model tiny \
    --global-batch-size 8 -o "$OUT/plan.json"
.venv/bin/hexi-plan show "$OUT/plan.json"
WORLD=$($PY -c "import json,sys; print(len(json.load(open(sys.argv[1]))['ranks']))" "$OUT/plan.json")

echo "== train: $WORLD CPU processes, 10 iterations"
$PY -m torch.distributed.run --nproc-per-node "$WORLD" --master-port "${MASTER_PORT:-29531}" \
    pretrain_gpt.py --hetero-plan-path "$OUT/plan.json" --hetero-metrics-path "$OUT/metrics.jsonl" \
    --mock-data --train-iters 10 --lr 1e-3 --lr-decay-style constant --seed 1234 \
    --attention-dropout 0 --hidden-dropout 0

echo "== loss curve ($OUT/metrics.jsonl)"
$PY - "$OUT/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"iteration {r['iteration']:>3}  lm loss {r['lm_loss']:.6f}  grad norm {r['grad_norm']:.4f}"
          f"  {r['tokens_per_s']:8.1f} tokens/s")
PYEOF

echo "== next: \`source .venv/bin/activate\` puts hexi-plan, hexi-launch, hexi-train and torchrun on"
echo "   this shell's PATH for the rest of README.md (or call them as .venv/bin/hexi-plan ...)"
