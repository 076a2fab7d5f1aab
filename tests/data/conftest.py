"""Session data for tests/data: tokenizers trained on the bundled corpus, and corpora "a" and "b"
as JSONL and as indexed datasets (a through the preprocess_data.py command line with 2 workers,
b through its main() in this process)."""

import subprocess
import sys
import types

import pytest

from data.corpus import documents, preprocess_main, train_tokenizer, write_jsonl


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
    r = subprocess.run(
        [
            sys.executable,
            str(repo_root / "tools/preprocess_data.py"),
            "--input",
            str(c.jsonl["a"]),
            "--output-prefix",
            str(d / "a"),
            "--workers",
            "2",
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert r.returncode == 0, r.stderr
    assert f"wrote {d / 'a'}_text_document.bin/.idx: {len(c.docs['a'])} documents" in r.stdout
    assert (
        preprocess_main(["--input", str(c.jsonl["b"]), "--output-prefix", str(d / "b"), *common])
        == 0
    )
    c.prefix = {k: str(d / f"{k}_text_document") for k in "ab"}
    return c
