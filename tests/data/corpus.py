"""The bundled corpus as test data: a small BPE tokenizer trained on it on the fly, JSONL files
made from it, and their indexed datasets (written by tools/preprocess_data.py).

corpus.txt is plain English prose written for these tests. Its lines are grouped into documents
of 1 to 5 lines (a fixed pattern, so lengths vary); the first half of the documents is corpus
"a", the second half corpus "b".
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
EOD, PAD, UNK = "<|endoftext|>", "<pad>", "<unk>"


def documents():
    lines = [
        line.strip() for line in (HERE / "corpus.txt").read_text().splitlines() if line.strip()
    ]
    docs, i, k = [], 0, 0
    while i < len(lines):
        n = 1 + (k * 7) % 5
        docs.append(" ".join(lines[i : i + n]))
        i, k = i + n, k + 1
    return docs


def train_tokenizer(path, vocab_size):
    """A BPE tokenizer.json of exactly `vocab_size` tokens (specials included)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK, continuing_subword_prefix="##"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD, PAD, UNK],
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(documents(), trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(path))
    return path


def write_jsonl(path, docs, key="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({key: d, "id": len(d)}) + "\n")
    return path


def preprocess_main(argv):
    """tools/preprocess_data.py's main() in this process (tools/ is not a package)."""
    import importlib.util
    import sys

    name = "hexi_preprocess_data"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, HERE.parents[1] / "tools" / "preprocess_data.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name].main([str(a) for a in argv])


# One tokenizer file of each --tokenizer-type kind, trained on the corpus, each under the `tiny`
# model's 128-token vocabulary. Each returns the reference its ids are checked against.


def train_sentencepiece(path, vocab_size=120):
    """A Llama-style SentencePiece BPE model (<unk> 0, <s> 1, </s> 2, no pad piece) at `path`;
    returns the reference sentencepiece processor. Llama's byte fallback is left out: its 256
    byte pieces alone would not fit the model's vocabulary."""
    import sentencepiece

    prefix = str(path).removesuffix(".model")
    sentencepiece.SentencePieceTrainer.train(
        input=str(HERE / "corpus.txt"),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")


def train_gpt2_files(directory, vocab_size=120):
    """GPT-2's vocab.json and merges.txt in `directory`: byte-level BPE with <|endoftext|>;
    returns the trained `tokenizers` tokenizer (the reference). Its byte alphabet is the bytes
    the corpus uses, not all 256 (which would not fit the model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=[],
        show_progress=False,
    )
    tok.train_from_iterator(documents(), trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    directory.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(directory))  # vocab.json, merges.txt
    return tok


def save_hf_directory(directory, vocab_size=110):
    """A Llama-like tokenizer (Metaspace BPE, <unk> <s> </s>, a BOS added to every text, pad
    set to <unk> as many Llama fine-tunes do) saved by transformers' save_pretrained, which
    writes tokenizer.json and tokenizer_config.json; returns transformers' AutoTokenizer over
    the directory (the reference)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(documents(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
    ).save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def check_samples_read(name, result, docs, encode, eod, bos=None):
    """What a rank read in training (`result["read"]`: {index: (tokens, labels)}, 8 x 32) is
    made of the reference ids: labels are the next tokens, every piece of 8 or more tokens
    between end-of-document tokens is part of one document's `encode`, each document after the
    first in a row starts with `bos` when given, and some row holds an end of document."""
    import torch

    references = ["," + ",".join(map(str, encode(d))) + "," for d in docs]
    eods = 0
    for tokens, labels in result["read"].values():
        assert tokens.shape == (8, 32), name
        assert torch.equal(labels[:, :-1], tokens[:, 1:]), name  # labels: the next tokens
        for row in tokens.tolist():
            pieces, cur = [], []
            for t in row:
                if t == eod:
                    pieces.append(cur)
                    cur, eods = [], eods + 1
                else:
                    cur.append(t)
            pieces.append(cur)
            for i, piece in enumerate(pieces):
                if len(piece) >= 8:
                    needle = "," + ",".join(map(str, piece)) + ","
                    assert any(needle in r for r in references), (name, piece)
                if bos is not None and 0 < i and piece:
                    assert piece[0] == bos, (name, row)  # each document starts with bos
    assert eods > 0, f"{name}: no end-of-document token in 16 samples"
