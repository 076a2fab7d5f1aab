"""Integrity: CRC-32 checksums of fixed-size blocks of each tensor's bytes, the NaN/inf checks
a save and a load make, and the checksum of checkpoint.json's own content.

Blocks, not whole tensors, so that verifying costs what reading costs: a load checks only the
blocks that overlap the bytes it reads (`overlapping_blocks`), each block once per tensor.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from megatron_hexi.checkpoint.format import Entry, entry_key

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer

# CRC-32 (zlib) of each block of a tensor's bytes. The checksums guard against accidents (a bad
# disk, a copy cut short, a file of another save, an edit): they sit next to the data, so a
# cryptographic hash would add no protection against someone who rewrites both, and CRC-32
# catches every burst of up to 32 flipped bits in a block. It is what keeps verification cheap:
# tools/bench/checkpoint_verify.py measures 4.2 GB/s on one core, against 1.7 for sha256 and 0.9
# for blake2b (docs/benchmarks.md).
CHECKSUM = "crc32"
# Bytes per checksum block. CRC-32 runs about as fast on blocks of 256 KiB and more as on whole
# tensors (16 KiB: 18% slower, the per-call overhead); larger blocks make a rank check more bytes
# than it reads at the ends of its slices, smaller ones a larger checkpoint.json (an 8-hex-digit
# entry per block: under 2 MB per 100 GB of tensors at 1 MiB).
BLOCK_BYTES = 1 << 20
HEX32 = re.compile(r"[0-9a-f]{8}")  # one block's checksum as checkpoint.json writes it


def crc32_hex(data: np.ndarray) -> str:
    """CRC-32 of a contiguous array's bytes, 8 hex digits. (An ndarray is a buffer; numpy's type
    stubs say so only for Python >= 3.12.)"""
    return f"{zlib.crc32(cast('Buffer', data)):08x}"


def block_checksums(tensor: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """CRC-32 (8 hex digits) of each `block_bytes` block of a contiguous CPU tensor's bytes,
    exactly as safetensors stores them (the last block may be shorter; none if it is empty)."""
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    return [crc32_hex(data[i : i + block_bytes]) for i in range(0, data.size, block_bytes)]


def overlapping_blocks(
    shape: Sequence[int], itemsize: int, dim: int, a: int, b: int, block_bytes: int
) -> np.ndarray:
    """Boolean array over the blocks of a row-major tensor of `shape`: True where a block holds
    bytes of the slice [a, b) along `dim` (one byte run per index of the dimensions before it)."""
    inner = itemsize
    for n in shape[dim + 1 :]:
        inner *= n
    outer = 1
    for n in shape[:dim]:
        outer *= n
    nbytes = outer * shape[dim] * inner
    nblocks = -(-nbytes // block_bytes)
    if nbytes == 0 or b <= a:
        return np.zeros(nblocks, dtype=bool)
    first = a * inner + shape[dim] * inner * np.arange(outer, dtype=np.int64)
    last = first + (b - a) * inner - 1
    # +1 where a run starts, -1 after the block where it ends: the running sum is > 0 on blocks
    # some run overlaps (runs are sorted and disjoint).
    marks = np.bincount(first // block_bytes, minlength=nblocks + 1) - np.bincount(
        last // block_bytes + 1, minlength=nblocks + 1
    )
    return np.cumsum(marks[:nblocks]) > 0


def blocks_bytes(blocks: npt.ArrayLike, block_bytes: int, nbytes: int) -> int:
    """Bytes in the blocks `blocks` (indices) of a tensor of `nbytes` bytes cut into blocks of
    `block_bytes`, the last one shorter when `block_bytes` does not divide `nbytes` (what a
    verified read checks; the benchmark computes the same for other block sizes)."""
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    total = blocks.size * block_bytes
    last = -(-nbytes // block_bytes) - 1
    if blocks.size and blocks.max() == last:
        total -= (last + 1) * block_bytes - nbytes
    return int(total)


# Rows of a bfloat16 tensor checked per numpy call (bounds the temporary of the bit test).
FINITE_CHUNK = 1 << 20


def non_finite(t: torch.Tensor) -> bool:
    """True if the CPU tensor `t` (any strides) holds NaN or inf. numpy, not torch: numpy runs a
    reduction on the calling thread alone and releases the GIL, so the verification threads do
    not each start a team of torch's intra-op threads. min and max propagate NaN and need no
    temporary: the extremes are finite iff every value is. numpy has no bfloat16: its bits are
    tested instead (exponent all ones: inf or NaN), a chunk of rows at a time."""
    if t.numel() == 0:
        return False
    if t.dtype != torch.bfloat16:
        a = t.numpy()
        return not (np.isfinite(a.min()) and np.isfinite(a.max()))
    bits = np.atleast_1d(t.view(torch.int16).numpy().view(np.uint16))
    rows = max(1, FINITE_CHUNK // max(1, bits[0].size))
    return any(
        int((bits[i : i + rows] & 0x7FFF).max()) >= 0x7F80 for i in range(0, bits.shape[0], rows)
    )


def meta_checksum(meta: Mapping[str, Any]) -> str:
    """Checksum of checkpoint.json's content (every key but 'checksum'), in a canonical form."""
    text = json.dumps(
        {k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True, separators=(",", ":")
    )
    return f"{CHECKSUM}:{zlib.crc32(text.encode()):08x}"


def first_non_finite(entries: Sequence[Entry]) -> tuple[int, str | None]:
    """(number of entries whose tensor holds NaN or inf, "KIND of NAME (tensor KEY)" of the
    first). torch.aminmax on the tensors where they live (one pass each, NaN propagates: the
    extremes are finite iff every value is), one transfer for all."""
    extremes = [
        (i, torch.stack(torch.aminmax(e.tensor.detach())))
        for i, e in enumerate(entries)
        if e.tensor.numel()
    ]
    if not extremes:
        return 0, None
    finite = torch.stack([x for _, x in extremes]).isfinite().all(dim=1).cpu().tolist()
    bad = [i for (i, _), ok in zip(extremes, finite) if not ok]
    if not bad:
        return 0, None
    e = entries[bad[0]]
    return len(bad), f"{e.kind} of {e.name} (tensor {entry_key(e.kind, e.name, e.start)})"
