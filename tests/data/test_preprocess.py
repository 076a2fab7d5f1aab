"""tools/preprocess_data.py: JSONL -> megatron-core indexed dataset with a tokenizers file."""

import json

import numpy
import pytest

from data.corpus import preprocess_main


def test_indexed_dataset_holds_each_document_with_eod(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_hexi.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(corpus.tokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (120, 0, 1)
    for key in "ab":
        ds = IndexedDataset(corpus.prefix[key])
        assert ds.index.dtype == numpy.uint16  # Megatron's choice under 65,500 tokens
        assert len(ds) == len(corpus.docs[key])
        for i, text in enumerate(corpus.docs[key]):
            assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
    ds = IndexedDataset(corpus.prefix["a"])  # keep it: its __del__ closes the mmap
    assert tok.detokenize(ds[0][:-1]).startswith("the morning")


def _run(capsys, tmp_path, input_path, *extra, tokenizer=None, corpus=None):
    code = preprocess_main(
        [
            "--input",
            input_path,
            "--output-prefix",
            tmp_path / "out",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tokenizer or corpus.tokenizer,
            "--append-eod",
            *extra,
        ]
    )
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "lines, message, workers",
    [
        (['{"text": "fine"}', '{"text": broken}'], "bad.jsonl:2: not valid JSON", "1"),
        (['{"text": "fine"}', '{"text": broken}'], "bad.jsonl:2: not valid JSON", "2"),
        (
            ['{"text": "fine"}', '', '{"body": "x"}'],
            "bad.jsonl:3: missing key 'text' (keys present: 'body'; see --json-keys)",
            "1",
        ),
        (['{"text": 3}'], "bad.jsonl:1: key 'text' is int, expected a string", "1"),
        (['["text"]'], "bad.jsonl:1: expected a JSON object, got list", "1"),
    ],
)
def test_bad_input_is_one_line_with_line_number(corpus, capsys, tmp_path, lines, message, workers):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    code, err = _run(capsys, tmp_path, bad, "--workers", workers, corpus=corpus)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("out*")), "partial output left behind"


@pytest.mark.parametrize(
    "content, line, workers",
    [
        (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', 2, "1"),  # Latin-1
        (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', 2, "2"),
        ('{"text": "fine"}\n'.encode("utf-16"), 1, "1"),  # UTF-16 with its BOM
    ],
)
def test_non_utf8_input_is_one_line_with_line_number(
    corpus, capsys, tmp_path, content, line, workers
):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    code, err = _run(capsys, tmp_path, bad, "--workers", workers, corpus=corpus)
    assert code == 2 and f"bad.jsonl:{line}: not UTF-8 text" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not list(tmp_path.glob("out*")), "partial output left behind"


def test_missing_files(corpus, capsys, tmp_path):
    code, err = _run(capsys, tmp_path, tmp_path / "none.jsonl", corpus=corpus)
    assert code == 2 and f"--input {tmp_path / 'none.jsonl'}: no such file" in err, err
    code, err = _run(capsys, tmp_path, corpus.jsonl["a"], tokenizer=tmp_path, corpus=corpus)
    assert code == 2 and "directory has no tokenizer.json" in err, err
    code, err = _run(
        capsys, tmp_path, corpus.jsonl["a"], tokenizer=tmp_path / "t.json", corpus=corpus
    )
    assert code == 2 and "t.json: no such file or directory" in err, err
    (tmp_path / "junk.json").write_text("{}")
    code, err = _run(
        capsys, tmp_path, corpus.jsonl["a"], tokenizer=tmp_path / "junk.json", corpus=corpus
    )
    assert code == 2 and "not a Hugging Face tokenizers file" in err, err


def test_several_keys_and_tokenizer_directory(corpus, capsys, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path = tmp_path / "two.jsonl"
    path.write_text(
        "".join(json.dumps({"text": d, "title": d[:20]}) + "\n" for d in corpus.docs["a"][:5])
    )
    code, err = _run(
        capsys,
        tmp_path,
        path,
        "--json-keys",
        "text",
        "title",
        tokenizer=corpus.tokenizer.parent,
        corpus=corpus,
    )
    assert code == 0, err
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 5
    assert len(IndexedDataset(str(tmp_path / "out_title_document"))) == 5
