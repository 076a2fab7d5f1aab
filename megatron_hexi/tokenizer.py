"""Megatron-LM's --tokenizer-type kinds, as the tokenizer megatron-core's datasets read.

- `HuggingFaceTokenizer --tokenizer-model PATH` and `GPT2BPETokenizer --vocab-file vocab.json
  --merge-file merges.txt`: megatron_hexi.tokenizer_hf.
- `SentencePieceTokenizer` and `Llama2Tokenizer --tokenizer-model tokenizer.model`:
  megatron_hexi.tokenizer_sentencepiece.
- `TikTokenizer --tokenizer-model vocab.json`: megatron_hexi.tokenizer_tiktoken.
- `NullTokenizer --vocab-size N`: the text is the ids, as decimal integers separated by single
  spaces; the vocabulary is N + 1 ids, the last, N, being eod (Megatron-LM's _NullTokenizer; the
  model's vocabulary must hold N + 1). No bos, no pad.

`--legacy-tokenizer` (Megatron-LM's flag) selects Megatron-LM's older tokenizer classes where
they differ from megatron-core's: Llama2Tokenizer and TikTokenizer (NullTokenizer is the same).

Every problem with a flag or its files is a SpecError naming the flag and the path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, SupportsInt

from megatron_hexi.tokenizer_hf import (
    GPT2_EOD,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    resolve_tokenizer_file,
)
from megatron_hexi.tokenizer_sentencepiece import NO_PAD, Llama2Tokenizer, SentencePieceTokenizer
from megatron_hexi.tokenizer_tiktoken import TikTokenizer
from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron_hexi.config import DataConfig

__all__ = [
    "TOKENIZER_FILES",
    "TOKENIZER_OPTIONS",
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TextTokenizer",
    "TikTokenizer",
    "TokenizerSpec",
    "add_tokenizer_options",
    "build_tokenizer",
    "check_vocab_fits",
    "load_tokenizer",
    "require_eod",
    "resolve_tokenizer_file",
    "special_tokens_flag",
]

# Megatron-LM's --tokenizer-type names this runtime reads, and the flags each one needs.
TOKENIZER_FILES = {
    "HuggingFaceTokenizer": ("--tokenizer-model",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "Llama2Tokenizer": ("--tokenizer-model",),
    "TikTokenizer": ("--tokenizer-model",),
    "NullTokenizer": ("--vocab-size",),
}
TOKENIZER_TYPES = tuple(TOKENIZER_FILES)
# The flags each one may be given besides those.
TOKENIZER_OPTIONS = {
    "Llama2Tokenizer": ("--legacy-tokenizer",),
    "TikTokenizer": (
        "--vocab-size",
        "--tiktoken-pattern",
        "--tiktoken-num-special-tokens",
        "--tokenizer-special-tokens",
        "--legacy-tokenizer",
    ),
    "NullTokenizer": ("--legacy-tokenizer",),
}


class TextTokenizer(Protocol):
    """What training and tools/preprocess_data.py need of a tokenizer; megatron-core's GPTDataset
    reads `vocab_size`, `eod`, `pad` and `unique_identifiers`."""

    @property
    def source(self) -> str:
        """The flags and files it was read from, for messages."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int | None: ...

    @property
    def bos(self) -> int | None: ...

    @property
    def pad(self) -> int: ...

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def detokenize(self, ids: Iterable[SupportsInt]) -> str: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as its flags name it; picklable, so worker processes can load it again."""

    tokenizer_type: str | None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int | None = None
    special_tokens: tuple[str, ...] | None = None
    legacy_tokenizer: bool = False

    @classmethod
    def from_flags(cls, flags: Any) -> TokenizerSpec:
        """From parsed flags (pretrain_gpt.py's, preprocess_data.py's or a DataConfig) with the
        names of Megatron-LM's tokenizer flags as attributes."""
        return cls(
            flags.tokenizer_type,
            flags.tokenizer_model,
            flags.vocab_file,
            flags.merge_file,
            flags.vocab_size,
            flags.tiktoken_pattern,
            flags.tiktoken_num_special_tokens,
            special_tokens_flag(flags),
            bool(flags.legacy_tokenizer),
        )


def special_tokens_flag(flags: Any) -> tuple[str, ...] | None:
    """--tokenizer-special-tokens, or Megatron-LM's older name for it, --tiktoken-special-tokens
    (as Megatron-LM reads them: the older one when the newer is not given)."""
    new = getattr(flags, "tokenizer_special_tokens", None)
    old = getattr(flags, "tiktoken_special_tokens", None)
    if new and old and list(new) != list(old):
        raise SpecError(
            "--tiktoken-special-tokens contradicts --tokenizer-special-tokens (give one; the "
            "first is Megatron-LM's older name of the second)"
        )
    chosen = new or old
    return None if chosen is None else tuple(chosen)


def load_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """The tokenizer `spec` names. A missing flag, a flag its type does not read, or a file that
    is not what the flag needs is a SpecError."""
    if spec.tokenizer_type not in TOKENIZER_FILES:
        raise SpecError(
            f"--tokenizer-type {spec.tokenizer_type}: not one of {', '.join(TOKENIZER_TYPES)}"
        )
    given = {
        "--tokenizer-model": spec.tokenizer_model,
        "--vocab-file": spec.vocab_file,
        "--merge-file": spec.merge_file,
        "--vocab-size": spec.vocab_size,
        "--tiktoken-pattern": spec.tiktoken_pattern,
        "--tiktoken-num-special-tokens": spec.tiktoken_num_special_tokens,
        "--tokenizer-special-tokens": spec.special_tokens,
        "--legacy-tokenizer": spec.legacy_tokenizer or None,
    }
    name = spec.tokenizer_type
    needs = TOKENIZER_FILES[name]
    reads = needs + TOKENIZER_OPTIONS.get(name, ())
    missing = [flag for flag in needs if given[flag] is None or given[flag] == ""]
    if missing:
        raise SpecError(f"--tokenizer-type {name} needs {' and '.join(missing)}")
    unused = [flag for flag, value in given.items() if value is not None and flag not in reads]
    if unused:
        raise SpecError(
            f"--tokenizer-type {name} reads {_listed(reads)}, not {' or '.join(unused)}"
        )
    for flag in ("--vocab-size", "--tiktoken-num-special-tokens"):
        value = given[flag]
        if isinstance(value, int) and value < (1 if flag == "--vocab-size" else 0):
            raise SpecError(f"{flag} must be >= {1 if flag == '--vocab-size' else 0}, got {value}")
    if name == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(spec.tokenizer_model)
    if name == "SentencePieceTokenizer":
        return SentencePieceTokenizer(spec.tokenizer_model)
    if name == "Llama2Tokenizer":
        return Llama2Tokenizer(spec.tokenizer_model, legacy=spec.legacy_tokenizer)
    if name == "TikTokenizer":
        assert spec.tokenizer_model is not None  # checked above
        return TikTokenizer(
            spec.tokenizer_model,
            spec.tiktoken_pattern,
            spec.vocab_size,
            spec.tiktoken_num_special_tokens,
            spec.special_tokens,
            legacy=spec.legacy_tokenizer,
        )
    if name == "NullTokenizer":
        assert spec.vocab_size is not None  # checked above
        return NullTokenizer(spec.vocab_size)
    assert spec.vocab_file is not None and spec.merge_file is not None  # checked above
    return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)


def _listed(flags: Sequence[str]) -> str:
    return " and ".join(flags) if len(flags) < 3 else f"{', '.join(flags[:-1])} and {flags[-1]}"


def add_tokenizer_options(group: Any) -> None:
    """The tokenizer flags of Llama2Tokenizer, TikTokenizer and NullTokenizer (Megatron-LM's
    names), for pretrain_gpt.py and tools/preprocess_data.py alike."""
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: ids are below it, eod is it (the vocabulary is N + 1); "
        "TikTokenizer: the vocabulary, special tokens included (default 131072)",
    )
    group.add_argument(
        "--tiktoken-pattern",
        choices=("v1", "v2"),
        default=None,
        help="TikTokenizer: Megatron-LM's text split pattern (default v2)",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=None,
        help="TikTokenizer: ids before the vocabulary's own (default 1000)",
    )
    for flag in ("--tokenizer-special-tokens", "--tiktoken-special-tokens"):
        group.add_argument(
            flag,
            nargs="+",
            default=None,
            metavar="TOKEN",
            help="TikTokenizer: the named special tokens, ids 0, 1, ... (default <unk> <s> </s> "
            "<mask> <pad> <cls> <sep>)"
            if flag == "--tokenizer-special-tokens"
            else "Megatron-LM's older name of --tokenizer-special-tokens",
        )
    group.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="Megatron-LM's older tokenizer classes: Llama2Tokenizer starts every text with "
        "BOS; TikTokenizer reads special tokens' text as text",
    )


def build_tokenizer(data: DataConfig) -> TextTokenizer | None:
    """The tokenizer `data.tokenizer_type` names, over the files its flags give; None for the
    mock corpus (which needs no tokenizer)."""
    if data.mock_data:
        return None
    return load_tokenizer(TokenizerSpec.from_flags(data))


def check_vocab_fits(tokenizer: TextTokenizer, model_vocab_size: int) -> None:
    """The model's (padded) vocabulary must hold every id the tokenizer can produce."""
    if tokenizer.vocab_size > model_vocab_size:
        raise SpecError(
            f"{tokenizer.source}: the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} tokens) does not fit the plan's model "
            f"vocab_size {model_vocab_size}; plan with a model whose vocab_size is "
            f">= {tokenizer.vocab_size}"
            + (
                f", or give --vocab-size {model_vocab_size - 1} or less (NullTokenizer's "
                f"vocabulary is --vocab-size ids and its end-of-document id)"
                if isinstance(tokenizer, NullTokenizer)
                else ""
            )
        )


def require_eod(tokenizer: TextTokenizer, flag: str) -> int:
    """The end-of-document id that `flag` needs; SpecError saying where it would come from."""
    if tokenizer.eod is not None:
        return tokenizer.eod
    if isinstance(tokenizer, SentencePieceTokenizer):
        hint = "the model has no end-of-sentence piece (train it with eos_id >= 0)"
    elif isinstance(tokenizer, GPT2BPETokenizer):
        hint = f"the vocabulary has no {GPT2_EOD}"
    else:
        hint = "name it eos_token in a tokenizer_config.json beside it"
    raise SpecError(f"{flag}: {tokenizer.source} has no end-of-document token ({hint})")


# NullTokenizer ------------------------------------------------------------------------------


class NullTokenizer:
    """--tokenizer-type NullTokenizer --vocab-size N: Megatron-LM's _NullTokenizer, for data that
    is already ids. `tokenize` is `[int(x) for x in text.split(' ')]`, except that an empty text
    is no ids and a piece that is not an integer is a ValueError naming it (Megatron-LM's
    int() error does not say where)."""

    def __init__(self, vocab_size: int) -> None:
        self.eod = int(vocab_size)  # the id after the N text ids
        self.vocab_size = self.eod + 1
        self.bos: int | None = None
        self.pad = NO_PAD
        self.source = f"--tokenizer-type NullTokenizer --vocab-size {vocab_size}"
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(
            {"class": type(self).__name__, "vocab_size": self.vocab_size}
        )

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        if text == "":
            return []
        ids = []
        for piece in text.split(" "):
            try:
                ids.append(int(piece))
            except ValueError:
                raise ValueError(
                    f"NullTokenizer reads integer ids separated by single spaces, not "
                    f"{piece[:40]!r}"
                ) from None
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        return " ".join(str(int(i)) for i in ids)
