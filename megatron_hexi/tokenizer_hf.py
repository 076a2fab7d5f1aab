"""The two --tokenizer-type kinds over the Hugging Face `tokenizers` library.

- `HuggingFaceTokenizer --tokenizer-model PATH`: a `tokenizer.json`, or a Hugging Face model
  directory holding one. A directory without it but with the GPT-2 files `vocab.json` and
  `merges.txt` (what older GPT-2 checkpoints ship) is read as GPT-2 byte-level BPE; one with only
  a SentencePiece `tokenizer.model` is refused with the SentencePieceTokenizer command to use.
  Special tokens come from `tokenizer_config.json` / `special_tokens_map.json` beside the files
  (`eos_token`, `bos_token`, `pad_token`), else from the vocabulary by their usual names. Ids are
  those of `transformers`' `tokenizer(text).input_ids`: the tokenizer's post-processor (a BOS,
  for Llama) is applied.
- `GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`: GPT-2 byte-level BPE, the
  ids of GPT-2's tokenizer; eod (and bos, as in GPT-2) is `<|endoftext|>`.

Why own classes for the two `tokenizers`-based kinds: megatron-core 0.16.1's HuggingFaceTokenizer
wraps `transformers.AutoTokenizer`, a large library that the runtime does not otherwise need (the
tests use it, as the reference these classes are checked against), and its GPT2BPETokenizer
("megatron" library) loads the "gpt2" tokenizer from the Hugging Face Hub (a network access) and
passes the vocab file where the merges file belongs. Both classes here need only the
`tokenizers` library and give the same ids as `transformers` for the same files.

Every problem with a flag or its files is a SpecError naming the flag and the path.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, SupportsInt

from planner.errors import SpecError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _Tokenizers

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

GPT2_EOD = "<|endoftext|>"  # GPT-2's end of text, also its bos and unk token
# tokenizer_config.json classes whose vocab.json + merges.txt are GPT-2 byte-level BPE.
GPT2_CLASSES = (None, "GPT2Tokenizer", "GPT2TokenizerFast")
MAX_TOKEN_ID = 2**31 - 1  # the largest id of megatron-core's widest token dtype (int32)
NO_PAD = -1  # megatron-core's own pad id when a tokenizer has none (nothing is masked)


def resolve_tokenizer_file(path: str | os.PathLike[str] | None) -> str:
    """The tokenizer.json that PATH (a file, or a directory with one) names; SpecError if none."""
    files = _huggingface_files(path)
    if files.tokenizer_json is None:
        raise SpecError(f"--tokenizer-model {files.directory}: directory has no tokenizer.json")
    return files.tokenizer_json


@dataclass(frozen=True)
class _HuggingFaceFiles:
    """What --tokenizer-model names: a tokenizer.json, or GPT-2's vocab.json + merges.txt."""

    directory: str
    tokenizer_json: str | None = None
    vocab_json: str | None = None
    merges_txt: str | None = None


def _huggingface_files(path: str | os.PathLike[str] | None) -> _HuggingFaceFiles:
    if path is None:
        raise SpecError(
            "--tokenizer-model PATH is required (a tokenizer.json file or a Hugging Face "
            "model directory)"
        )
    path = os.fspath(path)
    if os.path.isfile(path):
        return _HuggingFaceFiles(os.path.dirname(os.path.abspath(path)), tokenizer_json=path)
    if not os.path.isdir(path):
        raise SpecError(f"--tokenizer-model {path}: no such file or directory")
    here = {name for name in os.listdir(path) if os.path.isfile(os.path.join(path, name))}
    if "tokenizer.json" in here:
        return _HuggingFaceFiles(path, tokenizer_json=os.path.join(path, "tokenizer.json"))
    if {"vocab.json", "merges.txt"} <= here:
        return _HuggingFaceFiles(
            path,
            vocab_json=os.path.join(path, "vocab.json"),
            merges_txt=os.path.join(path, "merges.txt"),
        )
    if "tokenizer.model" in here:
        raise SpecError(
            f"--tokenizer-model {path}: directory has no tokenizer.json, only a SentencePiece "
            f"tokenizer.model: use --tokenizer-type SentencePieceTokenizer --tokenizer-model "
            f"{os.path.join(path, 'tokenizer.model')}"
        )
    lacking = (
        "merges.txt beside its vocab.json"
        if "vocab.json" in here
        else "vocab.json beside its merges.txt"
        if "merges.txt" in here
        else "vocab.json + merges.txt"
    )
    raise SpecError(
        f"--tokenizer-model {path}: directory has no tokenizer.json and no {lacking} "
        f"(a Hugging Face tokenizer directory holds one of them)"
    )


def _read_json_object(path: str, flag: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecError(f"{flag}: cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise SpecError(f"{flag}: {path} is not a JSON object")
    return value


def _tokenizer_config(directory: str) -> dict[str, Any]:
    """special_tokens_map.json overlaid with tokenizer_config.json (transformers' order); tokens
    given as {"content": ...} are flattened to their text."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            config.update(_read_json_object(path, "--tokenizer-model"))
    for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            config[key] = value
        else:
            config.pop(key, None)
    return config


def _special_id(
    tokenizer: _Tokenizers, configured: str | None, names: Iterable[str], source: str
) -> int | None:
    """The id of the configured token, else of the first of `names` in the vocabulary."""
    if configured is not None:
        token_id = tokenizer.token_to_id(configured)
        if token_id is None:
            raise SpecError(
                f"{source}: special token {configured!r} named in its config is not in the "
                f"vocabulary"
            )
        return token_id
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _byte_level_bpe(
    vocab_file: str, merge_file: str, vocab_flag: str, merge_flag: str, add_prefix_space: bool
) -> _Tokenizers:
    """GPT-2's tokenizer from its two files: byte-level pre-tokenizer with GPT-2's regex, BPE
    with the merges in file order, byte-level decoder (what transformers' GPT2Tokenizer builds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if not os.path.isfile(vocab_file):
        raise SpecError(f"{vocab_flag} {vocab_file}: no such file")
    if not os.path.isfile(merge_file):
        raise SpecError(f"{merge_flag} {merge_file}: no such file")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecError(f"{vocab_flag} {vocab_file}: not a GPT-2 vocab.json ({e})") from None
    if not (
        isinstance(vocab, dict)
        and vocab
        and all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values())
    ):
        raise SpecError(
            f"{vocab_flag} {vocab_file}: not a GPT-2 vocab.json (a JSON object of token -> id)"
        )
    # tokenizers stores ids as 32-bit numbers (2**40 silently becomes 0) and keeps one token of
    # an id given twice: both would make the ids differ from the file's.
    out_of_range = [(t, i) for t, i in vocab.items() if not 0 <= i <= MAX_TOKEN_ID]
    if out_of_range:
        token, token_id = out_of_range[0]
        raise SpecError(
            f"{vocab_flag} {vocab_file}: token {token!r} has id {token_id}, outside "
            f"[0, {MAX_TOKEN_ID}]"
        )
    if len(set(vocab.values())) != len(vocab):
        seen: dict[int, str] = {}
        for token, token_id in vocab.items():
            if token_id in seen:
                raise SpecError(
                    f"{vocab_flag} {vocab_file}: tokens {seen[token_id]!r} and {token!r} both "
                    f"have id {token_id}"
                )
            seen[token_id] = token
    try:
        model = models.BPE.from_file(vocab_file, merge_file)
    except Exception as e:  # tokenizers raises plain Exception
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "out of vocabulary" in message:
            raise SpecError(
                f"{merge_flag} {merge_file}: a merge uses a token that {vocab_flag} "
                f"{vocab_file} does not hold ({message})"
            ) from None
        raise SpecError(f"{merge_flag} {merge_file}: not a GPT-2 merges.txt ({message})") from None
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class _TokenizersTokenizer:
    """The megatron-core tokenizer interface over a `tokenizers.Tokenizer`."""

    source: str
    eod: int | None
    bos: int | None
    pad: int
    unique_identifiers: OrderedDict[str, Any]

    def __init__(self, tokenizer: _Tokenizers) -> None:
        self._tokenizer = tokenizer
        # The largest id + 1, not the count: every id must fit the model's embedding.
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(
            tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1
        )

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

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[SupportsInt]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_TokenizersTokenizer):
    """--tokenizer-type HuggingFaceTokenizer: a tokenizer.json, or a model directory."""

    def __init__(self, tokenizer_model: str | os.PathLike[str] | None) -> None:
        from tokenizers import Tokenizer

        files = _huggingface_files(tokenizer_model)
        config = _tokenizer_config(files.directory)
        if files.tokenizer_json is not None:
            self.path = files.tokenizer_json
            self.source = f"--tokenizer-model {self.path}"
            try:
                tokenizer = Tokenizer.from_file(self.path)
            except Exception as e:  # tokenizers raises plain Exception on malformed files
                hint = (
                    "; a SentencePiece model is read by --tokenizer-type SentencePieceTokenizer"
                    if self.path.endswith(".model")
                    else "; GPT-2's vocab.json and merges.txt are read by --tokenizer-type "
                    "GPT2BPETokenizer, or as a directory holding both"
                    if os.path.basename(self.path) == "vocab.json"
                    else ""
                )
                raise SpecError(
                    f"--tokenizer-model {self.path}: not a Hugging Face tokenizers file "
                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__}){hint}"
                ) from None
            paths = [os.path.abspath(self.path)]
        else:
            assert files.vocab_json is not None and files.merges_txt is not None
            self.path = files.directory
            self.source = f"--tokenizer-model {self.path}"
            tokenizer = self._gpt2_files(files.vocab_json, files.merges_txt, config)
            if tokenizer.token_to_id(GPT2_EOD) is not None:  # GPT-2's bos, unless configured
                config.setdefault("bos_token", GPT2_EOD)
            paths = [os.path.abspath(files.vocab_json), os.path.abspath(files.merges_txt)]
        super().__init__(tokenizer)
        self.eod = _special_id(tokenizer, config.get("eos_token"), EOD_NAMES, self.source)
        self.bos = _special_id(tokenizer, config.get("bos_token"), BOS_NAMES, self.source)
        pad = _special_id(tokenizer, config.get("pad_token"), PAD_NAMES, self.source)
        # megatron-core masks labels equal to `pad`; -1 (its own default) when there is none.
        self.pad = NO_PAD if pad is None else pad
        self.unique_identifiers = OrderedDict(
            {"class": type(self).__name__, "tokenizer_path": paths}
        )

    def _gpt2_files(self, vocab_json: str, merges_txt: str, config: dict[str, Any]) -> _Tokenizers:
        """A directory with GPT-2's files and no tokenizer.json, as transformers' GPT2Tokenizer
        reads it: its config's add_prefix_space and add_bos_token, its added tokens."""
        from tokenizers import AddedToken, processors

        cls = config.get("tokenizer_class")
        if cls not in GPT2_CLASSES:
            raise SpecError(
                f"{self.source}: directory has no tokenizer.json, and its vocab.json + "
                f"merges.txt belong to a {cls}; only GPT-2's are read without a tokenizer.json "
                f"(save the tokenizer with transformers to write one)"
            )
        tokenizer = _byte_level_bpe(
            vocab_json,
            merges_txt,
            "--tokenizer-model",
            "--tokenizer-model",
            add_prefix_space=bool(config.get("add_prefix_space", False)),
        )
        # Added tokens: tokenizer_config.json's added_tokens_decoder and added_tokens.json, in
        # id order; each must keep its id (new ones follow the vocabulary without a gap).
        added: dict[int, tuple[str, bool]] = {}
        entries = config.get("added_tokens_decoder") or {}
        added_json = os.path.join(self.path, "added_tokens.json")
        from_json = (
            _read_json_object(added_json, "--tokenizer-model") if os.path.isfile(added_json) else {}
        )
        try:
            for key, entry in entries.items():
                added[int(key)] = (str(entry["content"]), bool(entry.get("special", True)))
            for token, token_id in from_json.items():
                added.setdefault(int(token_id), (token, True))
        except (AttributeError, KeyError, TypeError, ValueError):
            raise SpecError(
                f"{self.source}: malformed added tokens (added_tokens_decoder in "
                f"tokenizer_config.json, or added_tokens.json)"
            ) from None
        names = ("eos_token", "bos_token", "pad_token", "unk_token")
        specials = {GPT2_EOD} | {config[k] for k in names if k in config}
        for token_id, (token, special) in sorted(added.items()):
            known = tokenizer.token_to_id(token)
            expected = tokenizer.get_vocab_size(with_added_tokens=True)
            if (known is None and token_id != expected) or (
                known is not None and known != token_id
            ):
                raise SpecError(
                    f"{self.source}: added token {token!r} has id {token_id}, but the "
                    f"vocabulary gives it {expected if known is None else known}"
                )
            tokenizer.add_tokens([AddedToken(token, special=special)])
            specials.discard(token)
        # transformers matches its special tokens in the text before BPE.
        tokenizer.add_special_tokens(
            [
                AddedToken(t, special=True)
                for t in sorted(specials)
                if tokenizer.token_to_id(t) is not None
            ]
        )
        if config.get("add_bos_token"):
            bos = config.get("bos_token", GPT2_EOD)
            bos_id = tokenizer.token_to_id(bos)
            if bos_id is None:
                raise SpecError(f"{self.source}: add_bos_token, but {bos!r} is not a token")
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        return tokenizer


class GPT2BPETokenizer(_TokenizersTokenizer):
    """--tokenizer-type GPT2BPETokenizer: GPT-2's vocab.json and merges.txt. `<|endoftext|>` in
    the text is that token, as transformers' GPT-2 tokenizer (which Megatron-LM's current
    GPT2BPETokenizer wraps) reads it."""

    def __init__(self, vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]):
        from tokenizers import AddedToken

        vocab, merges = os.fspath(vocab_file), os.fspath(merge_file)
        self.source = f"--vocab-file {vocab} --merge-file {merges}"
        tokenizer = _byte_level_bpe(
            vocab, merges, "--vocab-file", "--merge-file", add_prefix_space=False
        )
        if tokenizer.token_to_id(GPT2_EOD) is not None:
            tokenizer.add_special_tokens([AddedToken(GPT2_EOD, special=True)])
        super().__init__(tokenizer)
        self.eod = self.bos = tokenizer.token_to_id(GPT2_EOD)
        self.pad = NO_PAD  # GPT-2 has no pad token
        self.unique_identifiers = OrderedDict(
            {
                "class": type(self).__name__,
                "tokenizer_path": [os.path.abspath(vocab), os.path.abspath(merges)],
            }
        )
