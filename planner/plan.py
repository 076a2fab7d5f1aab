"""Plan format v1: the one contract between the planner and the runtime.

A plan is a self-contained JSON document: the model, the batch settings, the cluster it was made
for, the pipelines (stages, tensor-parallel groups, shard sizes, micro-batches) and the table that
maps plan ranks to (node, local rank, GPU). `validate_plan_dict` checks every rule and reports one
line per problem naming the JSON path; `Plan.rank_view` gives one rank everything the runtime needs.
Nothing else in the project derives these numbers another way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from planner.attention import ATTENTION_BACKENDS, PLAN_DEFAULT_BACKEND
from planner.cluster import ClusterSpec, load_cluster_dict
from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL, graph_problems
from planner.errors import PlanError, SpecError
from planner.inputs import (
    document_problems,
    int_problem,
    is_int,
    is_number,
    name_problem,
    read_json,
    short,
)
from planner.layout import even_split
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
)
_ESTIMATE_LISTS = ("peak_memory_gb", "memory_capacity_gb", "pipeline_time_s")
_ESTIMATE_STRINGS = ("bottleneck", "strategy")


@dataclass(frozen=True)
class Stage:
    ranks: tuple[int, ...]
    layers: tuple[int, ...]  # half-open [first, last)
    shards: dict[str, tuple[int, ...]]  # kind -> tuple of per-rank sizes, as written (may be empty)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ranks": list(self.ranks), "layers": list(self.layers)}
        if self.shards:
            d["shards"] = {k: list(v) for k, v in self.shards.items()}
        return d


@dataclass(frozen=True)
class Pipeline:
    micro_batch_size: int
    num_microbatches: int
    stages: tuple[Stage, ...]

    @property
    def num_samples(self) -> int:
        return self.micro_batch_size * self.num_microbatches

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.ranks]

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class RankEntry:
    rank: int
    node: str
    local_rank: int
    gpu: str


@dataclass(frozen=True)
class Training:
    global_batch_size: int
    recompute: bool = False
    use_distributed_optimizer: bool = False
    optimizer_shard: str = "even"
    # Gradient collectives start during the last backward; parameter all-gathers of the
    # distributed optimizer during the next forward. Absent in a plan: off (serial, as before).
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # planner.attention's names; absent in a plan: unfused (what plans meant before the field)
    attention_backend: str = PLAN_DEFAULT_BACKEND
    # megatron-core's sequence parallelism in every stage with TP > 1 (a TP-1 stage holds the
    # whole sequence, as Megatron-LM turns it off there); absent in a plan: off
    sequence_parallel: bool = False
    # planner.transformer_impl's names; absent in a plan: local (what plans meant before)
    transformer_impl: str = PLAN_DEFAULT_IMPL
    # planner.cuda_graphs' names (megatron-core's); absent in a plan: none (what plans meant
    # before); the scope empty or absent: whole layers
    cuda_graph_impl: str = PLAN_DEFAULT_GRAPH_IMPL
    cuda_graph_scope: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "global_batch_size": self.global_batch_size,
            "recompute": self.recompute,
        }
        if self.use_distributed_optimizer:
            d["use_distributed_optimizer"] = True
            d["optimizer_shard"] = self.optimizer_shard
        if self.overlap_grad_reduce:
            d["overlap_grad_reduce"] = True
        if self.overlap_param_gather:
            d["overlap_param_gather"] = True
        if self.attention_backend != PLAN_DEFAULT_BACKEND:
            d["attention_backend"] = self.attention_backend
        if self.sequence_parallel:
            d["sequence_parallel"] = True
        if self.transformer_impl != PLAN_DEFAULT_IMPL:
            d["transformer_impl"] = self.transformer_impl
        if self.cuda_graph_impl != PLAN_DEFAULT_GRAPH_IMPL:
            d["cuda_graph_impl"] = self.cuda_graph_impl
        if self.cuda_graph_scope:
            d["cuda_graph_scope"] = list(self.cuda_graph_scope)
        return d


@dataclass(frozen=True)
class RankView:
    """Everything one rank needs from the plan. Sizes are (count, offset) in the full model."""

    rank: int
    node: str
    local_rank: int
    gpu: str
    pipeline: int
    stage: int
    num_stages: int
    stage_ranks: tuple[int, ...]  # this stage's tensor-parallel group, in shard order
    tp_rank: int
    layers: tuple[int, ...]  # [first, last)
    holds_embedding: bool
    holds_output: bool
    query_groups: tuple[int, int]  # (count, offset) in query groups
    heads: tuple[int, int]  # (count, offset) in attention heads
    ffn: tuple[int, int]  # (count, offset) in FFN columns
    vocab: Optional[tuple[int, int]]  # (count, offset) in vocabulary rows, if embedding/output held
    prev_stage_ranks: tuple[int, ...]  # empty on the first stage
    next_stage_ranks: tuple[int, ...]  # empty on the last stage
    micro_batch_size: int
    num_microbatches: int
    samples: tuple[int, int]  # [start, end) of this pipeline's samples in the global batch
    # training.sequence_parallel in a stage with TP > 1: activations between the stage's
    # layers (and at its boundaries) are cut evenly along the sequence over its TP ranks
    sequence_parallel: bool = False

    @property
    def tp_size(self) -> int:
        return len(self.stage_ranks)


@dataclass
class Plan:
    model: ModelSpec
    training: Training
    cluster: ClusterSpec
    pipelines: list[Pipeline]
    ranks: list[RankEntry]
    estimate: Optional[dict[str, Any]] = None
    format_version: int = FORMAT_VERSION
    # unknown-but-allowed top-level keys (comment)
    extra: dict[str, Any] = field(default_factory=dict)
    # (id and length of the pipelines list, sample_range's prefix sums over it)
    _starts: Optional[tuple[tuple[int, int], list[int]]] = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def global_batch_size(self) -> int:
        return self.training.global_batch_size

    def to_dict(self) -> dict[str, Any]:
        d = {
            "format_version": self.format_version,
            "model": self.model.to_dict(),
            "training": self.training.to_dict(),
            "cluster": self.cluster.to_dict(),
            "pipelines": [p.to_dict() for p in self.pipelines],
            "ranks": [
                {"rank": r.rank, "node": r.node, "local_rank": r.local_rank, "gpu": r.gpu}
                for r in self.ranks
            ],
        }
        if self.estimate is not None:
            d["estimate"] = self.estimate
        d.update(self.extra)
        return d

    def validate(self) -> None:
        """Raise PlanError listing every rule this plan breaks."""
        problems = validate_plan_dict(self.to_dict())
        if problems:
            raise PlanError(problems)

    def shard_sizes(self, stage: Stage, kind: str) -> list[int]:
        """Per-rank sizes of `kind` (query_groups, ffn, vocab) in `stage`: as written or even."""
        if kind in stage.shards:
            return list(stage.shards[kind])
        total = {
            "query_groups": self.model.num_query_groups,
            "ffn": self.model.ffn_hidden_size,
            "vocab": self.model.vocab_size,
        }[kind]
        return even_split(total, stage.tp_size)

    def locate(self, rank: int) -> tuple[int, int]:
        """(pipeline index, stage index) holding `rank`."""
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                if rank in stage.ranks:
                    return p, s
        raise PlanError(f"ranks: rank {rank} is in no stage of the plan")

    def sample_range(self, pipeline_index: int) -> tuple[int, int]:
        """[start, end) of a pipeline's samples; prefix sums computed once per pipelines list, as
        `show` asks for every pipeline."""
        key = (id(self.pipelines), len(self.pipelines))
        if self._starts is None or self._starts[0] != key:
            starts = [0]
            for p in self.pipelines:
                starts.append(starts[-1] + p.num_samples)
            self._starts = (key, starts)
        starts = self._starts[1]
        return starts[pipeline_index], starts[pipeline_index + 1]

    def rank_view(self, rank: int) -> RankView:
        p, s = self.locate(rank)
        pipe = self.pipelines[p]
        stage = pipe.stages[s]
        i = stage.ranks.index(rank)
        holds_emb = stage.layers[0] == 0
        holds_out = stage.layers[1] == self.model.num_layers

        def count_offset(kind: str) -> tuple[int, int]:
            sizes = self.shard_sizes(stage, kind)
            return sizes[i], sum(sizes[:i])

        qg = count_offset("query_groups")
        hpg = self.model.heads_per_group
        entry = self.ranks[rank]
        return RankView(
            rank=rank,
            node=entry.node,
            local_rank=entry.local_rank,
            gpu=entry.gpu,
            pipeline=p,
            stage=s,
            num_stages=len(pipe.stages),
            stage_ranks=tuple(stage.ranks),
            tp_rank=i,
            layers=tuple(stage.layers),
            holds_embedding=holds_emb,
            holds_output=holds_out,
            query_groups=qg,
            heads=(qg[0] * hpg, qg[1] * hpg),
            ffn=count_offset("ffn"),
            vocab=count_offset("vocab") if (holds_emb or holds_out) else None,
            prev_stage_ranks=tuple(pipe.stages[s - 1].ranks) if s > 0 else (),
            next_stage_ranks=tuple(pipe.stages[s + 1].ranks) if s + 1 < len(pipe.stages) else (),
            micro_batch_size=pipe.micro_batch_size,
            num_microbatches=pipe.num_microbatches,
            samples=self.sample_range(p),
            sequence_parallel=self.training.sequence_parallel and len(stage.ranks) > 1,
        )


# ----------------------------------------------------------------------------------- validation


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
    if "estimate" in data:
        problems.extend(_estimate_problems(data["estimate"]))
    return problems


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    """Validate, then build a Plan. Raises PlanError with one line per problem."""
    problems = validate_plan_dict(data)
    if problems:
        raise PlanError([f"{source}: {p}" for p in problems])
    model = model_from_dict(data["model"], "model")
    cluster = load_cluster_dict(data["cluster"], "cluster")
    t = data["training"]
    training = Training(
        t["global_batch_size"],
        t.get("recompute", False),
        t.get("use_distributed_optimizer", False),
        t.get("optimizer_shard", "even"),
        t.get("overlap_grad_reduce", False),
        t.get("overlap_param_gather", False),
        t.get("attention_backend", PLAN_DEFAULT_BACKEND),
        t.get("sequence_parallel", False),
        t.get("transformer_impl", PLAN_DEFAULT_IMPL),
        t.get("cuda_graph_impl", PLAN_DEFAULT_GRAPH_IMPL),
        tuple(t.get("cuda_graph_scope", ())),
    )
    pipelines = [
        Pipeline(
            p["micro_batch_size"],
            p["num_microbatches"],
            tuple(
                Stage(
                    tuple(s["ranks"]),
                    tuple(s["layers"]),
                    {k: tuple(v) for k, v in s.get("shards", {}).items()},
                )
                for s in p["stages"]
            ),
        )
        for p in data["pipelines"]
    ]
    ranks = [RankEntry(r["rank"], r["node"], r["local_rank"], r["gpu"]) for r in data["ranks"]]
    extra = {k: data[k] for k in ("comment",) if k in data}
    return Plan(model, training, cluster, pipelines, ranks, data.get("estimate"), extra=extra)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file; errors name the file and the JSON path."""
    try:
        data = read_json(path, "plan")
    except SpecError as e:
        raise PlanError(e.problems)
    return plan_from_dict(data, str(path))


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write atomically (temporary name, then rename) so a reader never sees half a plan."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(plan.to_dict(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def build_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch_size: int,
    pipelines: Sequence[Mapping[str, Any]],
    recompute: bool = False,
    estimate: dict[str, Any] | None = None,
    use_distributed_optimizer: bool = False,
    optimizer_shard: str = "even",
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    sequence_parallel: bool = False,
    transformer_impl: str = PLAN_DEFAULT_IMPL,
    cuda_graph_impl: str = PLAN_DEFAULT_GRAPH_IMPL,
    cuda_graph_scope: Sequence[str] = (),
) -> Plan:
    """A complete plan from a `pipelines` array (the plan's own shape, as dicts).

    Ranks are numbered in cluster order: rank i is the i-th GPU of the cluster (node by node).
    The result is validated.
    """
    used = sorted(
        {
            r
            for p in pipelines
            if isinstance(p, dict)
            for s in (p.get("stages") or [])
            if isinstance(s, dict)
            for r in (s.get("ranks") or [])
            if is_int(r)
        }
    )
    slots = cluster.gpu_slots()
    world = (used[-1] + 1) if used else 0
    if world > len(slots):
        raise PlanError(
            f"pipelines: use rank {world - 1}, but cluster {cluster.name!r} has only "
            f"{len(slots)} GPUs"
        )
    data = {
        "format_version": FORMAT_VERSION,
        "model": model.to_dict(),
        "training": Training(
            global_batch_size,
            recompute,
            use_distributed_optimizer,
            optimizer_shard,
            overlap_grad_reduce,
            overlap_param_gather,
            attention_backend,
            sequence_parallel,
            transformer_impl,
            cuda_graph_impl,
            tuple(cuda_graph_scope),
        ).to_dict(),
        "cluster": cluster.to_dict(),
        "pipelines": pipelines,
        "ranks": [
            {"rank": i, "node": n, "local_rank": lr, "gpu": g}
            for i, (n, lr, g) in enumerate(slots[:world])
        ],
    }
    if estimate is not None:
        data["estimate"] = estimate
    return plan_from_dict(data, "plan")
