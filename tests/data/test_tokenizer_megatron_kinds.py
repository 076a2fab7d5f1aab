"""Llama2Tokenizer, TikTokenizer and NullTokenizer (Megatron-LM's names and flags) on files built
here from the corpus: ids equal sentencepiece's, a tiktoken Encoding's built directly and
megatron-core's own tokenizers'; each preprocesses corpus "a" and trains 2 iterations (one launch);
every refusal is one line naming the flag and the file."""

import base64
import dataclasses
import json
import math

import pytest

from data.corpus import (
    HERE,
    check_samples_read,
    documents,
    preprocess_main,
    train_sentencepiece,
    write_jsonl,
)
from data.workers import train_each
from harness import run_distributed
from runtime.plans import TWO_STAGES, write_plan

TEXTS = [
    "Café, naïve façade: 1234 5678!",
    "special text: <s> one </s> two <pad> <unk> <|x|> <SPECIAL_7>",
    "  leading and  double  spaces\tand a tab\nand a newline  \r\n\n",
    "CamelCase WORDS and 'quotes' // slashes\n",
    "",
]
SPECIALS = 8  # --tiktoken-num-special-tokens: the 7 named ones and one filler
TIK_VOCAB = 384  # --vocab-size: 8 special ids, then the file's first 376 tokens
LLAMA_FLAGS = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model"]


def _core_pattern(name):
    """megatron-core's own copy of Megatron-LM's split pattern (the reference)."""
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer

    return getattr(tiktoken_tokenizer, f"_PATTERN_TIKTOKEN_{name.upper()}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A SentencePiece model, a tiktoken vocabulary in Megatron-LM's JSON format (BPE ranks
    trained on the corpus by tiktoken's own trainer), and their references."""
    from tiktoken._educational import bpe_train

    d = tmp_path_factory.mktemp("megatron-kinds")
    sp = train_sentencepiece(d / "tokenizer.model")
    text = "\n".join(documents())
    ranks = bpe_train(text, TIK_VOCAB - SPECIALS, _core_pattern("v2"), visualise=None)
    assert sorted(ranks.values()) == list(range(TIK_VOCAB - SPECIALS))
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode(),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    (d / "vocab.json").write_text(json.dumps(entries))
    return {"dir": d, "sp": sp, "model": d / "tokenizer.model", "vocab": d / "vocab.json"}


def _encoding(files, pattern, specials):
    """The tiktoken Encoding Megatron-LM's TikTokenizer amounts to, built directly."""
    import tiktoken

    ranks = {
        base64.b64decode(e["token_bytes"]): e["rank"] + len(specials)
        for e in json.loads(files["vocab"].read_text())
    }
    return tiktoken.Encoding(
        name="reference",
        pat_str=_core_pattern(pattern),
        mergeable_ranks=ranks,
        special_tokens={t: i for i, t in enumerate(specials)},
    )


def _load(tokenizer_type, **flags):
    from megatron_hexi.tokenizer import TokenizerSpec, load_tokenizer

    return load_tokenizer(TokenizerSpec(tokenizer_type, **flags))


def test_llama2_ids_are_sentencepieces(files, corpus):
    """Megatron-LM's Llama2Tokenizer is megatron-core's SentencePiece tokenizer (sentencepiece's
    ids); --legacy-tokenizer's _Llama2Tokenizer puts the model's BOS before them."""
    from megatron.core.tokenizers import MegatronTokenizer

    sp, model = files["sp"], str(files["model"])
    core = MegatronTokenizer.from_pretrained(
        tokenizer_path=model, metadata_path={"library": "sentencepiece"}
    )
    plain = _load("Llama2Tokenizer", tokenizer_model=model)
    legacy = _load("Llama2Tokenizer", tokenizer_model=model, legacy_tokenizer=True)
    for text in TEXTS + corpus.docs["b"]:
        assert plain.tokenize(text) == sp.encode(text) == list(core.tokenize(text)), text
        assert legacy.tokenize(text) == [sp.bos_id(), *sp.encode(text)], text
    assert (plain.eod, plain.bos, plain.pad, plain.vocab_size) == (2, 1, -1, 120)
    assert (legacy.eod, legacy.bos, legacy.pad, legacy.vocab_size) == (2, 1, -1, 120)
    assert (sp.eos_id(), sp.bos_id(), sp.get_piece_size()) == (2, 1, 120)
    assert legacy.detokenize(legacy.tokenize(corpus.docs["b"][0])) == corpus.docs["b"][0]


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_ids_are_a_tiktoken_encodings(files, corpus, pattern):
    """Default (megatron-core's TikTokenTokenizer): special tokens' text is those tokens;
    --legacy-tokenizer (CustomTikTokenizer): plain text. Both against tiktoken directly, the
    default also against megatron-core's class."""
    from megatron.core.tokenizers import MegatronTokenizer

    vocab = str(files["vocab"])
    flags = dict(
        tokenizer_model=vocab,
        tiktoken_pattern=pattern,
        vocab_size=TIK_VOCAB,
        tiktoken_num_special_tokens=SPECIALS,
    )
    tok = _load("TikTokenizer", **flags)
    legacy = _load("TikTokenizer", **flags, legacy_tokenizer=True)
    named = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
    reference = _encoding(files, pattern, [*named, "<SPECIAL_7>"])
    legacy_reference = _encoding(
        files, pattern, ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, SPECIALS)]
    )
    core = MegatronTokenizer.from_pretrained(
        tokenizer_path=vocab,
        metadata_path={"library": "tiktoken"},
        pattern=pattern,
        vocab_size=TIK_VOCAB,
        num_special_tokens=SPECIALS,
    )
    texts = TEXTS + corpus.docs["b"]
    for text in texts:
        expected = reference.encode(text, allowed_special="all")
        assert tok.tokenize(text) == expected == list(core.tokenize(text)), text
        assert legacy.tokenize(text) == legacy_reference.encode_ordinary(text), text
        assert tok.detokenize(expected) == text
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    assert legacy.tokenize_batch(texts) == [legacy.tokenize(t) for t in texts]
    assert tok.tokenize(TEXTS[1]) != legacy.tokenize(TEXTS[1])  # <s>, </s>, ... in the text
    assert (tok.eod, tok.bos, tok.pad, tok.vocab_size) == (core.eod, core.bos, core.pad, 384)
    assert (tok.eod, tok.bos, tok.pad) == (2, 1, 4)
    assert (legacy.eod, legacy.bos, legacy.pad, legacy.vocab_size) == (2, 1, -1, 384)
    # Named special tokens of one's own, in one's own order (--tokenizer-special-tokens).
    own = ["<s>", "</s>", "<unk>", "<|im_start|>", "<mask>", "<pad>", "<cls>", "<sep>"]
    mine = _load("TikTokenizer", **flags, special_tokens=tuple(own))
    assert (mine.eod, mine.bos, mine.pad) == (1, 0, 5)
    own_reference = _encoding(files, pattern, own)
    for text in texts + ["a <|im_start|> b"]:
        assert mine.tokenize(text) == own_reference.encode(text, allowed_special="all")
    assert mine.tokenize("<|im_start|>") == [3]


def test_null_ids_are_megatron_cores(corpus):
    """NullTokenizer: the text's integers; vocabulary --vocab-size + 1, eod --vocab-size, as
    megatron-core's NullTokenizer (the one Megatron-LM builds)."""
    from megatron.core.tokenizers import MegatronTokenizer

    core = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=120)
    tok = _load("NullTokenizer", vocab_size=120)
    for text in ["5", "0 1 119 120", "7 7 7 007 -0", "12\n"]:
        assert tok.tokenize(text) == list(core.tokenize(text)), text
    assert tok.tokenize("0 1 119 120") == [0, 1, 119, 120]
    assert (tok.eod, tok.vocab_size, tok.bos, tok.pad) == (core.eod, core.vocab_size, None, -1)
    assert (tok.eod, tok.vocab_size) == (120, 121)
    assert tok.detokenize([3, 4, 120]) == "3 4 120"
    for text in ["1  2", " 3", "1,2"]:  # Megatron-LM's int() refuses them too
        with pytest.raises(ValueError):
            core.tokenize(text)
        with pytest.raises(ValueError, match="NullTokenizer reads integer ids separated by"):
            tok.tokenize(text)


@pytest.fixture(scope="module")
def prefixes(files, corpus, tmp_path_factory):
    """Corpus "a" preprocessed with each, in this process: {name: (flags, prefix, reference
    ids of a document, eod)}. NullTokenizer's text is the SentencePiece ids of the documents."""
    d = tmp_path_factory.mktemp("megatron-kinds-data")
    sp = files["sp"]
    ids_jsonl = write_jsonl(
        d / "ids.jsonl", [" ".join(map(str, sp.encode(t))) for t in corpus.docs["a"]]
    )
    tik = _encoding(
        files, "v2", ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<SPECIAL_7>"]
    )
    kinds = {
        "Llama2Tokenizer": (
            [*LLAMA_FLAGS, str(files["model"]), "--legacy-tokenizer"],
            corpus.jsonl["a"],
            lambda text: [sp.bos_id(), *sp.encode(text)],
            sp.eos_id(),
        ),
        "TikTokenizer": (
            [
                "--tokenizer-type",
                "TikTokenizer",
                "--tokenizer-model",
                str(files["vocab"]),
                "--tiktoken-pattern",
                "v2",
                "--vocab-size",
                str(TIK_VOCAB),
                "--tiktoken-num-special-tokens",
                str(SPECIALS),
            ],
            corpus.jsonl["a"],
            lambda text: tik.encode(text, allowed_special="all"),
            2,
        ),
        "NullTokenizer": (
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "120"],
            ids_jsonl,
            sp.encode,
            120,
        ),
    }
    out = {}
    for name, (flags, jsonl, encode, eod) in kinds.items():
        prefix = d / name
        assert (
            preprocess_main(["--input", jsonl, "--output-prefix", prefix, *flags, "--append-eod"])
            == 0
        ), name
        out[name] = (flags, f"{prefix}_text_document", encode, eod)
    return out


def test_preprocessed_documents_are_the_references(prefixes, corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for name, (_, prefix, encode, eod) in prefixes.items():
        ds = IndexedDataset(prefix)
        assert len(ds) == len(corpus.docs["a"]), name
        for i, text in enumerate(corpus.docs["a"]):
            assert ds[i].tolist() == encode(text) + [eod], (name, i)
        if name == "Llama2Tokenizer":  # --legacy-tokenizer: <s> starts each document
            assert all(ds[i][0] == 1 for i in range(len(ds)))


def test_training_on_each(prefixes, tmp_path):
    """One 2-rank launch (a 2-stage pipeline, the tiny model with a 384-token vocabulary) trains
    2 iterations on each preprocessed corpus, with pretrain_gpt.py's flags: every sample is
    made of the reference ids of corpus documents."""

    from planner.models import load_model

    model = dataclasses.replace(load_model("tiny"), vocab_size=TIK_VOCAB)
    plan = write_plan(tmp_path, "two", model, 2, TWO_STAGES)
    runs = {
        name: [
            "--data-path",
            prefix,
            "--split",
            "98,2,0",
            *flags,
            "--train-iters",
            "2",
            "--data-cache-path",
            str(tmp_path / "cache"),
        ]
        for name, (flags, prefix, _, _) in prefixes.items()
    }
    results = run_distributed(train_each, 2, plan, runs, timeout=300)[0]
    docs = documents()[: len(documents()) // 2]
    for name, (_, _, encode, eod) in prefixes.items():
        result = results[name]
        assert len(result["losses"]) == 2 and all(map(math.isfinite, result["losses"])), name
        first = result["ranks"][0]
        assert first["embedding"] and sorted(first["read"]) == [0, 1], name
        bos = 1 if name == "Llama2Tokenizer" else None
        check_samples_read(name, first, docs, encode, eod, bos)


def _refusals(files, corpus, tmp):
    """{case: (input JSONL, tokenizer flags, the one error line expected)}."""
    model, vocab, a = files["model"], files["vocab"], corpus.jsonl["a"]
    tik = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model"]
    small = ["--vocab-size", str(TIK_VOCAB), "--tiktoken-num-special-tokens", str(SPECIALS)]
    entries = json.loads(vocab.read_text())

    def vocab_file(name, content):
        path = tmp / name
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path

    swapped = [dict(e) for e in entries]
    swapped[5]["token_bytes"], swapped[6]["token_bytes"] = (
        swapped[6]["token_bytes"],
        swapped[5]["token_bytes"],
    )
    twice = [dict(e) for e in entries]
    twice[300]["token_bytes"] = twice[299]["token_bytes"]
    reranked = [dict(e) for e in entries]
    reranked[10]["rank"] = 11
    keys = [dict(e) for e in entries]
    del keys[3]["token_str"]
    bad_b64 = [dict(e) for e in entries]
    bad_b64[270]["token_bytes"] = "not base64!"
    paths = {
        "swapped": vocab_file("swapped.json", swapped),
        "twice": vocab_file("twice.json", twice),
        "reranked": vocab_file("reranked.json", reranked),
        "keys": vocab_file("keys.json", keys),
        "b64": vocab_file("b64.json", bad_b64),
        "object": vocab_file("object.json", {"a": 0}),
        "broken": vocab_file("broken.json", "[{"),
        "txt": vocab_file("vocab.txt", entries),
    }
    import sentencepiece

    prefix = str(tmp / "no-bos")
    sentencepiece.SentencePieceTrainer.train(
        input=str(HERE / "corpus.txt"),
        model_prefix=prefix,
        vocab_size=120,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    ids_jsonl = write_jsonl(tmp / "ids.jsonl", ["1 2 3", "4 5 60", "7 8"])
    words = write_jsonl(tmp / "words.jsonl", ["1 2 3", "4 five 6"])
    null = ["--tokenizer-type", "NullTokenizer"]
    return {
        "null without vocab size": (a, null, "--tokenizer-type NullTokenizer needs --vocab-size"),
        "null with a model file": (
            a,
            [*null, "--vocab-size", "9", "--tokenizer-model", str(model)],
            "--tokenizer-type NullTokenizer reads --vocab-size and --legacy-tokenizer, not "
            "--tokenizer-model",
        ),
        "null text not ids": (
            words,
            [*null, "--vocab-size", "99"],
            f"{words}:2: NullTokenizer reads integer ids separated by single spaces, not 'five'",
        ),
        "null id past the vocabulary": (
            ids_jsonl,
            [*null, "--vocab-size", "50"],
            f"{ids_jsonl}:2: token id 60 is outside the vocabulary of --tokenizer-type "
            f"NullTokenizer --vocab-size 50 (ids 0 to 50)",
        ),
        "llama2 missing model": (
            a,
            [*LLAMA_FLAGS, str(tmp / "none.model")],
            f"--tokenizer-model {tmp / 'none.model'}: no such file or directory",
        ),
        "llama2 given a tiktoken vocabulary": (
            a,
            [*LLAMA_FLAGS, str(vocab)],
            f"--tokenizer-model {vocab}: not a SentencePiece model",
        ),
        "legacy llama2 without bos": (
            a,
            [*LLAMA_FLAGS, prefix + ".model", "--legacy-tokenizer"],
            f"--tokenizer-model {prefix}.model: --legacy-tokenizer's Llama2Tokenizer starts "
            f"every text with the model's BOS, but the model has no beginning-of-sentence piece",
        ),
        "legacy sentencepiece": (
            a,
            [
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                str(model),
                "--legacy-tokenizer",
            ],
            "--tokenizer-type SentencePieceTokenizer reads --tokenizer-model, not "
            "--legacy-tokenizer",
        ),
        "tiktoken flag for llama2": (
            a,
            [*LLAMA_FLAGS, str(model), "--tiktoken-pattern", "v2"],
            "--tokenizer-type Llama2Tokenizer reads --tokenizer-model and --legacy-tokenizer, "
            "not --tiktoken-pattern",
        ),
        "tiktoken missing vocabulary": (
            a,
            [*tik, str(tmp / "none.json"), *small],
            f"--tokenizer-model {tmp / 'none.json'}: no such file",
        ),
        "tiktoken given a sentencepiece model": (
            a,
            [*tik, str(model), *small],
            f"--tokenizer-model {model}: TikTokenizer reads a .json vocabulary",
        ),
        "tiktoken vocabulary not json": (
            a,
            [*tik, str(paths["broken"]), *small],
            f"--tokenizer-model {paths['broken']}: not a TikTokenizer vocabulary (",
        ),
        "tiktoken vocabulary an object": (
            a,
            [*tik, str(paths["object"]), *small],
            f"--tokenizer-model {paths['object']}: not a TikTokenizer vocabulary (a JSON list "
            f"of {{rank, token_bytes, token_str}}, got a JSON dict)",
        ),
        "tiktoken vocabulary named .txt": (
            a,
            [*tik, str(paths["txt"]), *small],
            f"--tokenizer-model {paths['txt']}: TikTokenizer reads a .json vocabulary",
        ),
        "tiktoken entry without a key": (
            a,
            [*tik, str(paths["keys"]), *small],
            f"--tokenizer-model {paths['keys']}: entry 3 is not a {{rank, token_bytes, "
            f"token_str}} object",
        ),
        "tiktoken rank out of order": (
            a,
            [*tik, str(paths["reranked"]), *small],
            f"--tokenizer-model {paths['reranked']}: entry 10 has rank 11, not 10",
        ),
        "tiktoken bytes out of order": (
            a,
            [*tik, str(paths["swapped"]), *small],
            f"--tokenizer-model {paths['swapped']}: entry 5 is b'\\x06'; the first 256 entries "
            f"must be the single bytes 0..255 in order",
        ),
        "tiktoken token twice": (
            a,
            [*tik, str(paths["twice"]), *small],
            f"--tokenizer-model {paths['twice']}: entries 299 and 300 are the same token",
        ),
        "tiktoken bad base64": (
            a,
            [*tik, str(paths["b64"]), *small],
            f"--tokenizer-model {paths['b64']}: entry 270's token_bytes is not base64",
        ),
        "tiktoken vocabulary too short": (
            a,
            [*tik, str(vocab), "--vocab-size", "400", "--tiktoken-num-special-tokens", "8"],
            f"--tokenizer-model {vocab}: holds 376 tokens, but --vocab-size 400 less 8 special "
            f"tokens needs 392; give --vocab-size 384 or less",
        ),
        "tiktoken default sizes": (
            a,
            [*tik, str(vocab)],
            f"--tokenizer-model {vocab}: holds 376 tokens, but the default --vocab-size 131072 "
            f"less 1000 special tokens needs 130072; give --vocab-size 1376 or less",
        ),
        "tiktoken vocabulary under the bytes": (
            a,
            [*tik, str(vocab), "--vocab-size", "200", "--tiktoken-num-special-tokens", "8"],
            f"--tokenizer-model {vocab}: --vocab-size 200 less 8 special tokens keeps 192 of its "
            f"tokens, fewer than the 256 single bytes tiktoken needs to encode any text; raise "
            f"--vocab-size to 264 or more",
        ),
        "tiktoken special tokens lacking": (
            a,
            [*tik, str(vocab), *small, "--tokenizer-special-tokens", "<unk>", "<s>", "</s>"],
            "--tokenizer-special-tokens: must include <unk> <s> </s> <mask> <pad> <cls> <sep> "
            "(missing <mask> <pad> <cls> <sep>)",
        ),
        "tiktoken special token twice": (
            a,
            [
                *tik,
                str(vocab),
                *small,
                "--legacy-tokenizer",
                "--tiktoken-pattern",
                "v1",
                "--tiktoken-special-tokens",
                "<unk>",
                "<s>",
                "</s>",
                "<s>",
            ],
            "--tokenizer-special-tokens: <s> given more than once",
        ),
        "tiktoken special token flags contradict": (
            a,
            [
                *tik,
                str(vocab),
                *small,
                "--tokenizer-special-tokens",
                "<unk>",
                "<s>",
                "</s>",
                "--tiktoken-special-tokens",
                "<s>",
                "</s>",
                "<unk>",
            ],
            "--tiktoken-special-tokens contradicts --tokenizer-special-tokens",
        ),
        "tiktoken too few special ids": (
            a,
            [
                *tik,
                str(vocab),
                "--vocab-size",
                str(TIK_VOCAB),
                "--tiktoken-num-special-tokens",
                "5",
            ],
            "--tiktoken-num-special-tokens 5: must be at least the 7 named special tokens and "
            "below --vocab-size 384",
        ),
        "legacy tiktoken without pattern": (
            a,
            [*tik, str(vocab), *small, "--legacy-tokenizer"],
            "--legacy-tokenizer's TikTokenizer needs --tiktoken-pattern (v1 or v2)",
        ),
    }


REFUSALS = [
    "null without vocab size",
    "null with a model file",
    "null text not ids",
    "null id past the vocabulary",
    "llama2 missing model",
    "llama2 given a tiktoken vocabulary",
    "legacy llama2 without bos",
    "legacy sentencepiece",
    "tiktoken flag for llama2",
    "tiktoken missing vocabulary",
    "tiktoken given a sentencepiece model",
    "tiktoken vocabulary not json",
    "tiktoken vocabulary an object",
    "tiktoken vocabulary named .txt",
    "tiktoken entry without a key",
    "tiktoken rank out of order",
    "tiktoken bytes out of order",
    "tiktoken token twice",
    "tiktoken bad base64",
    "tiktoken vocabulary too short",
    "tiktoken default sizes",
    "tiktoken vocabulary under the bytes",
    "tiktoken special tokens lacking",
    "tiktoken special token twice",
    "tiktoken special token flags contradict",
    "tiktoken too few special ids",
    "legacy tiktoken without pattern",
]


def test_every_refusal_is_one_line(files, corpus, capsys, tmp_path):
    """Each case through tools/preprocess_data.py: exit 2, one line, no output left behind."""
    cases = _refusals(files, corpus, tmp_path)
    assert sorted(cases) == sorted(REFUSALS)
    for case in REFUSALS:
        jsonl, flags, message = cases[case]
        out = tmp_path / "out" / case.replace(" ", "-")
        code = preprocess_main(["--input", jsonl, "--output-prefix", out, *flags, "--append-eod"])
        err = capsys.readouterr().err
        assert code == 2, (case, err)
        assert err.startswith(f"preprocess_data.py: error: {message}"), (case, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (case, err)
        assert not list(out.parent.glob(out.name + "*")), f"{case}: output left behind"


def test_training_flags_and_vocabulary_fit(files, prefixes):
    """pretrain_gpt.py's flags reach the tokenizer; a vocabulary the plan's model cannot hold is
    refused naming the flags (NullTokenizer's hint: its vocabulary is --vocab-size + 1)."""
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.tokenizer import build_tokenizer, check_vocab_fits
    from planner.errors import SpecError

    base = ["--hetero-plan-path", "plan.json", "--train-iters", "2", "--lr", "1e-3"]
    flags, prefix, _, _ = prefixes["TikTokenizer"]
    args = parse_args(
        [
            *base,
            "--data-path",
            prefix,
            *flags,
            "--tiktoken-special-tokens",
            "<unk>",
            "<s>",
            "</s>",
            "<mask>",
            "<pad>",
            "<cls>",
            "<sep>",
            "<x>",
        ]
    )
    data = run_config(args).data
    assert data.tokenizer_special_tokens[-1] == "<x>"
    tok = build_tokenizer(data)
    assert (tok.vocab_size, tok.eod, tok.tokenize("<x>")) == (384, 2, [7])
    with pytest.raises(SpecError, match="--data-path needs --tokenizer-type"):
        parse_args([*base, "--data-path", prefix])
    with pytest.raises(SpecError, match="--tokenizer-type NullTokenizer needs --vocab-size"):
        parse_args([*base, "--data-path", prefix, "--tokenizer-type", "NullTokenizer"])
    null = build_tokenizer(
        run_config(
            parse_args(
                [
                    *base,
                    "--data-path",
                    prefix,
                    "--tokenizer-type",
                    "NullTokenizer",
                    "--vocab-size",
                    "128",
                ]
            )
        ).data
    )
    with pytest.raises(SpecError) as e:
        check_vocab_fits(null, 128)
    assert str(e.value) == (
        "--tokenizer-type NullTokenizer --vocab-size 128: the tokenizer's vocabulary (129 tokens) "
        "does not fit the plan's model vocab_size 128; plan with a model whose vocab_size is >= "
        "129, or give --vocab-size 127 or less (NullTokenizer's vocabulary is --vocab-size ids "
        "and its end-of-document id)"
    )
    check_vocab_fits(_load("NullTokenizer", vocab_size=127), 128)
    zero = parse_args(
        [*base, "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "0"]
    )
    with pytest.raises(SpecError, match="^--vocab-size must be >= 1, got 0$"):
        build_tokenizer(run_config(zero).data)
    with pytest.raises(
        SpecError,
        match=rf"--tokenizer-model {files['vocab']}: the tokenizer's "
        r"vocabulary \(384 tokens\) does not fit the plan's model vocab_size 128",
    ):
        check_vocab_fits(tok, 128)
