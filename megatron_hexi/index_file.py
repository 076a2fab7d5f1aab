"""A megatron-core .idx file checked against its own size and its .bin before any index is built.

megatron-core trusts the .idx: a sequence count larger than the file ends in a traceback from
numpy, a length that lies (in the middle of the file or at its end) in std::bad_alloc or in
samples read from the wrong bytes, and lengths that are all 0 in an endless epoch count. Here the
header, the three arrays and the pointers (which megatron-core's writer derives from the lengths)
are checked in blocks of BLOCK entries, so the check's memory does not grow with the file.

Layout (megatron-core's _IndexWriter): 9-byte magic, version (uint64, 1), token dtype code
(uint8), sequence count S and document count D (uint64 each), then S int32 lengths, S int64 byte
pointers into the .bin, D int64 document indices (0, ..., S, non-decreasing).
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

import numpy as np

from planner.errors import SpecError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34
# megatron-core's DType codes of integer token types, with their sizes in bytes
TOKEN_DTYPES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 8: 2}
BLOCK = 1 << 20


class IndexSummary(NamedTuple):
    """What the split check needs of a checked .idx: its sequence lengths (memory-mapped)."""

    lengths: np.ndarray
    tokens: int


def check_index(prefix: str, flag: str) -> IndexSummary:
    """PREFIX.idx is a well-formed megatron-core index whose sequences lie inside PREFIX.bin and
    hold at least one token; SpecError (naming the file and what is wrong) otherwise."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"

    def refuse(what: str) -> SpecError:
        return SpecError(f"{flag} {prefix}: {idx}: {what}")

    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise refuse("not a megatron-core index (no MMIDIDX header)")
    version, code, count, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise refuse(f"index version {version}; megatron-core reads version 1")
    if code not in TOKEN_DTYPES:
        raise refuse(f"token dtype code {code} is not an integer type megatron-core writes")
    expected = HEADER_BYTES + 12 * count + 8 * docs
    if size != expected:
        raise refuse(
            f"{size:,} bytes, but its header ({count:,} sequences, {docs:,} document "
            f"indices) needs {expected:,} (truncated, or not written by megatron-core)"
        )
    if docs < 1:
        raise refuse("no document indices (megatron-core writes at least the first, 0)")
    itemsize = TOKEN_DTYPES[code]
    data = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(data, np.int32, count, HEADER_BYTES)
    pointers = np.frombuffer(data, np.int64, count, HEADER_BYTES + 4 * count)
    indices = np.frombuffer(data, np.int64, docs, HEADER_BYTES + 12 * count)
    position, tokens = 0, 0  # the byte where the next sequence must start
    for start in range(0, count, BLOCK):
        block = lengths[start : start + BLOCK].astype(np.int64)
        if block.size and block.min() < 0:
            i = start + int(np.argmax(block < 0))
            raise refuse(f"sequence {i:,} has length {int(lengths[i])}")
        ends = position + np.cumsum(block * itemsize)
        starts = np.concatenate(([position], ends[:-1]))
        wrong = np.nonzero(pointers[start : start + BLOCK] != starts)[0]
        if wrong.size:
            i = start + int(wrong[0])
            raise refuse(
                f"sequence {i:,} starts at byte {int(pointers[i]):,} of the .bin, but the "
                f"lengths before it end at byte {int(starts[wrong[0]]):,} (a length or "
                f"pointer is wrong)"
            )
        position = int(ends[-1]) if ends.size else position
        tokens += int(block.sum())
    for start in range(0, docs, BLOCK):
        block = indices[max(start - 1, 0) : start + BLOCK]
        if block.size > 1 and (np.diff(block) < 0).any():
            raise refuse("document indices decrease")
    if indices[0] != 0 or indices[-1] != count:
        raise refuse(
            f"document indices run from {int(indices[0])} to {int(indices[-1])}, not from 0 "
            f"to the sequence count {count:,}"
        )
    bin_size = os.path.getsize(bin_path)
    if bin_size < position:
        raise SpecError(
            f"{flag} {prefix}: {bin_path} has {bin_size} bytes, its .idx needs {position} "
            f"(truncated, or not the .bin of this .idx)"
        )
    if tokens == 0:
        raise refuse(
            f"its {count:,} sequences hold no tokens (megatron-core would look for them forever)"
        )
    return IndexSummary(lengths, tokens)
