"""Random heterogeneous clusters, reproducible from a seed: inputs for tests and benchmarks.

Machines of 1 to 8 GPUs drawn from a few catalog types, with the intra-node link each type
usually has (NVLink for datacenter cards, through host memory for GeForce) and Ethernet NICs.
"""

import random
from typing import Any

from planner.cluster import ClusterSpec, load_cluster_dict

# (catalog GPU, intra-node link preset) pairs the generator draws from.
GPU_KINDS = [
    ("A100-SXM-80GB", "nvlink"),
    ("A100-PCIE-40GB", "pcie4"),
    ("RTX-4090", "host"),
    ("RTX-3090", "host"),
    ("RTX-3080-Ti", "host"),
    ("L40S", "pcie4"),
    ("V100-SXM2", "nvlink"),
]
NICS = ["10 Gbit/s", "25 Gbit/s", "100 Gbit/s"]


def random_cluster(
    seed: int, max_gpus: int = 64, max_types: int = 4, name: str | None = None
) -> ClusterSpec:
    """A ClusterSpec with 1..max_gpus GPUs of 1..max_types types on machines of mixed sizes."""
    rng = random.Random(seed)
    total = rng.randint(1, max_gpus)
    kinds = rng.sample(GPU_KINDS, rng.randint(1, max_types))
    groups: list[dict[str, Any]] = []
    left, i = total, 0
    while left > 0:
        gpu, intra = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        per = min(left, rng.choice([1, 2, 4, 8, 8, 3, 6]))
        count = rng.randint(1, max(1, min(4, left // per)))
        groups.append(
            {
                "name": f"g{i}",
                "gpu": gpu,
                "gpus_per_node": per,
                "count": count,
                "intra_node": intra,
                "nic": rng.choice(NICS),
            }
        )
        left -= per * count
        i += 1
    return load_cluster_dict({"name": name or f"random-{seed}", "nodes": groups})


def scaled_cluster(num_gpus: int, types: int = 4, nic: str = "100 Gbit/s") -> ClusterSpec:
    """num_gpus GPUs on 8-GPU machines, `types` GPU kinds in equal shares (for scaling runs)."""
    kinds = GPU_KINDS[:types]
    machines = max(1, num_gpus // 8)
    groups = []
    for t, (gpu, intra) in enumerate(kinds):
        count = machines // types + (1 if t < machines % types else 0)
        if count:
            groups.append(
                {
                    "name": f"m{t}",
                    "gpu": gpu,
                    "gpus_per_node": 8,
                    "count": count,
                    "intra_node": intra,
                    "nic": nic,
                }
            )
    return load_cluster_dict({"name": f"scaled-{num_gpus}", "nodes": groups})


# The mixed-NIC shape: (catalog GPU, GPUs per machine, intra-node link, NIC), in equal GPU shares.
MIXED_SHAPES = [
    ("A100-SXM-80GB", 8, "nvlink", "200 Gbit/s"),
    ("A100-SXM-80GB", 4, "nvlink", "100 Gbit/s"),
    ("RTX-4090", 8, "host", "25 Gbit/s"),
    ("RTX-3090", 8, "host", "10 Gbit/s"),
]


def mixed_nic_cluster(num_gpus: int) -> ClusterSpec:
    """num_gpus GPUs (a multiple of 32) of MIXED_SHAPES in equal shares: four machine kinds on
    four NIC speeds, the shape where the search has the most distinct machine kinds to order."""
    if num_gpus % 32:
        raise ValueError(f"mixed_nic_cluster: {num_gpus} GPUs is not a multiple of 32")
    share = num_gpus // len(MIXED_SHAPES)
    groups = [
        {
            "name": f"m{i}",
            "gpu": gpu,
            "gpus_per_node": per,
            "count": share // per,
            "intra_node": intra,
            "nic": nic,
        }
        for i, (gpu, per, intra, nic) in enumerate(MIXED_SHAPES)
    ]
    return load_cluster_dict({"name": f"mixed-{num_gpus}", "nodes": groups})
