"""Training on real data through megatron-core's GPTDataset/BlendedDataset.

A heterogeneous plan trained 3 steps on a weighted blend of two preprocessed corpora, with a
split, gives the one-rank run's losses and grad norms (1e-5), and each pipeline reads exactly its
sample range of every global batch. The split, the blend and the errors are checked directly.
"""

import collections

import pytest

from conftest import REPO
from data.commands import flags
from data.workers import train_real
from harness import run_distributed, run_ranks
from runtime.plans import PLANS, REFERENCE, TWO_STAGES, write_plan
from runtime.workers import max_relative_difference

TOLERANCE = 1e-5


def dataset(corpus, tmp_path, *data_path, split="98,2,0", tokenizer=None, model="tiny"):
    """build_train_dataset in this process (no process group: no blend cache), for 3 steps."""
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.data import build_train_dataset
    from megatron_hexi.tokenizer import build_tokenizer
    from planner.plan import load_plan

    path = write_plan(tmp_path, "one", model, 1, REFERENCE)
    args = parse_args(
        [
            "--hetero-plan-path",
            str(path),
            "--train-iters",
            "3",
            "--lr",
            "1e-3",
            "--seed",
            "1234",
            *flags(corpus, *data_path, split=split, tokenizer=tokenizer),
        ]
    )
    config = run_config(args)
    return build_train_dataset(
        config.data,
        load_plan(path),
        train_iters=config.training.train_iters,
        seed=config.training.seed,
        tokenizer=build_tokenizer(config.data),
    )


class Sources:
    """Which corpus (and which of its documents) a sample's text comes from."""

    def __init__(self, corpus):
        from megatron_hexi.tokenizer import HuggingFaceTokenizer

        tok = HuggingFaceTokenizer(corpus.tokenizer)
        self.eod = tok.eod
        self.docs = {
            k: ["," + ",".join(map(str, tok.tokenize(d))) + "," for d in docs]
            for k, docs in corpus.docs.items()
        }

    def origins(self, sample):
        """For each run of >= 8 tokens between EODs: the {(corpus, document)} holding it."""
        ids = sample["tokens"].tolist() + sample["labels"].tolist()[-1:]
        pieces, cur = [], []
        for t in ids + [self.eod]:
            if t == self.eod:
                pieces.append(cur)
                cur = []
            else:
                cur.append(t)
        found = []
        for piece in pieces:
            if len(piece) < 8:
                continue
            needle = "," + ",".join(map(str, piece)) + ","
            hits = {
                (k, i) for k, docs in self.docs.items() for i, d in enumerate(docs) if needle in d
            }
            assert hits, f"sample text {piece} is in no document"
            found.append(hits)
        return found


def test_split_takes_its_documents(corpus, tmp_path):
    ds = dataset(corpus, tmp_path, corpus.prefix["a"], split="50,50,0")
    assert type(ds).__name__ == "GPTDataset"
    n = len(corpus.docs["a"])
    sources = Sources(corpus)
    half = round(n / 2)
    unique = set()
    for i in range(len(ds)):
        for hits in sources.origins(ds[i]):
            assert any(k == "a" and d < half for k, d in hits), hits
            if len(hits) == 1:
                unique |= hits
    assert unique == {("a", d) for d in range(half)}, "one epoch of the first half"


def test_weighted_blend(corpus, tmp_path):
    ds = dataset(corpus, tmp_path, 0.25, corpus.prefix["a"], 0.75, corpus.prefix["b"])
    assert type(ds).__name__ == "BlendedDataset" and len(ds) >= 24
    sources = Sources(corpus)
    counts = collections.Counter()
    for i in range(24):
        origins = sources.origins(ds[i])
        corpora = [
            k for k in "ab" if origins and all(any(c == k for c, _ in hits) for hits in origins)
        ]
        assert len(corpora) == 1, f"sample {i}: text from {corpora or 'both'} corpora"
        counts[corpora[0]] += 1
    assert counts == {"a": 6, "b": 18}, counts
    # Unweighted prefixes: blended in proportion to their sizes (Megatron's rule).
    ds = dataset(corpus, tmp_path, corpus.prefix["a"], corpus.prefix["b"])
    assert type(ds).__name__ == "BlendedDataset"


def test_data_errors(corpus, tmp_path):
    from planner.errors import SpecError

    with pytest.raises(
        SpecError,
        match=r"the tokenizer's vocabulary \(200 tokens\) does not fit "
        r"the plan's model vocab_size 128",
    ):
        dataset(corpus, tmp_path, corpus.prefix["a"], tokenizer=corpus.big_tokenizer)
    raw = str(corpus.dir / "a")
    with pytest.raises(
        SpecError,
        match=rf"--data-path {raw}: {raw}.bin and {raw}.idx not found; "
        rf"did you mean {raw}_text_document",
    ):
        dataset(corpus, tmp_path, raw)
    with pytest.raises(
        SpecError,
        match=r"nowhere.bin and .*nowhere.idx not found \(make it with "
        r"tools/preprocess_data.py\)",
    ):
        dataset(corpus, tmp_path, 1, corpus.prefix["a"], 1, tmp_path / "nowhere")
    with pytest.raises(SpecError, match=r"--split 0,1,0 leaves no documents for training"):
        dataset(corpus, tmp_path, corpus.prefix["a"], split="0,1,0")
    with pytest.raises(SpecError, match=r"give either prefixes only or 'weight prefix' pairs"):
        dataset(corpus, tmp_path, 1, corpus.prefix["a"], corpus.prefix["b"], corpus.prefix["a"])
    with pytest.raises(SpecError, match=r"give either prefixes only or 'weight prefix' pairs"):
        dataset(corpus, tmp_path, 1, corpus.prefix["a"], corpus.prefix["b"])
    with pytest.raises(SpecError, match=r"--split 'abc': give up to three non-negative weights"):
        dataset(corpus, tmp_path, corpus.prefix["a"], split="abc")
    # A .bin cut short (a copy interrupted, a full disk): refused before megatron-core reads it.
    import shutil

    cut = tmp_path / "cut"
    shutil.copy(corpus.prefix["a"] + ".idx", str(cut) + ".idx")
    data = open(corpus.prefix["a"] + ".bin", "rb").read()
    (tmp_path / "cut.bin").write_bytes(data[: len(data) - 3])
    with pytest.raises(
        SpecError,
        match=rf"--data-path {cut}: {cut}.bin has {len(data) - 3} "
        rf"bytes, its .idx needs {len(data)} \(truncated",
    ):
        dataset(corpus, tmp_path, cut)


def test_vocab_too_large_fails_on_every_rank(corpus, tmp_path):
    path = write_plan(
        tmp_path,
        "two",
        "tiny",
        2,
        TWO_STAGES,
    )
    # Both ranks as plain processes with torchrun's environment (harness.run_ranks): each rank's
    # own exit code and error, whatever the other does.
    ranks = run_ranks(
        [
            "pretrain_gpt.py",
            "--hetero-plan-path",
            path,
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            *flags(corpus, corpus.prefix["a"], tokenizer=corpus.big_tokenizer),
        ],
        2,
        timeout=120,
        cwd=REPO,
    )
    for code, _, err in ranks:
        assert code == 2, err
        assert err.count("pretrain_gpt.py: error: --tokenizer-model") == 1, err
        assert "does not fit the plan's model vocab_size 128" in err, err
        # one line, no traceback from the runtime
        assert "megatron_hexi/" not in err and "Traceback" not in err, err


def test_heterogeneous_plan_on_real_data(corpus, tmp_path):
    """two_pipelines_uneven_tp2 on 0.3 a + 0.7 b (split 98,2,0) equals the one-rank run, and each
    pipeline reads exactly its samples of every global batch."""
    import torch

    data = flags(corpus, 0.3, corpus.prefix["a"], 0.7, corpus.prefix["b"]) + [
        "--data-cache-path",
        str(tmp_path / "cache"),
    ]
    ref_plan = write_plan(tmp_path, "one", "tiny", 1, REFERENCE)
    ref = run_distributed(train_real, 1, ref_plan, data, timeout=240)[0]
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    het = run_distributed(
        train_real, world, write_plan(tmp_path, "het", model, world, pipelines), data, timeout=400
    )[0]

    loss = max(max_relative_difference(a, b) for a, b in zip(het["losses"], ref["losses"]))
    norm = max(max_relative_difference(a, b) for a, b in zip(het["grad_norms"], ref["grad_norms"]))
    print(
        f"real data: losses {ref['losses']}, max relative difference loss {loss:.2e}, "
        f"grad norm {norm:.2e}"
    )
    assert loss < TOLERANCE and norm < TOLERANCE
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3

    # Global batch i of the one-rank run is samples [8i, 8i + 8) of the dataset.
    ds = dataset(corpus, tmp_path, 0.3, corpus.prefix["a"], 0.7, corpus.prefix["b"])
    glob = ref["ranks"][0]["read"]
    for it in range(3):
        assert torch.equal(glob[it][0], torch.stack([ds[8 * it + k]["tokens"] for k in range(8)]))
    # Each pipeline's first and last stage read exactly its range of every global batch.
    readers = collections.defaultdict(set)
    for r in het["ranks"].values():
        if not (r["embedding"] or r["output"]):
            assert not r["read"], f"rank {r['plan_rank']} holds neither end but read data"
            continue
        start, end = r["samples"]
        readers[r["pipeline"]].add((r["embedding"], r["output"]) if r["read"] else None)
        assert sorted(r["read"]) == [0, 1, 2]
        for it, (tokens, labels) in r["read"].items():
            assert torch.equal(tokens, glob[it][0][start:end]), (r["plan_rank"], it)
            assert torch.equal(labels, glob[it][1][start:end]), (r["plan_rank"], it)
    ranges = sorted({r["samples"] for r in het["ranks"].values()})
    assert ranges == [(0, 6), (6, 8)], ranges  # the pipelines cover each batch once
    assert all(any(e for e, _ in v) and any(o for _, o in v) for v in readers.values())
