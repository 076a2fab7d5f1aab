"""Islands (DiLoCo) against synchronous training: validation loss at equal tokens, and the bytes
that cross islands per token, trained by the runtime on a real corpus.

    python tools/bench/islands_convergence.py [--iters 256] [--runs H:M ...] [--json F]

The corpus is real English prose that every Python installation carries: the documentation
topics of `pydoc_data.topics` (about 420,000 characters; the count depends on the Python
version), cut into paragraphs, 1 in 20 held out for validation. A BPE tokenizer of 2,048 tokens
is trained on it, and tools/preprocess_data.py writes the indexed dataset. The model is a 4-layer
GPT (hidden 128, FFN 512, 4 heads, sequence 128); inner AdamW at lr 1e-3 after 16 warm-up
steps, clipping 1.0, no dropout.

Each row trains the same pipelines for the same number of steps (equal tokens: the global batch
is the same) from the same initial weights and samples, then evaluates the validation loss over
the same 8 global batches. Step counts are multiples of every H, so at the end every island
holds the outer parameters and the validation loss is that of one model.
- two islands: a tensor-parallel stage with uneven shards (3:1 query groups and FFN) beside a
  two-stage pipeline (4 ranks);
- three islands: the same two pipelines and a one-rank pipeline (5 ranks).
For each shape: the synchronous plan (one island), and islands at each H with DiLoCo's outer
Nesterov (lr 0.7, momentum 0.9) and with momentum 0.5. `cross-island bytes per token` sums the
runtime's `outer_sync_bytes` over ranks and steps; the synchronous plan's figure is the same
exchange at every step (planner.outer_traffic at H = 1), the traffic its gradient sync sends
between the same pipelines.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

MODEL = {
    "num_layers": 4,
    "hidden_size": 128,
    "ffn_hidden_size": 512,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "vocab_size": 2048,
    "seq_length": 128,
    "name": "bench-islands",
}
GLOBAL_BATCH = 8
EVAL_BATCHES = 8
VALID_EVERY = 20  # one paragraph in this many is held out
TP_UNEVEN = {
    "ranks": [0, 1],
    "layers": [0, 4],
    "shards": {"query_groups": [3, 1], "ffn": [384, 128]},
}
TWO_STAGE = [{"ranks": [2], "layers": [0, 2]}, {"ranks": [3], "layers": [2, 4]}]
SHAPES = {
    2: [
        {"micro_batch_size": 2, "num_microbatches": 2, "stages": [TP_UNEVEN]},
        {"micro_batch_size": 1, "num_microbatches": 4, "stages": TWO_STAGE},
    ],
    3: [
        {"micro_batch_size": 1, "num_microbatches": 3, "stages": [TP_UNEVEN]},
        {"micro_batch_size": 1, "num_microbatches": 3, "stages": TWO_STAGE},
        {
            "micro_batch_size": 2,
            "num_microbatches": 1,
            "stages": [{"ranks": [4], "layers": [0, 4]}],
        },
    ],
}
CLUSTER = {
    "name": "bench-islands",
    "nodes": [
        {
            "name": "a100",
            "gpu": "A100-SXM-80GB",
            "gpus_per_node": 2,
            "intra_node": "nvlink",
            "nic": "100 Gbit/s",
        },
        {
            "name": "rtx4090",
            "gpu": "RTX-4090",
            "gpus_per_node": 2,
            "intra_node": "host",
            "nic": "10 Gbit/s",
        },
        {
            "name": "rtx3090",
            "gpu": "RTX-3090",
            "gpus_per_node": 1,
            "intra_node": "host",
            "nic": "10 Gbit/s",
        },
    ],
}


def corpus_documents():
    """Paragraphs of Python's documentation topics: real prose with code, a few hundred KB."""
    import pydoc_data.topics

    docs = []
    for name in sorted(pydoc_data.topics.topics):
        for para in re.split(r"\n\s*\n", pydoc_data.topics.topics[name]):
            text = " ".join(para.split())
            if len(text) >= 40:
                docs.append(text)
    return docs


def write_dataset(folder):
    """(data prefix, tokenizer.json) of the corpus, training and validation in separate files."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    docs = corpus_documents()
    train = [d for i, d in enumerate(docs) if i % VALID_EVERY]
    valid = [d for i, d in enumerate(docs) if i % VALID_EVERY == 0]
    tok = Tokenizer(models.BPE(unk_token="<unk>", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL["vocab_size"],
        special_tokens=["<|endoftext|>", "<pad>", "<unk>"],
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(train, trainer)
    tok_path = folder / "tokenizer.json"
    tok.save(str(tok_path))
    prefixes = {}
    for split, part in (("train", train), ("valid", valid)):
        jsonl = folder / f"{split}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "tools/preprocess_data.py"),
                "--input",
                str(jsonl),
                "--output-prefix",
                str(folder / split),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(tok_path),
                "--append-eod",
                "--workers",
                "1",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        prefixes[split] = str(folder / f"{split}_text_document")
    return prefixes, str(tok_path), sum(len(d) for d in docs)


def run_config(iters, prefixes, tokenizer):
    from megatron_hexi.config import (
        DataConfig,
        DropoutConfig,
        EvaluationConfig,
        LRScheduleConfig,
        OptimizerConfig,
        RunConfig,
        TrainingConfig,
    )

    return RunConfig(
        training=TrainingConfig(train_iters=iters, seed=1234),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0),
        evaluation=EvaluationConfig(eval_iters=EVAL_BATCHES),
        lr_schedule=LRScheduleConfig(lr_decay_style="constant", lr_warmup_iters=16),
        dropout=DropoutConfig(attention_dropout=0.0, hidden_dropout=0.0),
        data=DataConfig(
            data_path=(prefixes["train"],),
            split="100,0,0",
            valid_data_path=(prefixes["valid"],),
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=tokenizer,
        ),
    )


def train_rank(plan, iters, prefixes, tokenizer):
    """Train `iters` steps, then evaluate; returns (validation loss, bytes this rank sent
    across islands, tokens per step) on every rank."""
    from megatron_hexi.training import Trainer, init_distributed

    config = run_config(iters, prefixes, tokenizer)
    device = init_distributed(plan, config)
    trainer = Trainer(plan, config, device)
    sent, tokens = 0, 0
    for it in range(iters):
        m = trainer.train_step(it)
        tokens = m["tokens"]
        if m.get("outer_step") not in (None, False):
            sent += m["outer_sync_bytes"][trainer.rank]
    ev = trainer.evaluate(0)
    return {"valid_loss": ev.lm_loss, "sent": sent, "tokens_per_step": tokens}


def make_plan(islands, pipelines, interval, momentum):
    from planner.cluster import load_cluster_dict
    from planner.islands import OuterSettings
    from planner.models import model_from_dict
    from planner.plan import build_plan

    outer = None
    groups = ()
    if interval:
        outer = OuterSettings(interval=interval, momentum=momentum)  # the plan's defaults
        groups = tuple((p,) for p in range(islands))
    return build_plan(
        load_cluster_dict(CLUSTER, "cluster"),
        model_from_dict(MODEL, "model"),
        sum(p["micro_batch_size"] * p["num_microbatches"] for p in pipelines),
        pipelines,
        islands=groups,
        outer=outer,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=256, help="steps per run (a multiple of every H)")
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["4:0.9", "4:0.5", "16:0.9", "16:0.5", "64:0.9", "64:0.5"],
        help="island runs as H:outer-momentum (each shape also trains synchronously)",
    )
    ap.add_argument("--islands", type=int, nargs="+", default=[2, 3], choices=sorted(SHAPES))
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args(argv)
    try:
        runs = [(int(h), float(m)) for h, m in (r.split(":") for r in a.runs)]
    except ValueError:
        ap.error(f"--runs: each must be H:momentum, got {a.runs}")
    bad = [h for h, _ in runs if h < 1 or a.iters % h]
    if bad:
        ap.error(f"--iters {a.iters} is not a multiple of H = {bad}")

    import islands_convergence as this
    from harness import run_distributed
    from planner.outer_traffic import outer_bytes_per_rank

    start = time.monotonic()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hexi-islands-") as tmp:
        prefixes, tokenizer, chars = write_dataset(Path(tmp))
        print(f"corpus: {chars:,} characters of pydoc_data.topics", flush=True)
        for k in a.islands:
            pipes = SHAPES[k]
            for interval, momentum in [(0, 0.0), *runs]:
                plan = make_plan(k, pipes, interval, momentum)
                t = time.monotonic()
                out = run_distributed(
                    this.train_rank,
                    plan.world_size,
                    plan,
                    a.iters,
                    prefixes,
                    tokenizer,
                    timeout=a.timeout,
                    fresh=True,
                    env={"OMP_NUM_THREADS": "1"},
                )
                tokens = out[0]["tokens_per_step"] * a.iters
                if interval:
                    sent = sum(r["sent"] for r in out)
                else:  # the synchronous sync's exchange between the same pipelines, every step
                    sync = make_plan(k, pipes, 1, 0.0)
                    sent = sum(outer_bytes_per_rank(sync)) * a.iters
                row = {
                    "islands": k,
                    "H": interval,
                    "momentum": momentum if interval else None,
                    "valid_loss": out[0]["valid_loss"],
                    "bytes_per_token": sent / tokens,
                    "seconds": time.monotonic() - t,
                }
                rows.append(row)
                print(
                    f"  {k} islands H {interval or '-':>3} momentum {momentum if interval else '-'}"
                    f": validation loss {row['valid_loss']:.4f}, "
                    f"{row['bytes_per_token']:,.0f} cross-island bytes/token "
                    f"({row['seconds']:.0f} s)",
                    flush=True,
                )
    print()
    print(
        "| islands | H | outer momentum | validation loss | vs synchronous | cross-island bytes "
        "per token | traffic vs synchronous |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["islands"] == r["islands"] and not b["H"])
        print(
            f"| {r['islands']} | {r['H'] or 'sync'} | {r['momentum'] if r['H'] else '-'} | "
            f"{r['valid_loss']:.4f} | {r['valid_loss'] / base['valid_loss']:.3f}x | "
            f"{r['bytes_per_token']:,.0f} | {base['bytes_per_token'] / r['bytes_per_token']:.0f}x "
            "less |"
            if r["H"]
            else f"| {r['islands']} | sync | - | {r['valid_loss']:.4f} | 1.000x | "
            f"{r['bytes_per_token']:,.0f} | 1x |"
        )
    print(
        f"\n{len(rows)} runs, {time.monotonic() - start:.0f} s; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
