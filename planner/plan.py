"""Plan format v1: the one contract between the planner and the runtime.

A plan is a self-contained JSON document: the model, the batch settings, the cluster it was made
for, the pipelines (stages, tensor-parallel groups, shard sizes, micro-batches) and the table that
maps plan ranks to (node, local rank, GPU). planner/plan_validation.py checks every rule and
reports one line per problem naming the JSON path; `Plan.rank_view` gives one rank everything the
runtime needs. Nothing else in the project derives these numbers another way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from planner.attention import PLAN_DEFAULT_BACKEND
from planner.cluster import ClusterSpec, load_cluster_dict
from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import PlanError, SpecError
from planner.inputs import (
    is_int,
    read_json,
)
from planner.islands import OuterSettings, island_of_pipeline, outer_from_dict
from planner.models import ModelSpec, model_from_dict
from planner.plan_validation import FORMAT_VERSION, validate_plan_dict
from planner.splits import even_split
from planner.transformer_impl import PLAN_DEFAULT_IMPL


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
    # planner.islands: how islands meet every `interval` steps; absent in a plan: never
    outer: Optional[OuterSettings] = None

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
        if self.outer is not None:
            d["outer"] = self.outer.to_dict()
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
    island: int = 0  # the island holding this rank's pipeline (planner.islands)

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
    # pipeline indices of each island (planner.islands); empty: one island of all pipelines
    islands: tuple[tuple[int, ...], ...] = ()
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
        if self.islands:
            d["islands"] = [{"pipelines": list(pipes)} for pipes in self.islands]
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

    def island_of(self) -> list[int]:
        """Island index of every pipeline (all 0 without `islands`)."""
        return island_of_pipeline(self.islands, len(self.pipelines))

    def island_pipelines(self) -> list[tuple[int, ...]]:
        """Pipeline indices of each island, in island order (one island without `islands`)."""
        return list(self.islands) or [tuple(range(len(self.pipelines)))]

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
            island=self.island_of()[p],
        )


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
        outer_from_dict(t["outer"]) if "outer" in t else None,
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
    islands = tuple(tuple(i["pipelines"]) for i in data.get("islands", ()))
    return Plan(
        model,
        training,
        cluster,
        pipelines,
        ranks,
        data.get("estimate"),
        extra=extra,
        islands=islands,
    )


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
    islands: Sequence[Sequence[int]] = (),
    outer: OuterSettings | None = None,
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
            outer,
        ).to_dict(),
        "cluster": cluster.to_dict(),
        "pipelines": pipelines,
        "ranks": [
            {"rank": i, "node": n, "local_rank": lr, "gpu": g}
            for i, (n, lr, g) in enumerate(slots[:world])
        ],
    }
    if islands:
        data["islands"] = [{"pipelines": list(pipes)} for pipes in islands]
    if estimate is not None:
        data["estimate"] = estimate
    return plan_from_dict(data, "plan")
