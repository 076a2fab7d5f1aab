"""The three --tokenizer-type kinds (HuggingFaceTokenizer, SentencePieceTokenizer,
GPT2BPETokenizer) on real files trained on the corpus: ids and special tokens equal the reference
library's own, through tools/preprocess_data.py and a training run; bad files are one-line
errors naming the flag and the path."""

import json
import math
import shutil
from pathlib import Path

import pytest

from data.corpus import EOD, check_samples_read, documents, preprocess_main
from data.workers import train_each
from harness import run_distributed
from runtime.plans import TWO_STAGES, write_plan

KINDS = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer")
# Text outside the corpus: unseen characters, special tokens' text, runs of white space.
EXTRA = [
    "Café, naïve façade: 1234 5678!",
    f"one {EOD} two </s> three <s> four <pad>",
    "  leading and  double  spaces\tand a tab\nand a newline  ",
    "",
]


def spec(kind):
    from megatron_hexi.tokenizer import TokenizerSpec

    flags = dict(zip(kind.flags[::2], kind.flags[1::2]))
    return TokenizerSpec(
        kind.name,
        flags.get("--tokenizer-model"),
        flags.get("--vocab-file"),
        flags.get("--merge-file"),
    )


@pytest.mark.parametrize("name", KINDS)
def test_ids_and_special_tokens_are_the_reference_librarys(kinds, corpus, name):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_hexi.tokenizer import load_tokenizer

    kind = kinds[name]
    tok = load_tokenizer(spec(kind))
    got = (tok.eod, tok.bos, tok.pad, tok.vocab_size)
    assert got == (kind.eod, kind.bos, kind.pad, kind.vocab_size), got
    # The values themselves, so that the reference and this runtime cannot agree on nonsense.
    assert (
        got
        == {
            "SentencePieceTokenizer": (2, 1, -1, 120),  # </s>, <s>, no pad piece
            "GPT2BPETokenizer": (0, 0, -1, 120),  # <|endoftext|> is GPT-2's eod and bos
            "HuggingFaceTokenizer": (2, 1, 0, 110),  # </s>, <s>, pad_token <unk> from its config
        }[name]
    )
    ds = IndexedDataset(kind.prefix)
    assert len(ds) == len(corpus.docs["a"])
    for i, text in enumerate(corpus.docs["a"]):
        assert ds[i].tolist() == kind.encode(text) + [kind.eod], (name, i)
    for text in EXTRA + corpus.docs["b"]:
        assert tok.tokenize(text) == kind.encode(text), (name, text)
    assert tok.tokenize_batch(EXTRA) == [kind.encode(t) for t in EXTRA]
    first = 0
    if name == "HuggingFaceTokenizer":  # its post-processor adds a BOS, as transformers does
        assert all(ds[i][0] == kind.bos for i in range(len(ds)))
        first = 1
    assert tok.detokenize(ds[0][first:-1]) == corpus.docs["a"][0]


def test_gpt2_files_are_transformers_gpt2_tokenizer(kinds, tmp_path):
    """GPT2BPETokenizer, and a model directory holding only GPT-2's files (with added tokens),
    give transformers' GPT2Tokenizer's ids and special tokens."""
    from transformers import GPT2Tokenizer

    from megatron_hexi.tokenizer import HuggingFaceTokenizer, load_tokenizer

    kind = kinds["GPT2BPETokenizer"]
    files = spec(kind)
    directory = tmp_path / "gpt2-model"
    directory.mkdir()
    shutil.copy(files.vocab_file, directory / "vocab.json")
    shutil.copy(files.merge_file, directory / "merges.txt")
    texts = EXTRA + documents() + ["x<pad>y <sep> z"]

    plain = load_tokenizer(files)
    reference = GPT2Tokenizer.from_pretrained(str(directory))
    assert all(plain.tokenize(t) == reference(t).input_ids for t in texts)
    assert (plain.eod, plain.bos) == (reference.eos_token_id, reference.bos_token_id)

    (directory / "added_tokens.json").write_text(json.dumps({"<pad>": 120, "<sep>": 121}))
    (directory / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    reference = GPT2Tokenizer.from_pretrained(str(directory))
    tok = HuggingFaceTokenizer(directory)
    assert all(tok.tokenize(t) == reference(t).input_ids for t in texts)
    got = (tok.eod, tok.bos, tok.pad, tok.vocab_size)
    assert got == (
        reference.eos_token_id,
        reference.bos_token_id,
        reference.pad_token_id,
        len(reference),
    )
    assert got == (0, 0, 120, 122)


def test_training_on_each_kind(kinds, tmp_path):
    """One 2-rank launch (a 2-stage pipeline) trains 2 iterations on corpus "a" as each kind
    preprocessed it: every sample is the reference library's ids of corpus documents."""
    plan = write_plan(
        tmp_path,
        "two",
        "tiny",
        2,
        TWO_STAGES,
    )
    runs = {
        name: [
            "--data-path",
            kind.prefix,
            "--split",
            "98,2,0",
            "--tokenizer-type",
            name,
            *kind.flags,
            "--train-iters",
            "2",
            "--data-cache-path",
            str(tmp_path / "cache"),
        ]
        for name, kind in kinds.items()
    }

    results = run_distributed(train_each, 2, plan, runs, timeout=300)[0]
    docs = documents()
    for name, kind in kinds.items():
        result = results[name]
        assert len(result["losses"]) == 2 and all(map(math.isfinite, result["losses"])), name
        first = result["ranks"][0]
        assert first["embedding"] and sorted(first["read"]) == [0, 1], name
        bos = kind.bos if name == "HuggingFaceTokenizer" else None
        check_samples_read(name, first, docs, kind.encode, kind.eod, bos)


def _errors(d, tmp):
    """{case: (tokenizer flags, the one error line expected)} over the kinds' files."""
    sp_model = d / "tokenizer.model"
    vocab, merges = d / "gpt2/vocab.json", d / "gpt2/merges.txt"
    hf_json = d / "hf/tokenizer.json"
    only_sp = tmp / "llama-slow"
    only_sp.mkdir()
    shutil.copy(sp_model, only_sp / "tokenizer.model")
    foreign = tmp / "foreign-merges.txt"
    foreign.write_text("#version: 0.2\nzz qq\n")
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer"]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    return {
        "json as sentencepiece": (
            [*sp, hf_json],
            f"--tokenizer-model {hf_json}: not a SentencePiece model",
        ),
        "sentencepiece directory without model": (
            [*sp, d / "gpt2"],
            f"--tokenizer-model {d / 'gpt2'}: directory has no tokenizer.model",
        ),
        "missing merges file": (
            [*gpt2, "--vocab-file", vocab, "--merge-file", tmp / "merges.txt"],
            f"--merge-file {tmp / 'merges.txt'}: no such file",
        ),
        "no merges flag": (
            [*gpt2, "--vocab-file", vocab],
            "--tokenizer-type GPT2BPETokenizer needs --merge-file",
        ),
        "files swapped": (
            [*gpt2, "--vocab-file", merges, "--merge-file", vocab],
            f"--vocab-file {merges}: not a GPT-2 vocab.json",
        ),
        "merges of another vocabulary": (
            [*gpt2, "--vocab-file", vocab, "--merge-file", foreign],
            f"--merge-file {foreign}: a merge uses a token that --vocab-file {vocab} does not hold",
        ),
        "model directory with only tokenizer.model": (
            [*hf, only_sp],
            f"--tokenizer-model {only_sp}: directory has no tokenizer.json, only a "
            f"SentencePiece tokenizer.model: use --tokenizer-type SentencePieceTokenizer "
            f"--tokenizer-model {only_sp / 'tokenizer.model'}",
        ),
        "sentencepiece as json": (
            [*hf, sp_model],
            f"--tokenizer-model {sp_model}: not a Hugging Face tokenizers file",
        ),
        "flag the type does not read": (
            [*hf, d / "hf", "--merge-file", merges],
            "--tokenizer-type HuggingFaceTokenizer reads --tokenizer-model, not --merge-file",
        ),
    }


ERROR_CASES = [
    "json as sentencepiece",
    "sentencepiece directory without model",
    "missing merges file",
    "no merges flag",
    "files swapped",
    "merges of another vocabulary",
    "model directory with only tokenizer.model",
    "sentencepiece as json",
    "flag the type does not read",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_wrong_tokenizer_files_are_one_line(kinds, corpus, capsys, tmp_path, case):
    d = Path(spec(kinds["SentencePieceTokenizer"]).tokenizer_model).parent
    flags, message = _errors(d, tmp_path)[case]
    code = preprocess_main(
        ["--input", corpus.jsonl["a"], "--output-prefix", tmp_path / "out", *flags, "--append-eod"]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"preprocess_data.py: error: {message}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not list(tmp_path.glob("out*")), "output left behind"


def test_training_reads_the_same_errors(kinds):
    """Training builds its tokenizer with the same checks: a wrong file is a SpecError, and a
    vocabulary too large for the plan names the flags of its files."""
    from megatron_hexi.config import DataConfig
    from megatron_hexi.tokenizer import build_tokenizer, check_vocab_fits
    from planner.errors import SpecError

    gpt2, sp = spec(kinds["GPT2BPETokenizer"]), spec(kinds["SentencePieceTokenizer"])
    data = DataConfig(
        data_path=(kinds["GPT2BPETokenizer"].prefix,),
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=gpt2.vocab_file,
    )
    with pytest.raises(SpecError, match=rf"--tokenizer-model {gpt2.vocab_file}: not a Sentence"):
        build_tokenizer(data)
    tok = build_tokenizer(
        DataConfig(
            data_path=("x",),
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=gpt2.vocab_file,
            merge_file=gpt2.merge_file,
        )
    )
    with pytest.raises(
        SpecError,
        match=rf"--vocab-file {gpt2.vocab_file} --merge-file {gpt2.merge_file}: the tokenizer's "
        rf"vocabulary \(120 tokens\) does not fit the plan's model vocab_size 100",
    ):
        check_vocab_fits(tok, 100)
    assert build_tokenizer(DataConfig(mock_data=True, tokenizer_model=sp.tokenizer_model)) is None
