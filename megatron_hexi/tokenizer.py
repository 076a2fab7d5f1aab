"""A Hugging Face `tokenizers` file as the tokenizer megatron-core's datasets need.

`--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`: PATH is a `tokenizer.json` file or
a directory holding one (a Hugging Face model directory). Special tokens come from the
`tokenizer_config.json` / `special_tokens_map.json` beside it when present (`eos_token`,
`bos_token`, `pad_token`), else from the tokenizer's own special tokens by their usual names.

Megatron-LM's HuggingFaceTokenizer wraps `transformers.AutoTokenizer`; this one needs only the
`tokenizers` library and gives the same ids for the same tokenizer.json: `tokenize` applies the
tokenizer's post-processor (BOS etc.) as transformers does, `vocab_size` counts added tokens.
"""

import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, SupportsInt

from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron_hexi.config import DataConfig

# Megatron-LM's --tokenizer-type names this runtime reads, and the flags naming each one's files.
TOKENIZER_FILES = {
    "HuggingFaceTokenizer": ("--tokenizer-model",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
}
TOKENIZER_TYPES = tuple(TOKENIZER_FILES)

# Tried in order when no tokenizer_config.json names the token.
EOD_NAMES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
    "<EOS>",
    "<|im_end|>",
    "[SEP]",
)
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]", "<BOS>", "[CLS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<PAD>", "<|padding|>")


def resolve_tokenizer_file(path: str | os.PathLike[str] | None) -> str:
    """The tokenizer.json that PATH (a file, or a directory with one) names; SpecError if none."""
    if path is None:
        raise SpecError(
            "--tokenizer-model PATH is required (a tokenizer.json file or a directory with one)"
        )
    path = os.fspath(path)
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise SpecError(
                f"--tokenizer-model {path}: directory has no tokenizer.json "
                f"(a Hugging Face `tokenizers` file is needed)"
            )
        return candidate
    if not os.path.isfile(path):
        raise SpecError(f"--tokenizer-model {path}: no such file or directory")
    return path


def _configured_tokens(directory: str) -> dict[str, str]:
    """{'eos_token': str, ...} from tokenizer_config.json and special_tokens_map.json, if any."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise SpecError(f"--tokenizer-model: cannot read {path}: {e}") from None
        for key in ("eos_token", "bos_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


class HuggingFaceTokenizer:
    """vocab_size, eod, bos, pad, unique_identifiers, tokenize/detokenize over a tokenizer.json."""

    def __init__(self, tokenizer_model: str | os.PathLike[str] | None) -> None:
        from tokenizers import Tokenizer

        self.path = resolve_tokenizer_file(tokenizer_model)
        try:
            self._tokenizer = Tokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises plain Exception on malformed files
            raise SpecError(
                f"--tokenizer-model {self.path}: not a Hugging Face tokenizers file "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        configured = _configured_tokens(os.path.dirname(os.path.abspath(self.path)))
        self.eod = self._special_id(configured.get("eos_token"), EOD_NAMES)
        self.bos = self._special_id(configured.get("bos_token"), BOS_NAMES)
        pad = self._special_id(configured.get("pad_token"), PAD_NAMES)
        # megatron-core masks labels equal to `pad`; -1 (its own default) when there is none.
        self.pad = -1 if pad is None else pad
        self.unique_identifiers = OrderedDict(
            {"class": type(self).__name__, "tokenizer_path": [os.path.abspath(self.path)]}
        )

    def _special_id(self, configured: str | None, names: Iterable[str]) -> int | None:
        if configured is not None:
            token_id = self._tokenizer.token_to_id(configured)
            if token_id is None:
                raise SpecError(
                    f"--tokenizer-model {self.path}: special token {configured!r} "
                    f"named in its config is not in the vocabulary"
                )
            return token_id
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    # megatron-core's tokenizer interface ------------------------------------------------------
    @property
    def eos(self) -> int | None:
        return self.eod

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def check_vocab_fits(tokenizer: HuggingFaceTokenizer, model_vocab_size: int) -> None:
    """The model's (padded) vocabulary must hold every id the tokenizer can produce."""
    if tokenizer.vocab_size > model_vocab_size:
        raise SpecError(
            f"--tokenizer-model {tokenizer.path}: the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} tokens) does not fit the plan's model "
            f"vocab_size {model_vocab_size}; plan with a model whose vocab_size is "
            f">= {tokenizer.vocab_size}"
        )


def build_tokenizer(data: DataConfig) -> HuggingFaceTokenizer | None:
    """The tokenizer `data.tokenizer_type` names, over the files its flags give; None for the
    mock corpus (which needs no tokenizer)."""
    if data.mock_data:
        return None
    if data.tokenizer_type != "HuggingFaceTokenizer":
        raise SpecError(f"--tokenizer-type {data.tokenizer_type}: not supported yet")
    return HuggingFaceTokenizer(data.tokenizer_model)
