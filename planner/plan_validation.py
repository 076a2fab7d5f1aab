"""Plan format v1 validation: every rule of a plan document, one line per problem.

Its own module because it reads the JSON as written (plain dicts, before any Plan exists): the
loaders (planner/plan.py), the runtime and the JSON Schema tests share one rule book, each problem
naming the JSON path that breaks it.
"""

from __future__ import annotations

from typing import Any

from planner.attention import ATTENTION_BACKENDS, PLAN_DEFAULT_BACKEND
from planner.cluster import load_cluster_dict
from planner.cuda_graphs import graph_problems
from planner.errors import SpecError
from planner.inputs import (
    document_problems,
    int_problem,
    is_int,
    is_number,
    name_problem,
    short,
)
from planner.islands import islands_problems, outer_problems
from planner.limits import MAX_BATCH, MAX_GPUS
from planner.models import ModelSpec, model_from_dict
from planner.transformer_impl import PLAN_DEFAULT_IMPL, TRANSFORMER_IMPLS

FORMAT_VERSION = 1
SHARD_KINDS = ("query_groups", "ffn", "vocab")
_TOP_KEYS = {
    "format_version",
    "model",
    "training",
    "cluster",
    "pipelines",
    "ranks",
    "estimate",
    "comment",
    "islands",
}
_TRAINING_KEYS = {
    "global_batch_size",
    "recompute",
    "use_distributed_optimizer",
    "optimizer_shard",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "attention_backend",
    "sequence_parallel",
    "transformer_impl",
    "cuda_graph_impl",
    "cuda_graph_scope",
    "outer",
}
_PIPELINE_KEYS = {"micro_batch_size", "num_microbatches", "stages"}
_STAGE_KEYS = {"ranks", "layers", "shards"}
_RANK_KEYS = {"rank", "node", "local_rank", "gpu"}
# The estimate is informational and open to further fields; these are read by `show`/`simulate`.
_ESTIMATE_NUMBERS = (
    "iteration_time_s",
    "tokens_per_s",
    "mfu",
    "grad_sync_time_s",
    "optimizer_step_time_s",
    "inner_step_time_s",
    "outer_sync_time_s",
    "cross_site_bytes_per_step",
)
_ESTIMATE_LISTS = (
    "peak_memory_gb",
    "memory_capacity_gb",
    "pipeline_time_s",
    "island_step_time_s",
)
_ESTIMATE_STRINGS = ("bottleneck", "strategy")


def _check_stage(
    stage: object, where: str, model: ModelSpec, problems: list[str]
) -> tuple[list[int], list[int]] | None:
    """Structural checks of one stage; returns (ranks, layers) or None if unusable."""
    if not isinstance(stage, dict):
        problems.append(f"{where}: must be an object with ranks and layers")
        return None
    for k in sorted(set(stage) - _STAGE_KEYS):
        problems.append(f"{where}.{k}: unknown field (known: ranks, layers, shards)")
    ranks: Any = stage.get("ranks")  # JSON values, checked below
    layers: Any = stage.get("layers")
    ok = True
    if not isinstance(ranks, list) or not ranks or not all(is_int(r) and r >= 0 for r in ranks):
        problems.append(
            f"{where}.ranks: must be a non-empty list of rank numbers, got {short(ranks)}"
        )
        ok = False
    elif max(ranks) >= MAX_GPUS:
        problems.append(
            f"{where}.ranks: rank {max(ranks)} is above the limit of {MAX_GPUS:,} "
            f"GPUs (limits in planner/limits.py)"
        )
        ok = False
    elif len(set(ranks)) != len(ranks):
        problems.append(f"{where}.ranks: lists a rank twice: {ranks}")
        ok = False
    if not isinstance(layers, list) or len(layers) != 2 or not all(is_int(x) for x in layers):
        problems.append(
            f"{where}.layers: must be [first, last) as two integers, got {short(layers)}"
        )
        ok = False
    elif not 0 <= layers[0] < layers[1] <= model.num_layers:
        problems.append(
            f"{where}.layers: {layers} is not a non-empty range within "
            f"[0, {model.num_layers}) (half-open [first, last))"
        )
        ok = False
    if not ok:
        return None
    shards = stage.get("shards", {})
    if not isinstance(shards, dict):
        problems.append(f"{where}.shards: must be an object with query_groups, ffn, vocab lists")
        return ranks, layers
    holds_vocab = layers[0] == 0 or layers[1] == model.num_layers
    totals = {
        "query_groups": ("num_query_groups", model.num_query_groups),
        "ffn": ("ffn_hidden_size", model.ffn_hidden_size),
        "vocab": ("vocab_size", model.vocab_size),
    }
    for k in sorted(set(shards) - set(SHARD_KINDS)):
        problems.append(f"{where}.shards.{k}: unknown shard kind (known: {', '.join(SHARD_KINDS)})")
    for kind, (field_name, total) in totals.items():
        sizes = shards.get(kind)
        if kind == "vocab" and not holds_vocab:
            if sizes is not None:
                problems.append(
                    f"{where}.shards.vocab: stage holds neither the embedding (layer 0)"
                    f" nor the output layer (layer {model.num_layers - 1})"
                )
            continue
        if sizes is None:
            if total < len(ranks):
                problems.append(
                    f"{where}.shards.{kind}: an even split of {field_name} {total} "
                    f"over {len(ranks)} ranks leaves a rank empty"
                )
            continue
        if not isinstance(sizes, list) or not all(is_int(x) for x in sizes):
            problems.append(
                f"{where}.shards.{kind}: must be a list of integers, got {short(sizes)}"
            )
        elif len(sizes) != len(ranks):
            problems.append(
                f"{where}.shards.{kind}: has {len(sizes)} entries for {len(ranks)} ranks"
            )
        elif any(x <= 0 for x in sizes):
            problems.append(f"{where}.shards.{kind}: every shard must be > 0, got {sizes}")
        elif sum(sizes) != total:
            problems.append(
                f"{where}.shards.{kind}: sums to {sum(sizes)}, model {field_name} is {total}"
            )
    return ranks, layers


def _estimate_problems(est: object) -> list[str]:
    """Types of the estimate fields that `show` and `simulate` print (all finite: see
    document_problems)."""
    if not isinstance(est, dict):
        return ["estimate: must be an object"]
    problems = []
    for k in _ESTIMATE_NUMBERS:
        if k in est and not (is_number(est[k]) and est[k] >= 0):
            problems.append(f"estimate.{k}: must be a number >= 0, got {short(est[k])}")
    for k in _ESTIMATE_LISTS:
        if k in est and not (
            isinstance(est[k], list) and all(is_number(x) and x >= 0 for x in est[k])
        ):
            problems.append(f"estimate.{k}: must be a list of numbers >= 0, got {short(est[k])}")
    for k in _ESTIMATE_STRINGS:
        if k in est and not isinstance(est[k], str):
            problems.append(f"estimate.{k}: must be a string, got {short(est[k])}")
    if "fits_memory" in est and not isinstance(est["fits_memory"], bool):
        problems.append(
            f"estimate.fits_memory: must be true or false, got {short(est['fits_memory'])}"
        )
    return problems


def validate_plan_dict(data: object) -> list[str]:
    """Every rule of plan format v1; returns a list of one-line problems (empty if valid)."""
    problems = document_problems(data)  # finite numbers, string keys, bounded nesting
    if problems:
        return problems
    if not isinstance(data, dict):
        return ["plan: must be a JSON object"]
    for k in sorted(set(data) - _TOP_KEYS):
        problems.append(f"{k}: unknown top-level field")
    if not is_int(data.get("format_version")) or data.get("format_version") != FORMAT_VERSION:
        problems.append(
            f"format_version: must be {FORMAT_VERSION}, got {short(data.get('format_version'))}"
        )
    if "comment" in data and not isinstance(data["comment"], str):
        problems.append(f"comment: must be a string, got {short(data['comment'])}")
    for k in ("model", "training", "cluster", "pipelines", "ranks"):
        if k not in data:
            problems.append(f"{k}: missing required field")
    if any(p.endswith("missing required field") for p in problems):
        return problems
    try:
        model = model_from_dict(data["model"], "model")
    except SpecError as e:
        return problems + e.problems
    try:
        cluster = load_cluster_dict(data["cluster"], "cluster")
    except SpecError as e:
        return problems + [p if p.startswith("cluster") else f"cluster.{p}" for p in e.problems]

    training = data["training"]
    gbs = None
    if not isinstance(training, dict):
        problems.append("training: must be an object with global_batch_size")
    else:
        for k in sorted(set(training) - _TRAINING_KEYS):
            problems.append(f"training.{k}: unknown field")
        gbs = training.get("global_batch_size")
        bad = int_problem(gbs, "training.global_batch_size", 1, MAX_BATCH)
        if bad:
            problems.append(bad)
            gbs = None
        for k in (
            "recompute",
            "use_distributed_optimizer",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "sequence_parallel",
        ):
            if k in training and not isinstance(training[k], bool):
                problems.append(f"training.{k}: must be true or false, got {training[k]!r}")
        if training.get("overlap_param_gather") is True and not training.get(
            "use_distributed_optimizer"
        ):
            problems.append(
                "training.overlap_param_gather: needs use_distributed_optimizer (only the "
                "distributed optimizer all-gathers parameters)"
            )
        if training.get("optimizer_shard", "even") not in ("even", "memory"):
            problems.append("training.optimizer_shard: must be even or memory")
        backend = training.get("attention_backend", PLAN_DEFAULT_BACKEND)
        if not isinstance(backend, str) or backend not in ATTENTION_BACKENDS:
            problems.append(
                f"training.attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {short(backend)}"
            )
        impl = training.get("transformer_impl", PLAN_DEFAULT_IMPL)
        if not isinstance(impl, str) or impl not in TRANSFORMER_IMPLS:
            problems.append(
                f"training.transformer_impl: must be one of {', '.join(TRANSFORMER_IMPLS)}, "
                f"got {short(impl)}"
            )
        problems.extend(graph_problems(training))
        if "outer" in training:
            problems.extend(outer_problems(training["outer"], model.num_layers))

    sequence_parallel = isinstance(training, dict) and training.get("sequence_parallel") is True
    pipelines = data["pipelines"]
    owner: dict[int, str] = {}
    samples = 0
    batch_known = ranks_known = True  # else skip the sum / coverage checks (no cascades)
    if not isinstance(pipelines, list) or not pipelines:
        problems.append("pipelines: must be a non-empty list")
        pipelines = []
    for p, pipe in enumerate(pipelines):
        where = f"pipelines[{p}]"
        if not isinstance(pipe, dict):
            problems.append(
                f"{where}: must be an object with micro_batch_size, num_microbatches, stages"
            )
            batch_known = ranks_known = False
            continue
        for k in sorted(set(pipe) - _PIPELINE_KEYS):
            problems.append(f"{where}.{k}: unknown field")
        mbs: Any = pipe.get("micro_batch_size")  # JSON values, checked below
        nmb: Any = pipe.get("num_microbatches")
        for name, v in (("micro_batch_size", mbs), ("num_microbatches", nmb)):
            bad = int_problem(v, f"{where}.{name}", 1, MAX_BATCH)
            if bad:
                problems.append(bad)
                batch_known = False
        if batch_known:
            samples += mbs * nmb
        stages = pipe.get("stages")
        if not isinstance(stages, list) or not stages:
            problems.append(f"{where}.stages: must be a non-empty list")
            ranks_known = False
            continue
        expected_first: int | None = 0
        for s, stage in enumerate(stages):
            swhere = f"{where}.stages[{s}]"
            got = _check_stage(stage, swhere, model, problems)
            if got is None:
                expected_first = None
                ranks_known = False
                continue
            ranks, layers = got
            if sequence_parallel and len(ranks) > 1 and model.seq_length % len(ranks):
                problems.append(
                    f"{swhere}.ranks: training.sequence_parallel splits the sequence evenly "
                    f"over the stage's TP ranks, but seq_length {model.seq_length} is not "
                    f"divisible by its TP degree {len(ranks)}"
                )
            if expected_first is not None and layers[0] != expected_first:
                problems.append(
                    f"{swhere}.layers: starts at {layers[0]}, but the previous stage "
                    f"ends at {expected_first} (stages must cover all layers in order)"
                )
            expected_first = layers[1]
            for r in ranks:
                if r in owner:
                    problems.append(f"{swhere}.ranks: rank {r} is also in {owner[r]}")
                else:
                    owner[r] = swhere
        if expected_first is not None and expected_first != model.num_layers:
            problems.append(
                f"{where}.stages[{len(stages) - 1}].layers: ends at {expected_first}, "
                f"model num_layers is {model.num_layers}"
            )
    if gbs is not None and pipelines and batch_known and samples != gbs:
        problems.append(
            f"pipelines: micro_batch_size x num_microbatches sums to {samples} "
            f"samples, training.global_batch_size is {gbs}"
        )

    ranks = data["ranks"]
    if not isinstance(ranks, list) or not ranks:
        problems.append("ranks: must be a non-empty list of {rank, node, local_rank, gpu}")
        return problems
    if len(ranks) > MAX_GPUS:
        problems.append(
            f"ranks: {len(ranks):,} ranks, above the limit of {MAX_GPUS:,} GPUs "
            f"(limits in planner/limits.py)"
        )
        return problems
    nodes = {n.name: n for n in cluster.nodes}
    slots: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(ranks):
        where = f"ranks[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: must be an object {{rank, node, local_rank, gpu}}")
            continue
        for k in sorted(set(entry) - _RANK_KEYS):
            problems.append(f"{where}.{k}: unknown field")
        missing = [k for k in sorted(_RANK_KEYS) if k not in entry]
        if missing:
            problems.append(f"{where}: missing {', '.join(missing)}")
            continue
        if not is_int(entry["rank"]) or entry["rank"] != i:
            problems.append(
                f"{where}.rank: is {short(entry['rank'])}; ranks must be listed as "
                f"the integers 0..{len(ranks) - 1} in order"
            )
        bad_name = name_problem(entry["node"], f"{where}.node", "node name")
        if bad_name:
            problems.append(bad_name)
            continue
        node = nodes.get(entry["node"])
        if node is None:
            problems.append(
                f"{where}.node: {entry['node']!r} is not a node of cluster {cluster.name!r}"
            )
            continue
        lr = entry["local_rank"]
        if not is_int(lr) or not 0 <= lr < node.gpus_per_node:
            problems.append(
                f"{where}.local_rank: {short(lr)} is outside node {node.name}'s "
                f"{node.gpus_per_node} GPUs"
            )
        elif (node.name, lr) in slots:
            problems.append(
                f"{where}: GPU {node.name}:{lr} is also used by ranks[{slots[node.name, lr]}]"
            )
        else:
            slots[node.name, lr] = i
        if entry["gpu"] != node.gpu:
            problems.append(
                f"{where}.gpu: {short(entry['gpu'])}, but node {node.name} holds {node.gpu}"
            )
    world = len(ranks)
    for r, where in sorted(owner.items()):
        if r >= world:
            problems.append(
                f"{where}.ranks: rank {r} is not in the ranks table (world size {world})"
            )
    for r in range(world):
        if r not in owner and pipelines and ranks_known:
            problems.append(f"ranks[{r}]: rank {r} is in no stage of any pipeline")
    if "islands" in data and pipelines:
        problems.extend(islands_problems(data["islands"], len(pipelines)))
    if "estimate" in data:
        problems.extend(_estimate_problems(data["estimate"]))
    return problems
