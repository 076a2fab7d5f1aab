"""--tokenizer-type TikTokenizer: Megatron-LM's tiktoken tokenizer over its JSON vocabulary.

The vocabulary file (`--tokenizer-model vocab.json`) is a JSON list of
`{"rank": i, "token_bytes": base64 bytes, "token_str": text}` in rank order, the first 256 being
the single bytes 0..255; a token's rank is its BPE merge priority. The tokenizer's ids are:
0..S-1 the S special tokens (`--tiktoken-num-special-tokens`, default 1000: the named ones, then
`<SPECIAL_i>` fillers), then the first V-S entries of the file shifted by S, V being
`--vocab-size` (default 131072, Megatron-LM's fallback). eod is `</s>`, bos `<s>`.

Two variants, as Megatron-LM (pinned release) has them:
- default, megatron-core's TikTokenTokenizer (what Megatron-LM builds): the named special tokens
  must include `<unk> <s> </s> <mask> <pad> <cls> <sep>` (the default list); their text in the
  input is read as those tokens (`encode(text, allowed_special="all")`); pad is `<pad>`'s id;
  pattern v2 unless `--tiktoken-pattern` says.
- `--legacy-tokenizer`, Megatron-LM's older CustomTikTokenizer: the list must include
  `<unk> <s> </s>` (the default list); special tokens' text is plain text (`encode_ordinary`);
  no pad; `--tiktoken-pattern` is required.

Beyond Megatron-LM's own checks (which are asserts), the vocabulary must hold all 256 single
bytes: tiktoken aborts on text with a byte its vocabulary lacks.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

from planner.errors import SpecError

# Megatron-LM's split patterns (megatron-core's _PATTERN_TIKTOKEN_V1 / _V2).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_VOCAB_SIZE = 2**17  # Megatron-LM's fallback when --vocab-size is not given
DEFAULT_NUM_SPECIAL_TOKENS = 1000  # Megatron-LM's --tiktoken-num-special-tokens default
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
LEGACY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
FILLER = "<SPECIAL_{id}>"
NO_PAD = -1
ENTRY_KEYS = {"rank", "token_bytes", "token_str"}


class TikTokenizer:
    """Megatron-LM's TikTokenizer: tiktoken BPE over the file's ranks, special tokens first."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        pattern: str | None = None,
        vocab_size: int | None = None,
        num_special_tokens: int | None = None,
        special_tokens: Sequence[str] | None = None,
        legacy: bool = False,
    ) -> None:
        path = os.fspath(path)
        self.path = path
        self.source = f"--tokenizer-model {path}"
        if pattern is None and legacy:
            raise SpecError("--legacy-tokenizer's TikTokenizer needs --tiktoken-pattern (v1 or v2)")
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise SpecError(f"--tiktoken-pattern {pattern}: not one of {', '.join(PATTERNS)}")
        size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        size_flag = "--vocab-size" if vocab_size is not None else "the default --vocab-size"
        num_special = (
            DEFAULT_NUM_SPECIAL_TOKENS if num_special_tokens is None else num_special_tokens
        )
        required = LEGACY_SPECIAL_TOKENS if legacy else SPECIAL_TOKENS
        named = list(required if special_tokens is None else special_tokens)
        _check_special_tokens(named, required, num_special, size, size_flag)
        specials = named + [FILLER.format(id=i) for i in range(len(named), num_special)]
        ranks = read_ranks(path, size - num_special, size_flag, num_special)
        try:
            import tiktoken
        except ImportError:
            raise SpecError(
                "--tokenizer-type TikTokenizer needs the tiktoken package (pip install tiktoken)"
            ) from None
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))),
            pat_str=PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special for token, rank in ranks.items()},
            special_tokens={token: i for i, token in enumerate(specials)},
        )
        self.legacy = legacy
        self.special_tokens = specials
        self.vocab_size = size
        self.eod = specials.index("</s>")
        self.bos = specials.index("<s>")
        self.pad = NO_PAD if legacy else specials.index("<pad>")
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(
            {
                "class": type(self).__name__,
                "tokenizer_path": [os.path.abspath(path)],
                "pattern": pattern,
                "vocab_size": size,
                "special_tokens": specials[: len(named)],
                "num_special_tokens": num_special,
                "legacy": legacy,
            }
        )

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        if self.legacy:
            return self._encoding.encode_ordinary(text)
        return self._encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.legacy:
            return self._encoding.encode_ordinary_batch(list(texts))
        return self._encoding.encode_batch(list(texts), allowed_special="all")

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        return self._encoding.decode([int(i) for i in ids])


def _check_special_tokens(
    named: list[str], required: Sequence[str], num_special: int, size: int, size_flag: str
) -> None:
    flag = "--tokenizer-special-tokens"
    repeated = sorted({t for t in named if named.count(t) > 1})
    if repeated:
        raise SpecError(f"{flag}: {' '.join(repeated)} given more than once")
    missing = [t for t in required if t not in named]
    if missing:
        raise SpecError(f"{flag}: must include {' '.join(required)} (missing {' '.join(missing)})")
    if not len(named) <= num_special < size:
        raise SpecError(
            f"--tiktoken-num-special-tokens {num_special}: must be at least the {len(named)} "
            f"named special tokens and below {size_flag} {size}"
        )


def read_ranks(path: str, max_vocab: int, size_flag: str, num_special: int) -> dict[bytes, int]:
    """{token bytes: rank} of the file's first `max_vocab` entries (Megatron-LM's
    reload_mergeable_ranks); every problem is a SpecError naming the file and the entry."""
    where = f"--tokenizer-model {path}"
    if not os.path.isfile(path):
        raise SpecError(f"{where}: no such file")
    if not path.endswith(".json"):
        raise SpecError(
            f"{where}: TikTokenizer reads a .json vocabulary (a list of "
            f"{{rank, token_bytes, token_str}})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecError(f"{where}: not a TikTokenizer vocabulary ({e})") from None
    if not isinstance(entries, list):
        raise SpecError(
            f"{where}: not a TikTokenizer vocabulary (a JSON list of "
            f"{{rank, token_bytes, token_str}}, got a JSON {type(entries).__name__})"
        )
    if len(entries) < max_vocab:
        raise SpecError(
            f"{where}: holds {len(entries)} tokens, but {size_flag} {max_vocab + num_special} "
            f"less {num_special} special tokens needs {max_vocab}; give --vocab-size "
            f"{len(entries) + num_special} or less"
        )
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:max_vocab]):
        if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
            raise SpecError(f"{where}: entry {i} is not a {{rank, token_bytes, token_str}} object")
        if entry["rank"] != i or isinstance(entry["rank"], bool):
            raise SpecError(f"{where}: entry {i} has rank {entry['rank']!r}, not {i}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise SpecError(f"{where}: entry {i}'s token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise SpecError(
                f"{where}: entry {i} is {token!r}; the first 256 entries must be the single "
                f"bytes 0..255 in order"
            )
        if token in ranks:
            raise SpecError(f"{where}: entries {ranks[token]} and {i} are the same token {token!r}")
        ranks[token] = i
    if max_vocab < 256:
        raise SpecError(
            f"{where}: {size_flag} {max_vocab + num_special} less {num_special} special tokens "
            f"keeps {max_vocab} of its tokens, fewer than the 256 single bytes tiktoken needs "
            f"to encode any text; raise --vocab-size to {256 + num_special} or more"
        )
    return ranks
