"""Tokenise a JSONL corpus into megatron-core's indexed dataset (.bin/.idx), as Megatron-LM's
tools/preprocess_data.py does, with any of the tokenizers training reads (Megatron-LM's
--tokenizer-type names and flags).

Each input line is one JSON object, one document; each key of --json-keys gives one dataset,
written as OUTPUT_PREFIX_KEY_document.bin/.idx (Megatron-LM's names), so train with
`--data-path OUTPUT_PREFIX_text_document` and the same tokenizer flags. Token dtype as Megatron
picks it: uint16 for vocabularies under 65,500 tokens, else int32. Documents with no tokens are
skipped. Errors (missing file, malformed JSON line, missing key, a tokenizer file that is not
what its flag needs, a line over --max-document-bytes, token ids the .bin's dtype cannot hold) are
one line naming the file. The output is written under temporary names and renamed when complete:
a failed run leaves no partial output and the previous output of the prefix as it was.
"""

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hexi.tokenizer import (  # noqa: E402
    TOKENIZER_TYPES,
    TokenizerSpec,
    add_tokenizer_options,
    load_tokenizer,
    require_eod,
)
from planner.errors import SpecError  # noqa: E402

CHUNK = 64  # lines per task handed to a worker (fewer when they are long: CHUNK_BYTES)
# Tokenising costs about 180 bytes of memory per byte of text (tokenizers' encodings), so a
# document's size bounds the run's memory: 4 MiB is ~0.7 GB per worker, and far above ordinary
# documents; a task holds at most about this many bytes of lines.
DEFAULT_MAX_DOCUMENT_BYTES = 4 * 2**20
MEMORY_PER_BYTE = 180  # measured: an 8 MiB line of words, HuggingFaceTokenizer, 1.4 GB peak

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
  # Megatron-LM's tiktoken vocabulary (a JSON list of rank, token_bytes, token_str)
  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
      --tokenizer-type TikTokenizer --tokenizer-model vocab.json --tiktoken-pattern v2 \\
      --vocab-size 131072 --append-eod
  # text that is already ids ("17 4 2031"): NullTokenizer, eod is --vocab-size
  python tools/preprocess_data.py --input ids.jsonl --output-prefix data/ids \\
      --tokenizer-type NullTokenizer --vocab-size 32000 --append-eod

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
        "SentencePieceTokenizer, Llama2Tokenizer: a tokenizer.model; TikTokenizer: its "
        "vocab.json",
    )
    t.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    t.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    add_tokenizer_options(t)
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
        "--max-document-bytes",
        type=int,
        default=DEFAULT_MAX_DOCUMENT_BYTES,
        help="refuse an input line longer than this (default: 4 MiB); tokenising a line takes "
        f"about {MEMORY_PER_BYTE} times its size in memory, per worker",
    )
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
    try:
        encoded = _tokenizer.tokenize_batch([t for _, texts in parsed for t in texts])
    except ValueError:  # NullTokenizer's text that is not ids: find the line
        for number, texts in parsed:
            try:
                _tokenizer.tokenize_batch(texts)
            except ValueError as e:
                return "error", f"{path}:{number}: {e}"
        raise
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


def _utf8_lines(f, path, max_bytes):
    """(line number, text) of the non-blank lines; a line that is not UTF-8, or longer than
    max_bytes (never read whole), is a SpecError naming it (decoding the whole file would only
    say 'position N')."""
    number = 0
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_bytes and not (len(raw) == max_bytes + 1 and raw.endswith(b"\n")):
            raise SpecError(
                f"{path}:{number}: a line longer than --max-document-bytes {max_bytes:,} "
                f"(tokenising takes about {MEMORY_PER_BYTE} bytes of memory per byte of text; "
                f"raise the limit if the memory is there)"
            )
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(
                f"{path}:{number}: not UTF-8 text (byte {e.start + 1} of the line is "
                f"{raw[e.start : e.start + 1]!r}); JSONL input must be UTF-8"
            ) from None
        if line.strip():
            yield number, line


def _chunks(path, keys, append_eod, max_bytes):
    """Tasks of up to CHUNK lines and about max_bytes of text."""
    with open(path, "rb") as f:
        lines, size = [], 0
        for number, line in _utf8_lines(f, path, max_bytes):
            lines.append((number, line))
            size += len(line)
            if len(lines) == CHUNK or size >= max_bytes:
                yield path, keys, append_eod, lines
                lines, size = [], 0
        if lines:
            yield path, keys, append_eod, lines


def _check_paths(args, prefixes):
    """The input must not be one of the outputs (which the run would replace)."""
    real = os.path.realpath(args.input)
    for prefix in prefixes.values():
        for ext in (".bin", ".idx"):
            out = prefix + ext
            same = os.path.realpath(out) == real or (
                os.path.exists(out) and os.path.samefile(out, args.input)
            )
            if same:
                raise SpecError(
                    f"--input {args.input}: is also the output {out} of --output-prefix "
                    f"{args.output_prefix}; write the output elsewhere"
                )


def check_ids_fit(tokenizer, dtype):
    """Every id of the vocabulary fits the .bin's token dtype (megatron-core's widest: int32)."""
    import numpy

    largest = tokenizer.vocab_size - 1
    if largest > numpy.iinfo(dtype).max:
        raise SpecError(
            f"{tokenizer.source}: token ids up to {largest:,} do not fit the .bin's "
            f"{dtype.__name__} (at most {numpy.iinfo(dtype).max:,}); megatron-core's indexed "
            f"datasets hold no wider ids"
        )


def _temporary(path):
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")


def preprocess(args):
    """Write the datasets; returns {key: (documents, tokens)}. Raises SpecError on bad input."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not os.path.isfile(args.input):
        raise SpecError(f"--input {args.input}: no such file")
    if args.workers < 1:
        raise SpecError(f"--workers must be >= 1, got {args.workers}")
    if args.max_document_bytes < 1:
        raise SpecError(f"--max-document-bytes must be >= 1, got {args.max_document_bytes}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise SpecError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated")
    spec = TokenizerSpec.from_flags(args)
    tokenizer = load_tokenizer(spec)
    if args.append_eod:
        require_eod(tokenizer, "--append-eod")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    check_ids_fit(tokenizer, dtype)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    _check_paths(args, prefixes)
    temporary = {
        key: (_temporary(p + ".bin"), _temporary(p + ".idx")) for key, p in prefixes.items()
    }
    builders = {}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        for key, (bin_tmp, _) in temporary.items():
            builders[key] = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    except OSError as e:
        for builder in builders.values():
            builder.data_file.close()
        for bin_tmp, _ in temporary.values():
            if os.path.exists(bin_tmp):
                os.remove(bin_tmp)
        raise SpecError(
            f"--output-prefix {args.output_prefix}: cannot write ({e.strerror})"
        ) from None
    counts = {key: [0, 0] for key in args.json_keys}
    tasks = _chunks(args.input, args.json_keys, args.append_eod, args.max_document_bytes)
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
            for number, ids, n_chars in payload:
                chars += n_chars
                docs += 1
                for key, doc in ids.items():
                    if doc:
                        array = numpy.asarray(doc, dtype=numpy.int64)
                        if array.min() < 0 or array.max() >= tokenizer.vocab_size:
                            bad = int(array.min() if array.min() < 0 else array.max())
                            raise SpecError(
                                f"{args.input}:{number}: token id {bad} is outside the "
                                f"vocabulary of {tokenizer.source} (ids 0 to "
                                f"{tokenizer.vocab_size - 1})"
                            )
                        builders[key].add_document(array, [len(doc)])
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
        empty = [key for key, (n, _) in counts.items() if n == 0]
        if empty:
            raise SpecError(f"--input {args.input}: no tokens under key(s) {', '.join(empty)}")
        for key, builder in builders.items():
            builder.finalize(temporary[key][1])
        for key, (bin_tmp, idx_tmp) in temporary.items():
            os.replace(bin_tmp, prefixes[key] + ".bin")
            os.replace(idx_tmp, prefixes[key] + ".idx")
    except BaseException as e:
        for builder in builders.values():
            builder.data_file.close()
        for pair in temporary.values():
            for path in pair:
                if os.path.exists(path):
                    os.remove(path)
        if isinstance(e, OSError):
            raise SpecError(
                f"--output-prefix {args.output_prefix}: cannot write ({e.strerror})"
            ) from None
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
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
