"""Session data for tests/data: tokenizers trained on the bundled corpus, and corpora "a" and "b"
as JSONL and as indexed datasets (a through the preprocess_data.py command line with 2 workers,
b through its main() in this process); and corpus "a" preprocessed with one tokenizer of each
--tokenizer-type kind (`kinds`). The commands fork from the harness's forkserver."""

import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from data.corpus import (
    EOD,
    documents,
    preprocess_main,
    save_hf_directory,
    train_gpt2_files,
    train_sentencepiece,
    train_tokenizer,
    write_jsonl,
)
from harness import _finish_scripts, _start_scripts, run_script


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, repo_root):
    d = tmp_path_factory.mktemp("corpus")
    docs = documents()
    half = len(docs) // 2
    c = types.SimpleNamespace(dir=d, docs={"a": docs[:half], "b": docs[half:]})
    c.tokenizer = train_tokenizer(d / "tokenizer.json", 120)  # fits tiny's 128
    (d / "big").mkdir()
    c.big_tokenizer = train_tokenizer(d / "big" / "tokenizer.json", 200)  # does not
    c.jsonl = {k: write_jsonl(d / f"{k}.jsonl", v) for k, v in c.docs.items()}
    common = [
        "--json-keys",
        "text",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(c.tokenizer),
        "--append-eod",
    ]
    code, out, err = run_script(
        [
            repo_root / "tools/preprocess_data.py",
            "--input",
            c.jsonl["a"],
            "--output-prefix",
            d / "a",
            "--workers",
            "2",
            *common,
        ],
        timeout=120,
        cwd=repo_root,
    )
    assert code == 0, err
    assert f"wrote {d / 'a'}_text_document.bin/.idx: {len(c.docs['a'])} documents" in out
    assert (
        preprocess_main(["--input", str(c.jsonl["b"]), "--output-prefix", str(d / "b"), *common])
        == 0
    )
    c.prefix = {k: str(d / f"{k}_text_document") for k in "ab"}
    return c


@dataclass
class TokenizerKind:
    """One --tokenizer-type with its files, the reference library's ids and special tokens, and
    corpus "a" preprocessed with it."""

    name: str
    flags: list[str]  # the tokenizer flags, as preprocess_data.py and training take them
    encode: Callable[[str], list[int]]  # the reference library's own encoding
    eod: int
    bos: int
    pad: int  # -1: none
    vocab_size: int
    prefix: str = ""


@pytest.fixture(scope="session")
def kinds(corpus, tmp_path_factory, repo_root):
    """{--tokenizer-type: TokenizerKind}; the three preprocess_data.py commands run at once."""
    d = tmp_path_factory.mktemp("kinds")
    sp = train_sentencepiece(d / "tokenizer.model")
    gpt2 = train_gpt2_files(d / "gpt2")
    hf = save_hf_directory(d / "hf")
    found = {
        "SentencePieceTokenizer": TokenizerKind(
            "SentencePieceTokenizer",
            ["--tokenizer-model", str(d / "tokenizer.model")],
            sp.encode,
            sp.eos_id(),
            sp.bos_id(),
            sp.pad_id(),
            sp.get_piece_size(),
        ),
        "GPT2BPETokenizer": TokenizerKind(
            "GPT2BPETokenizer",
            [
                "--vocab-file",
                str(d / "gpt2/vocab.json"),
                "--merge-file",
                str(d / "gpt2/merges.txt"),
            ],
            lambda text: gpt2.encode(text).ids,
            gpt2.token_to_id(EOD),
            gpt2.token_to_id(EOD),  # GPT-2's bos is its end of text
            -1,
            gpt2.get_vocab_size(),
        ),
        "HuggingFaceTokenizer": TokenizerKind(
            "HuggingFaceTokenizer",
            ["--tokenizer-model", str(d / "hf")],  # the directory save_pretrained wrote
            lambda text: hf(text).input_ids,
            hf.eos_token_id,
            hf.bos_token_id,
            hf.pad_token_id,
            len(hf),
        ),
    }
    # The three preprocess_data.py commands at once, forked from the harness's forkserver (torch
    # and megatron-core already imported there).
    names = list(found)
    argvs = []
    for name in names:
        kind = found[name]
        kind.prefix = str(d / f"{name}_text_document")
        argvs.append(
            [
                repo_root / "tools/preprocess_data.py",
                "--input",
                corpus.jsonl["a"],
                "--output-prefix",
                d / name,
                "--tokenizer-type",
                name,
                *kind.flags,
                "--append-eod",
                "--workers",
                "2" if name == "SentencePieceTokenizer" else "1",
            ]
        )
    procs, files, folder = _start_scripts(argvs, [{}] * len(argvs), repo_root)
    results = _finish_scripts(argvs, procs, files, folder, timeout=180)
    for name, (code, out, err) in zip(names, results):
        assert code == 0, f"{name}: {err}"
        assert f"wrote {found[name].prefix}.bin/.idx: {len(corpus.docs['a'])} documents" in out
    return found
