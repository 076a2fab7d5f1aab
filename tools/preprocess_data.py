"""Tokenise a JSONL corpus into megatron-core's indexed dataset (.bin/.idx), as Megatron-LM's
tools/preprocess_data.py does, with any of the tokenizers training reads (Megatron-LM's
--tokenizer-type names and flags).

Each input line is one JSON object, one document; each key of --json-keys gives one dataset,
written as OUTPUT_PREFIX_KEY_document.bin/.idx (Megatron-LM's names), so train with
`--data-path OUTPUT_PREFIX_text_document` and the same tokenizer flags. Token dtype as Megatron
picks it: uint16 for vocabularies under 65,500 tokens, else int32. Documents with no tokens are
skipped. Errors (missing file, malformed JSON line, missing key, a tokenizer file that is not
what its flag needs) are one line naming the file; no partial output is left behind.
"""

import argparse
import itertools
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hexi.tokenizer import (  # noqa: E402
    TOKENIZER_TYPES,
    TokenizerSpec,
    load_tokenizer,
    require_eod,
)
from planner.errors import SpecError  # noqa: E402

CHUNK = 64  # lines per task handed to a worker

EXAMPLES = """examples:
  # a Hugging Face tokenizer.json, or a model directory holding one
  python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
      --output-prefix data/corpus --tokenizer-type HuggingFaceTokenizer \\
      --tokenizer-model tokenizer.json --append-eod --workers 4
  # a SentencePiece model (Llama-2 style)
  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
      --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod
  # GPT-2 BPE files
  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
      --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
      --merge-file gpt2-merges.txt --append-eod

Each writes data/corpus_text_document.bin/.idx; train with --data-path
data/corpus_text_document and the same --tokenizer-* flags."""


def build_parser():
    p = argparse.ArgumentParser(
        prog="preprocess_data.py",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, one document per line")
    g.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to extract from each JSON object (default: text)",
    )
    t = p.add_argument_group("tokenizer")
    t.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    t.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: a tokenizer.json or a Hugging Face model directory; "
        "SentencePieceTokenizer: a tokenizer.model",
    )
    t.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    t.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    t.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document",
    )
    o = p.add_argument_group("output data")
    o.add_argument(
        "--output-prefix",
        required=True,
        help="writes OUTPUT_PREFIX_KEY_document.bin/.idx for each key",
    )
    r = p.add_argument_group("runtime")
    r.add_argument("--workers", type=int, default=1, help="tokenising processes (default: 1)")
    r.add_argument(
        "--log-interval",
        type=int,
        default=10000,
        help="report progress every this many documents (0: never)",
    )
    return p


_tokenizer = None


def _init_worker(spec):
    global _tokenizer
    _tokenizer = load_tokenizer(spec)


def _encode_chunk(task):
    """[(line number, raw line)] -> [(line number, {key: ids}, characters)] or ('error', msg)."""
    path, keys, append_eod, lines = task
    parsed = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except ValueError as e:
            return "error", f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})"
        if not isinstance(record, dict):
            return "error", f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
        texts = []
        for key in keys:
            if key not in record:
                return "error", (
                    f"{path}:{number}: missing key {key!r} (keys present: "
                    f"{', '.join(map(repr, record)) or 'none'}; see --json-keys)"
                )
            if not isinstance(record[key], str):
                return "error", (
                    f"{path}:{number}: key {key!r} is "
                    f"{type(record[key]).__name__}, expected a string"
                )
            texts.append(record[key])
        parsed.append((number, texts))
    encoded = _tokenizer.tokenize_batch([t for _, texts in parsed for t in texts])
    out = []
    for i, (number, texts) in enumerate(parsed):
        ids = {}
        for j, key in enumerate(keys):
            doc = encoded[i * len(keys) + j]
            if append_eod and doc:
                doc = doc + [_tokenizer.eod]
            ids[key] = doc
        out.append((number, ids, sum(len(t) for t in texts)))
    return "ok", out


def _utf8_lines(f, path):
    """(line number, text) of the non-blank lines; a line that is not UTF-8 is a SpecError
    naming it (decoding the whole file would only say 'position N')."""
    for number, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(
                f"{path}:{number}: not UTF-8 text (byte {e.start + 1} of the line is "
                f"{raw[e.start : e.start + 1]!r}); JSONL input must be UTF-8"
            ) from None
        if line.strip():
            yield number, line


def _chunks(path, keys, append_eod):
    with open(path, "rb") as f:
        numbered = _utf8_lines(f, path)
        while True:
            lines = list(itertools.islice(numbered, CHUNK))
            if not lines:
                return
            yield path, keys, append_eod, lines


def preprocess(args):
    """Write the datasets; returns {key: (documents, tokens)}. Raises SpecError on bad input."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not os.path.isfile(args.input):
        raise SpecError(f"--input {args.input}: no such file")
    if args.workers < 1:
        raise SpecError(f"--workers must be >= 1, got {args.workers}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise SpecError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated")
    spec = TokenizerSpec(
        args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file
    )
    tokenizer = load_tokenizer(spec)
    if args.append_eod:
        require_eod(tokenizer, "--append-eod")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    try:
        builders = {
            key: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for key, p in prefixes.items()
        }
    except OSError as e:
        raise SpecError(f"--output-prefix {args.output_prefix}: cannot write ({e.strerror})")
    counts = {key: [0, 0] for key in args.json_keys}
    tasks = _chunks(args.input, args.json_keys, args.append_eod)
    pool = None
    start, chars, docs = time.time(), 0, 0
    global _tokenizer
    _tokenizer = tokenizer  # forked workers inherit it; spawned ones load it again
    try:
        if args.workers > 1:
            import multiprocessing

            # fork (Megatron-LM's default on Linux) also serves callers that load this file
            # under another module name, which spawned workers could not import.
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            pool = multiprocessing.get_context(method).Pool(
                args.workers,
                **({} if method == "fork" else {"initializer": _init_worker, "initargs": (spec,)}),
            )
            results = pool.imap(_encode_chunk, tasks)
        else:
            results = map(_encode_chunk, tasks)
        for status, payload in results:
            if status == "error":
                raise SpecError(payload)
            for _, ids, n_chars in payload:
                chars += n_chars
                docs += 1
                for key, doc in ids.items():
                    if doc:
                        builders[key].add_document(
                            numpy.asarray(doc, dtype=numpy.int64), [len(doc)]
                        )
                        counts[key][0] += 1
                        counts[key][1] += len(doc)
                if args.log_interval and docs % args.log_interval == 0:
                    elapsed = time.time() - start
                    print(
                        f"processed {docs} documents ({docs / elapsed:.1f} docs/s, "
                        f"{chars / elapsed / 1e6:.2f} MB/s)",
                        file=sys.stderr,
                        flush=True,
                    )
        for key, builder in builders.items():
            builder.finalize(prefixes[key] + ".idx")
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for p in prefixes.values():
            for ext in (".bin", ".idx"):
                if os.path.exists(p + ext):
                    os.remove(p + ext)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    empty = [key for key, (n, _) in counts.items() if n == 0]
    if empty:
        for p in prefixes.values():
            for ext in (".bin", ".idx"):
                os.remove(p + ext)
        raise SpecError(f"--input {args.input}: no tokens under key(s) {', '.join(empty)}")
    return {prefixes[k]: tuple(v) for k, v in counts.items()}, dtype


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        written, dtype = preprocess(args)
    except SpecError as e:
        for line in e.problems:
            print(f"preprocess_data.py: error: {line}", file=sys.stderr)
        return 2
    for prefix, (docs, tokens) in written.items():
        print(f"wrote {prefix}.bin/.idx: {docs} documents, {tokens} tokens ({dtype.__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
