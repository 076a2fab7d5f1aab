"""Every broken input of tools/preprocess_data.py and of training's data start-up gives one clear
line (exit 2, the flag or file named): never a traceback, a hang in megatron-core's epoch count,
an allocation the file does not justify, a silently wrapped token id, or a lost previous output.

The corpus runs in ONE subprocess, each case in a forked child with its address space and CPU
time limited (entry_corpus_runner.py): preprocess_data.py's real `main`, and pretrain_gpt.py's
start-up up to its datasets (entry_corpus.data_startup, the functions training calls). Inputs are
built from the bundled prose corpus: a BPE tokenizer trained on it, and its indexed dataset."""

import json
import shutil
import struct

import numpy
import pytest

from conftest import REPO
from data.corpus import documents, preprocess_main, train_gpt2_files, train_tokenizer, write_jsonl
from foundation.entry_corpus import (
    DATA_STARTUP,
    PREPROCESS,
    Case,
    check,
    counts,
    run_corpus,
)
from runtime.plans import REFERENCE, write_plan

HEADER = b"MMIDIDX\x00\x00"
BIG_LINE_BYTES = 50 * 2**20


def read_idx(path):
    """(dtype code, lengths, pointers, document indices) of a megatron-core .idx."""
    raw = path.read_bytes()
    code = raw[17]
    count, docs = struct.unpack("<QQ", raw[18:34])
    lengths = numpy.frombuffer(raw, numpy.int32, count, 34).copy()
    pointers = numpy.frombuffer(raw, numpy.int64, count, 34 + 4 * count).copy()
    indices = numpy.frombuffer(raw, numpy.int64, docs, 34 + 12 * count).copy()
    return code, lengths, pointers, indices


def write_idx(path, code, lengths, pointers, indices, count=None, version=1, tail=b""):
    count = len(lengths) if count is None else count
    with open(path, "wb") as f:
        f.write(HEADER + struct.pack("<QB", version, code))
        f.write(struct.pack("<QQ", count, len(indices)))
        f.write(numpy.asarray(lengths, numpy.int32).tobytes())
        f.write(numpy.asarray(pointers, numpy.int64).tobytes())
        f.write(numpy.asarray(indices, numpy.int64).tobytes())
        f.write(tail)


def build_cases(tmp):
    tokenizer = train_tokenizer(tmp / "tokenizer.json", 120)
    docs = documents()
    jsonl = write_jsonl(tmp / "corpus.jsonl", docs)
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer]
    good = tmp / "good"
    assert preprocess_main(["--input", jsonl, "--output-prefix", good, "--append-eod", *tok]) == 0
    good = tmp / "good_text_document"
    one = tmp / "one"
    write_jsonl(tmp / "one.jsonl", docs[:1])
    assert preprocess_main(["--input", tmp / "one.jsonl", "--output-prefix", one, *tok]) == 0
    one = tmp / "one_text_document"
    out = tmp / "out"
    out.mkdir()
    cases = []

    def pre(name, argv, field, **kw):
        cases.append(Case(f"preprocess {name}", PREPROCESS, argv, field, **kw))

    # a failed run keeps the previous output
    previous = out / "prev_text_document"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{good}{ext}", f"{previous}{ext}")
    bad = tmp / "bad.jsonl"
    bad.write_text(jsonl.read_text() + "{not json\n")
    keep = [f"{previous}.bin", f"{previous}.idx"]
    pre(
        "bad line keeps the previous output",
        ["--input", bad, "--output-prefix", out / "prev", *tok],
        "not valid JSON",
        keep=keep,
    )
    for ext in (".bin", ".idx"):
        same = out / f"same{ext.replace('.', '-')}_text_document{ext}"
        shutil.copy(jsonl, same)
        prefix = str(same)[: -len(ext)].removesuffix("_text_document")
        pre(
            f"input is the output {ext}",
            ["--input", same, "--output-prefix", prefix, *tok],
            "--input",
            keep=[same],
            on_success="data lost",
        )
    big = tmp / "big.jsonl"
    big.write_text(json.dumps({"text": "word " * (BIG_LINE_BYTES // 5)}) + "\n")
    pre(
        "a 50 MB line",
        ["--input", big, "--output-prefix", out / "big", *tok],
        "--max-document-bytes",
    )
    wide = json.loads(tokenizer.read_text())
    wide["model"]["vocab"]["\u0436"] = 2**31  # a letter the corpus lacks: its own token
    (tmp / "wide").mkdir()
    (tmp / "wide" / "tokenizer.json").write_text(json.dumps(wide))
    write_jsonl(tmp / "wide.jsonl", ["a \u0436 b"])
    pre(
        "token id 2^31",
        [
            "--input",
            tmp / "wide.jsonl",
            "--output-prefix",
            out / "wide",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tmp / "wide" / "tokenizer.json",
        ],
        "int32",
    )
    train_gpt2_files(tmp / "gpt2")
    vocab = json.loads((tmp / "gpt2" / "vocab.json").read_text())
    first, second = list(vocab)[:2]
    for name, change in (
        ("id 2^40", {first: 2**40}),
        ("id -1", {first: -1}),
        ("duplicate id", {second: vocab[first]}),
    ):
        d = tmp / f"gpt2-{name.replace(' ', '-').replace('^', '')}"
        d.mkdir()
        (d / "vocab.json").write_text(json.dumps({**vocab, **change}))
        shutil.copy(tmp / "gpt2" / "merges.txt", d / "merges.txt")
        pre(
            f"GPT-2 vocabulary {name}",
            [
                "--input",
                jsonl,
                "--output-prefix",
                out / d.name,
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                d / "vocab.json",
                "--merge-file",
                d / "merges.txt",
            ],
            "--vocab-file",
        )

    # training's data start-up
    plan = write_plan(tmp, "one", "tiny", 1, REFERENCE)
    base = ["--hetero-plan-path", plan, "--train-iters", "3", "--lr", "1e-3", "--seed", "1"]

    def start(name, data_path, field, split="98,2,0", extra=()):
        argv = [*base, "--data-path", *data_path, "--split", split, *tok, *extra]
        cases.append(Case(f"train {name}", DATA_STARTUP, argv, field))

    evaluate = ["--eval-iters", "1", "--eval-interval", "3"]
    start("split leaves training empty", [good], "--split", split="1,100000,0")
    start("split leaves validation empty", [good], "--split", split="100000,1,0", extra=evaluate)
    start(
        "split leaves a blended prefix's training part empty",
        ["1", good, "1", one],
        "--split",
        split="1,1,0",
    )
    code, lengths, pointers, indices = read_idx(tmp / "good_text_document.idx")
    count = len(lengths)
    mid = count // 2

    def idx(name, field, **changes):
        prefix = tmp / f"idx-{name.replace(' ', '-').replace('^', '')}"
        shutil.copy(f"{good}.bin", f"{prefix}.bin")
        parts = {"code": code, "lengths": lengths, "pointers": pointers, "indices": indices}
        parts.update(changes)
        write_idx(
            f"{prefix}.idx",
            parts.pop("code"),
            parts.pop("lengths"),
            parts.pop("pointers"),
            parts.pop("indices"),
            **parts,
        )
        start(f".idx {name}", [prefix], field)

    def with_value(array, i, value):
        array = array.copy()
        array[i] = value
        return array

    idx(
        "lengths all 0",
        "no tokens",
        lengths=numpy.zeros_like(lengths),
        pointers=numpy.zeros_like(pointers),
    )
    idx("sequence count 2^40", ".idx", count=2**40)
    idx("length 2^30 in the middle", ".idx", lengths=with_value(lengths, mid, 2**30))
    idx("negative length in the middle", ".idx", lengths=with_value(lengths, mid, -5))
    idx("pointer past the .bin in the middle", ".idx", pointers=with_value(pointers, mid, 2**40))
    idx("document indices decreasing", ".idx", indices=with_value(indices, 1, count))
    idx("document indices past the end", ".idx", indices=with_value(indices, -1, count + 9))
    idx("trailing bytes", ".idx", tail=b"\x00" * 8)
    idx("version 2", ".idx", version=2)
    idx("dtype code 99", ".idx", code=99)
    truncated = tmp / "idx-truncated"
    shutil.copy(f"{good}.bin", f"{truncated}.bin")
    raw = (tmp / "good_text_document.idx").read_bytes()
    (tmp / "idx-truncated.idx").write_bytes(raw[: len(raw) - 12])
    start(".idx truncated", [truncated], ".idx")
    for weight in ("nan", "inf", "1e400"):
        start(f"blend weight {weight}", [weight, good, "1", one], "--data-path")
    start("blend weight 0", ["1", good, "0", one], "--data-path")
    return cases


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    cases = build_cases(tmp)
    results = run_corpus(
        cases,
        tmp,
        preload=["megatron_hexi.training", "megatron_hexi.data", "tokenizers"],
    )
    for c in cases:  # shown with pytest -s
        print(f"{results[c.id]['category']:>14}: {c.id}")
    print("data corpus:", counts(results, cases))
    return {c.id: c for c in cases}, results


# the case ids, known without building the inputs (for parametrize)
IDS = [
    "preprocess bad line keeps the previous output",
    "preprocess input is the output .bin",
    "preprocess input is the output .idx",
    "preprocess a 50 MB line",
    "preprocess token id 2^31",
    "preprocess GPT-2 vocabulary id 2^40",
    "preprocess GPT-2 vocabulary id -1",
    "preprocess GPT-2 vocabulary duplicate id",
    "train split leaves training empty",
    "train split leaves validation empty",
    "train split leaves a blended prefix's training part empty",
    "train .idx lengths all 0",
    "train .idx sequence count 2^40",
    "train .idx length 2^30 in the middle",
    "train .idx negative length in the middle",
    "train .idx pointer past the .bin in the middle",
    "train .idx document indices decreasing",
    "train .idx document indices past the end",
    "train .idx trailing bytes",
    "train .idx version 2",
    "train .idx dtype code 99",
    "train .idx truncated",
    "train blend weight nan",
    "train blend weight inf",
    "train blend weight 1e400",
    "train blend weight 0",
]


def test_corpus_is_complete(corpus):
    cases, _ = corpus
    assert sorted(cases) == sorted(IDS)


@pytest.mark.parametrize("case_id", IDS)
def test_broken_data_input(case_id, corpus):
    cases, results = corpus
    check(cases[case_id], results[case_id])


def test_a_new_run_replaces_the_output_and_leaves_no_temporary_file(tmp_path):
    """A successful run over a prefix replaces its .bin/.idx; a line of exactly
    --max-document-bytes (newline aside) is read, one byte more is refused in one line."""
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", 120)
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer]
    docs = documents()
    prefix = tmp_path / "out" / "c"
    for n in (3, 5):
        jsonl = write_jsonl(tmp_path / f"{n}.jsonl", docs[:n])
        assert preprocess_main(["--input", jsonl, "--output-prefix", prefix, *tok]) == 0
        _, lengths, _, _ = read_idx(tmp_path / "out" / "c_text_document.idx")
        assert len(lengths) == n
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "c_text_document.bin",
        "c_text_document.idx",
    ]
    line = json.dumps({"text": docs[0]})
    exact = tmp_path / "exact.jsonl"
    exact.write_text(line + "\n" + line)
    argv = ["--input", exact, "--output-prefix", tmp_path / "e", *tok]
    assert preprocess_main([*argv, "--max-document-bytes", len(line)]) == 0
    assert preprocess_main([*argv, "--max-document-bytes", len(line) - 1]) == 2


def test_an_empty_training_split_stops_every_rank_of_a_real_run(tmp_path):
    """pretrain_gpt.py on two ranks (forked with torchrun's environment): the split leaving
    training without a token is the same one line on each rank, and the run ends (before: an
    endless epoch count)."""
    from harness import run_ranks
    from runtime.plans import TWO_STAGES

    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", 120)
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer]
    jsonl = write_jsonl(tmp_path / "c.jsonl", documents())
    assert preprocess_main(["--input", jsonl, "--output-prefix", tmp_path / "c", *tok]) == 0
    plan = write_plan(tmp_path, "two", "tiny", 2, TWO_STAGES)
    ranks = run_ranks(
        [
            "pretrain_gpt.py",
            "--hetero-plan-path",
            plan,
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            "--data-path",
            tmp_path / "c_text_document",
            "--split",
            "1,100000,0",
            *tok,
        ],
        2,
        timeout=180,
        cwd=REPO,
    )
    for code, _, err in ranks:
        assert code == 2, err
        line = "pretrain_gpt.py: error: --split 1,100000,0: the training part of"
        assert err.count(line) == 1, err
        assert "megatron_hexi/" not in err and "Traceback" not in err, err
