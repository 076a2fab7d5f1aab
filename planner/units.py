"""Parse bandwidths, latencies and sizes written with units ("25 Gbit/s", "16 GB/s", "50 us").

Internally every bandwidth is bytes per second, every latency seconds, every size bytes.
"""

import math
import re

from planner.errors import SpecError
from planner.limits import MAX_BANDWIDTH, MAX_LATENCY_S, MAX_UNIT_TEXT_CHARS, MIN_BANDWIDTH

# Named link presets: usable one-direction bandwidth per GPU in bytes/s, with sources.
#   nvlink  : NVLink 3 (A100), 600 GB/s total per GPU, 300 GB/s per direction (A100 datasheet)
#   nvlink4 : NVLink 4 (H100), 900 GB/s total per GPU, 450 GB/s per direction (H100 datasheet)
#   pcie4   : PCIe 4.0 x16, ~25 GB/s per direction in practice (32 GB/s raw, 128b/130b, TLP
#             overhead)
#   pcie5   : PCIe 5.0 x16, ~50 GB/s per direction in practice (64 GB/s raw)
#   host    : GPUs without peer-to-peer (GeForce) copy through host memory: device->host->device
#             over PCIe 4.0, stated assumption ~12 GB/s effective (two PCIe hops, pinned buffers).
LINK_PRESETS = {
    "nvlink": 300e9,
    "nvlink3": 300e9,
    "nvlink4": 450e9,
    "pcie3": 12e9,
    "pcie4": 25e9,
    "pcie5": 50e9,
    "host": 12e9,
}

_BW_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_UNIT = re.compile(r"([kKmMgGtT]?)([bB].*)")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE_UNITS = {
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]+)\s*$")


def _split(text: object, where: str) -> tuple[float, str]:
    text = str(text)
    m = _NUMBER_UNIT.match(text) if len(text) <= MAX_UNIT_TEXT_CHARS else None
    if not m:
        shown = (
            repr(text)
            if len(text) <= MAX_UNIT_TEXT_CHARS
            else repr(text[: MAX_UNIT_TEXT_CHARS - 4]) + "..."
        )
        raise SpecError(f"{where}: cannot read {shown}: expected a number with a unit")
    return float(m.group(1)), m.group(2)


def _bandwidth_factor(unit: str, value: object, where: str) -> float:
    """Bytes/s per unit of `unit`. Bits or bytes is decided by the b/B letter alone, the rest of
    the unit in any case: `bit`/`bits` and lower-case `bps` are bits, `B/s` and `byte/s` bytes;
    `b/s` and `Bps` (any case of the rest) could be either and are refused."""
    m = _BW_UNIT.fullmatch(unit)
    if m:
        scale = _BW_PREFIXES[m.group(1).lower()]
        body, folded = m.group(2), m.group(2).lower()
        if folded in ("bit/s", "bits/s") or body == "bps":
            return scale / 8
        if folded in ("byte/s", "bytes/s") or (body[0] == "B" and folded == "b/s"):
            return scale
        if folded in ("b/s", "bps"):
            prefix = m.group(1).upper()
            raise SpecError(
                f"{where}: unit {unit!r} is ambiguous; write {prefix}bit/s or {prefix}B/s"
            )
    raise SpecError(
        f"{where}: unknown bandwidth unit {unit!r} in {value!r} "
        f"(use Gbit/s, GB/s, Mbit/s, MB/s or a preset)"
    )


def parse_bandwidth(value: object, where: str = "bandwidth") -> float:
    """Bytes/s from "25 Gbit/s", "16 GB/s" or a preset name (nvlink, pcie4, host, ...).

    Case matters for bit vs byte: "Gbit/s"/"Gbps" are bits, "GB/s" bytes ("Gb/s" and "GBps" are
    refused as ambiguous). The result is finite and within planner/limits.py's bounds.
    """
    if isinstance(value, str) and value.strip().lower() in LINK_PRESETS:
        return LINK_PRESETS[value.strip().lower()]
    if isinstance(value, bool) or not isinstance(value, str):
        raise SpecError(
            f"{where}: {value!r} has no unit; write e.g. \"25 Gbit/s\" or \"16 GB/s\" "
            f"or a preset ({', '.join(sorted(LINK_PRESETS))})"
        )
    number, unit = _split(value, where)
    factor = _bandwidth_factor(unit, value, where)
    result = number * factor
    if number <= 0:
        raise SpecError(f"{where}: bandwidth must be positive, got {value!r}")
    if not math.isfinite(result):
        raise SpecError(f"{where}: {value!r} is not a finite bandwidth")
    if not MIN_BANDWIDTH <= result <= MAX_BANDWIDTH:
        raise SpecError(
            f"{where}: {value!r} is outside {MIN_BANDWIDTH:g} B/s .. "
            f"{MAX_BANDWIDTH:g} B/s (limits in planner/limits.py)"
        )
    return result


def parse_latency(value: object, where: str = "latency") -> float:
    """Seconds from "50 us", "1.5 ms", "0 s"."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise SpecError(f"{where}: {value!r} has no unit; write e.g. \"50 us\"")
    number, unit = _split(value, where)
    factor = _TIME_UNITS.get(unit.lower() if unit != "µs" else unit)
    if factor is None:
        raise SpecError(f"{where}: unknown time unit {unit!r} in {value!r} (use s, ms, us, ns)")
    result = number * factor
    if not math.isfinite(result):
        raise SpecError(f"{where}: {value!r} is not a finite time")
    if result > MAX_LATENCY_S:
        raise SpecError(
            f"{where}: {value!r} is above {MAX_LATENCY_S:g} s (limits in planner/limits.py)"
        )
    return result


def parse_size(value: object, where: str = "size") -> float:
    """Bytes from "24 GB", "80 GiB" or a plain number of bytes; finite and >= 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        number, unit = _split(value, where)
        factor = _SIZE_UNITS.get(unit.lower())
        if factor is None:
            raise SpecError(f"{where}: unknown size unit {unit!r} in {value!r} (use GB, GiB, MB)")
        result = number * factor
    if not math.isfinite(result) or result < 0:
        raise SpecError(f"{where}: {value!r} is not a finite size")
    return result


def format_bandwidth(bytes_per_s: float) -> str:
    """The canonical text form written into plans: GB/s with enough digits to round-trip."""
    return f"{bytes_per_s / 1e9:.6g} GB/s"


def format_latency(seconds: float) -> str:
    return f"{seconds * 1e6:.6g} us"
