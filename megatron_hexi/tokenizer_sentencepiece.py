"""The SentencePiece kinds of --tokenizer-type, over one `tokenizer.model`.

- `SentencePieceTokenizer`: megatron-core's own SentencePieceTokenizer (`megatron.core.tokenizers`,
  library "sentencepiece"), the one Megatron-LM builds for this name: ids are the model's
  `encode` (no BOS added), eod is its `</s>` (eos id), bos its `<s>`, pad its pad piece or -1.
- `Llama2Tokenizer`: Megatron-LM (pinned release) builds the same megatron-core tokenizer for this
  name, so the ids are the same. With `--legacy-tokenizer` it is Megatron-LM's older
  `_Llama2Tokenizer` (megatron/training/tokenizer/tokenizer.py): every text starts with the
  model's BOS id (`tokenize(s, bos=True, eos=False)`), eod is the eos id, and there is no pad
  (megatron-core's datasets then mask nothing).

The file is checked before sentencepiece reads it: sentencepiece aborts the process on a
directory and raises bare RuntimeErrors otherwise.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

from planner.errors import SpecError

NO_PAD = -1  # megatron-core's own pad id when a tokenizer has none (nothing is masked)


class SentencePieceTokenizer:
    """--tokenizer-type SentencePieceTokenizer: megatron-core's tokenizer of that library over a
    tokenizer.model (a directory holding one is also taken)."""

    type_name = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: str | os.PathLike[str] | None) -> None:
        if tokenizer_model is None:
            raise SpecError("--tokenizer-model PATH is required (a SentencePiece tokenizer.model)")
        path = os.fspath(tokenizer_model)
        if os.path.isdir(path):
            inside = os.path.join(path, "tokenizer.model")
            if not os.path.isfile(inside):
                raise SpecError(
                    f"--tokenizer-model {path}: directory has no tokenizer.model "
                    f"(a SentencePiece model)"
                )
            path = inside
        elif not os.path.isfile(path):
            raise SpecError(f"--tokenizer-model {path}: no such file or directory")
        self.path = path
        self.source = f"--tokenizer-model {path}"
        try:
            import sentencepiece  # noqa: F401 - megatron-core needs it; say so clearly
        except ImportError:
            raise SpecError(
                f"--tokenizer-type {self.type_name} needs the sentencepiece package "
                f"(pip install sentencepiece)"
            ) from None
        from megatron.core.tokenizers import MegatronTokenizer

        try:
            self._core = MegatronTokenizer.from_pretrained(
                tokenizer_path=path, metadata_path={"library": "sentencepiece"}
            )
        except (RuntimeError, OSError, ValueError) as e:
            hint = (
                "; a tokenizer.json is read by --tokenizer-type HuggingFaceTokenizer"
                if path.endswith(".json")
                else ""
            )
            raise SpecError(
                f"--tokenizer-model {path}: not a SentencePiece model "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}){hint}"
            ) from None
        self.vocab_size: int = self._core.vocab_size
        # sentencepiece says -1 for a piece the model does not define.
        self.eod = _defined(self._core.eod)
        self.bos = _defined(self._core.bos)
        pad = _defined(self._core.pad)
        self.pad = NO_PAD if pad is None else pad
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(
            {"class": type(self).__name__, "tokenizer_path": [os.path.abspath(path)]}
        )

    @property
    def eos(self) -> int | None:
        return self.eod

    @property
    def vocab(self) -> dict[str, int]:
        return {piece: i for i, piece in enumerate(self._core.vocab)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return dict(enumerate(self._core.vocab))

    def tokenize(self, text: str) -> list[int]:
        return list(self._core.tokenize(text))

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        return self._core.detokenize([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """--tokenizer-type Llama2Tokenizer: SentencePieceTokenizer's ids; with `legacy`
    (--legacy-tokenizer) Megatron-LM's `_Llama2Tokenizer`, which starts every text with BOS."""

    type_name = "Llama2Tokenizer"

    def __init__(self, tokenizer_model: str | os.PathLike[str] | None, legacy: bool = False):
        super().__init__(tokenizer_model)
        self.legacy = legacy
        if legacy:
            if self.bos is None:
                raise SpecError(
                    f"{self.source}: --legacy-tokenizer's Llama2Tokenizer starts every text with "
                    f"the model's BOS, but the model has no beginning-of-sentence piece (train "
                    f"it with bos_id >= 0, or drop --legacy-tokenizer)"
                )
            self.pad = NO_PAD  # _Llama2Tokenizer has no pad: megatron-core masks nothing
            self.unique_identifiers["legacy"] = True

    def tokenize(self, text: str) -> list[int]:
        ids = super().tokenize(text)
        if self.legacy:
            assert self.bos is not None  # checked in __init__
            return [self.bos, *ids]
        return ids


def _defined(token_id: int | None) -> int | None:
    return None if token_id is None or token_id < 0 else int(token_id)
