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
