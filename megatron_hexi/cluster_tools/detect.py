"""`hexi-cluster detect`: this machine's entry for the cluster spec's `nodes:` list.

GPU model (torch.cuda, else nvidia-smi) mapped to the catalog, GPU count, NVLink vs PCIe from
`nvidia-smi topo -m`, NIC speed from /sys/class/net and /sys/class/infiniband. Everything it could
not see is said in a comment of the snippet, never guessed silently.
"""

import glob
import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from planner.catalog import GpuType, gpu_catalog, match_device_name
from planner.errors import SpecError

# How the helpers run a command (subprocess.run; tests pass a fake).
Runner = Callable[..., subprocess.CompletedProcess[str]]

# GeForce cards have no GPU peer-to-peer: transfers go through host memory (preset `host`).
_NO_P2P = {"RTX-4090", "RTX-3090", "RTX-3080-Ti"}
_NVLINK4 = {"H100-SXM", "H100-PCIE", "H200"}


class DetectError(SpecError):
    """Nothing usable to describe (no GPU without --allow-cpu, unknown model, mixed models)."""


def _run(args: list[str], run: Runner = subprocess.run) -> str | None:
    try:
        r = run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def gpu_names(run: Runner = subprocess.run) -> tuple[list[str], str | None]:
    """(names, source): device names from torch.cuda, else nvidia-smi; ([], None) if none."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return (
                [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                "torch.cuda",
            )
    except Exception:  # a broken CUDA install: fall back to nvidia-smi
        pass
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], run)
    names = [x.strip() for x in (out or "").splitlines() if x.strip()]
    return (names, "nvidia-smi") if names else ([], None)


def catalog_gpu(device_name: str) -> GpuType | None:
    """Catalog entry for a reported device name: exact alias, then loose (case, NVIDIA prefix)."""
    gpu = match_device_name(device_name)
    if gpu:
        return gpu

    def norm(s: str) -> str:
        return re.sub(r"[^a-z0-9]", "", s.lower().replace("nvidia", "").replace("geforce", ""))

    want = norm(device_name)
    for g in gpu_catalog().values():
        if want in [norm(g.name)] + [norm(a) for a in g.aliases]:
            return g
    return None


def topology(run: Runner = subprocess.run) -> dict[tuple[int, int], str] | None:
    """{(i, j): link} from `nvidia-smi topo -m` (NV12, PIX, PHB, SYS, ...), or None."""
    out = _run(["nvidia-smi", "topo", "-m"], run)
    if not out:
        return None
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # colour codes
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^GPU\d+\s", ln)]
    if not rows:
        return None
    n = len(rows)
    links = {}
    for i, row in enumerate(rows):
        for j, cell in enumerate(row[1 : n + 1]):
            if i != j:
                links[(i, j)] = cell
    return links


def intra_node(
    gpu_name: str, count: int, topo: Mapping[tuple[int, int], str] | None
) -> tuple[str, str]:
    """(preset, comment) for `intra_node:`."""
    if count < 2:
        return "pcie4", "one GPU: intra_node is unused"
    if topo:
        nv = [v for v in topo.values() if v.startswith("NV")]
        if nv and len(nv) == len(topo):
            preset = "nvlink4" if gpu_name in _NVLINK4 else "nvlink"
            return preset, f"nvidia-smi topo: every GPU pair on NVLink ({sorted(set(nv))[0]}...)"
        if nv:
            return "nvlink", (
                f"nvidia-smi topo: only {len(nv) // 2} of {len(topo) // 2} GPU pairs "
                f"on NVLink; measure with hexi-cluster bench"
            )
    seen = "nvidia-smi topo: no NVLink" if topo else "topology not visible (no nvidia-smi topo)"
    if gpu_name in _NO_P2P:
        return "host", f"{seen}; GeForce cards copy through host memory"
    return "pcie4", f"{seen}; assumed PCIe 4.0 x16"


def nic_speed(sys_root: str = "/") -> tuple[str | None, str | None]:
    """(text like "100 Gbit/s", what) of the fastest physical NIC that is up, or (None, why)."""
    best, what = 0.0, None
    for dev in glob.glob(os.path.join(sys_root, "sys/class/infiniband/*/ports/*/rate")):
        try:
            m = re.match(r"\s*([0-9.]+)\s*Gb/sec", open(dev).read())
        except OSError:
            continue
        if m and float(m.group(1)) > best:
            best, what = float(m.group(1)), "InfiniBand " + dev.split("/")[-4]
    for dev in glob.glob(os.path.join(sys_root, "sys/class/net/*")):
        name = os.path.basename(dev)
        if name == "lo" or not os.path.exists(os.path.join(dev, "device")):
            continue  # loopback and virtual interfaces (docker, veth, bridges)
        try:
            if open(os.path.join(dev, "operstate")).read().strip() != "up":
                continue
            mbit = int(open(os.path.join(dev, "speed")).read().strip())
        except (OSError, ValueError):
            continue
        if mbit > 0 and mbit / 1000 > best:
            best, what = mbit / 1000, f"Ethernet {name}"
    if not best:
        return None, "no physical NIC speed visible in /sys/class/net"
    return f"{best:g} Gbit/s", what


def detect(
    allow_cpu: bool = False,
    name: str | None = None,
    cpu_ranks: int = 1,
    run: Runner = subprocess.run,
    sys_root: str = "/",
) -> tuple[dict[str, Any], list[str]]:
    """(entry dict, comment lines) for this node. Raises DetectError (one line)."""
    host = socket.gethostname()
    name = name or re.sub(r"[^A-Za-z0-9_.-]", "-", host.split(".")[0]) or "node"
    notes = []
    names, source = gpu_names(run)
    if not names:
        if not allow_cpu:
            raise DetectError(
                "no GPU found (torch.cuda sees none and nvidia-smi is absent or "
                "lists none); use --allow-cpu to describe this machine as a CPU node"
            )
        gpu, count = "CPU", cpu_ranks
        intra, why = "host", "CPU node: each rank is one CPU process (runtime CPU mode)"
        notes.append("no GPU found: CPU entry (--allow-cpu)")
    else:
        kinds = sorted(set(names))
        if len(kinds) > 1:
            raise DetectError(
                f"this machine mixes GPU models ({', '.join(kinds)}); a cluster-spec "
                f"node holds one model: describe it by hand as separate node entries"
            )
        g = catalog_gpu(kinds[0])
        if g is None:
            raise DetectError(
                f"GPU {kinds[0]!r} is not in the catalog (planner/data/gpus.yaml): "
                f"add a row for it, with this name in `aliases`"
            )
        gpu, count = g.name, len(names)
        notes.append(f"{count} x {kinds[0]} (from {source})")
        intra, why = intra_node(gpu, count, topology(run) if source else None)
    notes.append(f"intra_node: {why}")
    nic, nic_what = nic_speed(sys_root)
    if nic is None:
        nic = "10 Gbit/s"
        notes.append(f"nic: {nic_what}; 10 Gbit/s is a placeholder, set the real speed")
    else:
        notes.append(f"nic: {nic_what}")
    entry = {
        "name": name,
        "gpu": gpu,
        "gpus_per_node": count,
        "intra_node": intra,
        "nic": nic,
        "hostname": host,
    }
    return entry, notes


def to_yaml(entry: Mapping[str, Any], notes: Sequence[str]) -> str:
    """One `nodes:` item, with the notes as comments; paste it under `nodes:`."""
    lines = [f"# hexi-cluster detect on {entry['hostname']}"] + [f"# {n}" for n in notes]
    first = True
    for k in ("name", "gpu", "gpus_per_node", "intra_node", "nic", "hostname"):
        v = entry[k]
        text = (
            str(v) if isinstance(v, int) or re.fullmatch(r"[A-Za-z0-9_.-]+", str(v)) else f'"{v}"'
        )
        lines.append(("- " if first else "  ") + f"{k}: {text}")
        first = False
    return "\n".join(lines) + "\n"
