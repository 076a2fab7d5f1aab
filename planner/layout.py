"""Where each rank's parameter shards sit in the full model, and how gradients are summed.

Every parameter of the one-device model (megatron-core's TP=1 layout, global layer numbers) is
the canonical tensor. A rank's local parameter is a set of pieces: index ranges along one split
dimension of the canonical tensor. Fused tensors are mapped piece by piece: a stage holds whole
query groups, so its rows of the per-group interleaved [q; k; v] weight are one range; the gated
MLP's local [gate; up] rows are two ranges of the canonical [gate; up].

`gradient_segments` cuts every parameter at all holders' piece boundaries into atomic segments,
each held by a fixed set of ranks. Summing each segment once over its holders (TP replicas count
once) and dividing by the global token count gives the one-device gradient. The same map serves
checkpoint resharding and weight initialisation. Pure Python: the planner uses it too.

This module owns parameter geometry for planner and runtime alike: shards and segments, the
per-rank and total parameter counts (closed forms that `param_shards` agrees with), the splits
(even, proportional, weighted), which segments are reduced together, and how the distributed
optimizer shares each segment's state among its holders.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from planner.catalog import get_gpu
from planner.splits import weighted_split

if TYPE_CHECKING:
    from planner.models import ModelSpec
    from planner.plan import Plan, RankView


# -------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Piece:
    local_start: int
    global_start: int
    length: int


@dataclass(frozen=True)
class ParamShard:
    """One local parameter: its canonical name and shape, and the pieces it holds."""

    local_name: str  # name inside this rank's stage model
    name: str  # canonical name in the one-device model
    shape: tuple[int, ...]  # canonical shape
    dim: int  # dimension the pieces run along
    pieces: tuple[Piece, ...]
    tp_replicated: bool  # identical on every rank of the stage (norms, row biases)
    init: str  # "normal", "scaled_normal" (output projections), "ones",
    # "zeros"
    # A replicated tensor used before sequence parallelism splits the sequence (the learned
    # position table): every TP rank's gradient is the whole sum even under it.
    whole_sequence: bool = False

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = sum(p.length for p in self.pieces)
        return tuple(shape)


@dataclass(frozen=True)
class Segment:
    """An atomic range [start, end) along `dim` of parameter `name`, held by `members`."""

    name: str
    dim: int
    start: int
    end: int
    members: tuple[tuple[int, int], ...]  # ((rank, local_start), ...) sorted by rank
    contributors: frozenset[int]  # ranks whose gradient is summed (one per TP-replicated stage)
    owner: int  # the rank that counts this segment in the gradient norm

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.members)

    @property
    def needs_reduce(self) -> bool:
        """Only one contributor: every holder already has the full sum (TP replicas of one
        stage hold identical gradients), so no collective is needed."""
        return len(self.contributors) > 1


def _full(
    local_name: str, name: str, shape: tuple[int, ...], init: str, replicated: bool = True
) -> ParamShard:
    return ParamShard(local_name, name, tuple(shape), 0, (Piece(0, 0, shape[0]),), replicated, init)


def rank_param_shards(plan: Plan, rank: int) -> list[ParamShard]:
    """The ParamShards of `rank`'s stage model, in the model's own parameter order."""
    return param_shards(plan.model, plan.rank_view(rank))


def param_shards(m: ModelSpec, v: RankView | StageView) -> list[ParamShard]:
    """ParamShards of a stage model of spec `m` for a RankView-like `v`."""
    d, hpg = m.head_dim, m.heads_per_group
    h, F, V = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    qkv_rows_per_group = (hpg + 2) * d
    norm_params = ["weight"] + (["bias"] if m.normalization == "LayerNorm" else [])
    out: list[ParamShard] = []
    if v.holds_embedding:
        assert v.vocab is not None  # a RankView holding the embedding has vocabulary rows
        emb = "embedding.word_embeddings.weight"
        out.append(
            ParamShard(emb, emb, (V, h), 0, (Piece(0, v.vocab[1], v.vocab[0]),), False, "normal")
        )
        if m.position_rows:
            pos = "embedding.position_embeddings.weight"
            shape = (m.position_rows, h)
            out.append(
                ParamShard(pos, pos, shape, 0, (Piece(0, 0, shape[0]),), True, "normal", True)
            )
    qg_n, qg_off = v.query_groups
    heads_n, heads_off = v.heads
    f_n, f_off = v.ffn
    for j, layer in enumerate(range(*v.layers)):
        lp, gp = f"decoder.layers.{j}.", f"decoder.layers.{layer}."
        for p in norm_params:
            out.append(
                _full(
                    f"{lp}input_layernorm.{p}",
                    f"{gp}input_layernorm.{p}",
                    (h,),
                    "ones" if p == "weight" else "zeros",
                )
            )
        qkv = Piece(0, qg_off * qkv_rows_per_group, qg_n * qkv_rows_per_group)
        qkv_shape = (m.num_query_groups * qkv_rows_per_group, h)
        out.append(
            ParamShard(
                f"{lp}self_attention.linear_qkv.weight",
                f"{gp}self_attention.linear_qkv.weight",
                qkv_shape,
                0,
                (qkv,),
                False,
                "normal",
            )
        )
        if m.qkv_bias:
            out.append(
                ParamShard(
                    f"{lp}self_attention.linear_qkv.bias",
                    f"{gp}self_attention.linear_qkv.bias",
                    qkv_shape[:1],
                    0,
                    (qkv,),
                    False,
                    "zeros",
                )
            )
        out.append(
            ParamShard(
                f"{lp}self_attention.linear_proj.weight",
                f"{gp}self_attention.linear_proj.weight",
                (h, m.num_attention_heads * d),
                1,
                (Piece(0, heads_off * d, heads_n * d),),
                False,
                "scaled_normal",
            )
        )
        if m.add_bias_linear:
            out.append(
                _full(
                    f"{lp}self_attention.linear_proj.bias",
                    f"{gp}self_attention.linear_proj.bias",
                    (h,),
                    "zeros",
                )
            )
        for p in norm_params:
            out.append(
                _full(
                    f"{lp}pre_mlp_layernorm.{p}",
                    f"{gp}pre_mlp_layernorm.{p}",
                    (h,),
                    "ones" if p == "weight" else "zeros",
                )
            )
        if m.swiglu:
            fc1_pieces: tuple[Piece, ...] = (Piece(0, f_off, f_n), Piece(f_n, F + f_off, f_n))
        else:
            fc1_pieces = (Piece(0, f_off, f_n),)
        out.append(
            ParamShard(
                f"{lp}mlp.linear_fc1.weight",
                f"{gp}mlp.linear_fc1.weight",
                (m.ffn_width, h),
                0,
                fc1_pieces,
                False,
                "normal",
            )
        )
        if m.add_bias_linear:
            out.append(
                ParamShard(
                    f"{lp}mlp.linear_fc1.bias",
                    f"{gp}mlp.linear_fc1.bias",
                    (m.ffn_width,),
                    0,
                    fc1_pieces,
                    False,
                    "zeros",
                )
            )
        out.append(
            ParamShard(
                f"{lp}mlp.linear_fc2.weight",
                f"{gp}mlp.linear_fc2.weight",
                (h, F),
                1,
                (Piece(0, f_off, f_n),),
                False,
                "scaled_normal",
            )
        )
        if m.add_bias_linear:
            out.append(_full(f"{lp}mlp.linear_fc2.bias", f"{gp}mlp.linear_fc2.bias", (h,), "zeros"))
    if v.holds_output:
        for p in norm_params:
            out.append(
                _full(
                    f"decoder.final_layernorm.{p}",
                    f"decoder.final_layernorm.{p}",
                    (h,),
                    "ones" if p == "weight" else "zeros",
                )
            )
        tied = not m.untie_embeddings_and_output_weights
        if not (tied and v.holds_embedding):  # tied on one stage: one tensor serves both uses
            assert v.vocab is not None  # as is one holding the output layer
            name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
            out.append(
                ParamShard(
                    "output_layer.weight",
                    name,
                    (V, h),
                    0,
                    (Piece(0, v.vocab[1], v.vocab[0]),),
                    False,
                    "normal",
                )
            )
    return out


@dataclass(frozen=True)
class StageView:
    """What `param_shards` reads of a rank (a plan's RankView has the same fields): its layers
    and its (count, offset) of query groups, heads, FFN columns and vocabulary rows in the full
    model."""

    layers: tuple[int, int]
    query_groups: tuple[int, int]
    heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    holds_embedding: bool = True
    holds_output: bool = True


def canonical_shards(m: ModelSpec) -> list[ParamShard]:
    """ParamShards of the one-device model of spec `m`: canonical names, shapes and order."""
    return param_shards(
        m,
        StageView(
            (0, m.num_layers),
            (m.num_query_groups, 0),
            (m.num_attention_heads, 0),
            (m.ffn_hidden_size, 0),
            (m.vocab_size, 0),
        ),
    )


# ------------------------------------------------------------------------------ parameter counts


class TensorCut(NamedTuple):
    """One tensor (or one fused piece of it) as a split axis cuts it: `rows` along its split
    dimension per unit of the axis, `inner` elements per row."""

    rows: int
    inner: int


class UnitTensors(NamedTuple):
    """The tensors each split axis cuts, per unit of the axis (the geometry of `param_shards`).

    Per layer: `query_group` (QKV weight and bias rows, output projection columns),
    `ffn_column` (fc1 rows, two pieces for SwiGLU's gate and up, with their bias; fc2
    columns), `layer_replicated` (whole tensors on every TP rank: the two norms' weight and
    bias, the row-parallel biases of the output projection and fc2). Once: `vocab_row` (one row
    of the embedding or of the output layer), `final_norm` (whole tensors, last stage).
    """

    query_group: tuple[TensorCut, ...]
    ffn_column: tuple[TensorCut, ...]
    layer_replicated: tuple[TensorCut, ...]
    vocab_row: tuple[TensorCut, ...]
    final_norm: tuple[TensorCut, ...]
    position_table: tuple[TensorCut, ...]


def unit_tensors(m: ModelSpec) -> UnitTensors:
    """UnitTensors of model spec `m` (LayerNorm has a bias beside its weight; RMSNorm none)."""
    h, d, hpg = m.hidden_size, m.head_dim, m.heads_per_group
    bias, qkv_bias = m.add_bias_linear, m.qkv_bias
    norm = [TensorCut(h, 1)] * (2 if m.normalization == "LayerNorm" else 1)
    fc1 = [TensorCut(1, h)] * (2 if m.swiglu else 1)
    return UnitTensors(
        query_group=tuple(
            [TensorCut((hpg + 2) * d, h)]
            + [TensorCut((hpg + 2) * d, 1)] * qkv_bias
            + [TensorCut(hpg * d, h)]
        ),
        ffn_column=tuple(fc1 + [TensorCut(1, 1)] * len(fc1) * bias + [TensorCut(1, h)]),
        layer_replicated=tuple(2 * norm + [TensorCut(h, 1)] * 2 * bias),
        vocab_row=(TensorCut(1, h),),
        final_norm=tuple(norm),
        position_table=(TensorCut(m.position_rows, h),) if m.position_rows else (),
    )


class UnitParams(NamedTuple):
    """Parameters per unit of each axis of UnitTensors: a rank holding q query groups and f FFN
    columns has q * query_group + f * ffn_column + layer_replicated parameters per layer."""

    query_group: int
    ffn_column: int
    layer_replicated: int
    vocab_row: int
    final_norm: int
    position_table: int


def unit_params(m: ModelSpec) -> UnitParams:
    """UnitParams of model spec `m`: the elements of its UnitTensors, in closed form (the
    search counts parameters often; tests/planner/test_geometry_owner.py pins the two)."""
    h, d, hpg = m.hidden_size, m.head_dim, m.heads_per_group
    bias = 1 if m.add_bias_linear else 0
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    fc1_rows = 2 if m.swiglu else 1
    return UnitParams(
        (hpg + 2) * d * (h + (1 if m.qkv_bias else 0)) + hpg * d * h,
        fc1_rows * (h + bias) + h,
        2 * norm + 2 * h * bias,
        h,
        norm,
        m.position_rows * h,
    )


def layer_params(m: ModelSpec, query_groups: int, ffn: int) -> int:
    """Parameters of one layer on a rank holding `query_groups` query groups and `ffn` FFN
    columns (norms and row-parallel biases counted on every TP rank)."""
    return _layer_params(unit_params(m), query_groups, ffn)


def _layer_params(u: UnitParams, query_groups: int, ffn: int) -> int:
    return query_groups * u.query_group + ffn * u.ffn_column + u.layer_replicated


def stage_params(
    m: ModelSpec, query_groups: int, ffn: int, vocab: int, n_layers: int, first: bool, last: bool
) -> int:
    """Parameters on one rank of a stage: its layers' shards, embedding rows (first stage),
    final norm and output rows (last stage).

    Tied embeddings on more than one stage: the last stage holds its own copy of the word
    embedding rows (Megatron), so the count is as untied; on a single stage one tensor serves
    both uses.
    """
    u = unit_params(m)
    p = n_layers * _layer_params(u, query_groups, ffn)
    if first:
        p += vocab * u.vocab_row + u.position_table
    if last:
        p += u.final_norm
        if not (first and not m.untie_embeddings_and_output_weights):
            p += vocab * u.vocab_row
    return p


def view_params(m: ModelSpec, v: RankView | StageView) -> int:
    """Parameters of the stage model of a rank seen through `v` (a RankView or StageView)."""
    return stage_params(
        m,
        v.query_groups[0],
        v.ffn[0],
        v.vocab[0] if v.vocab else 0,
        v.layers[1] - v.layers[0],
        v.holds_embedding,
        v.holds_output,
    )


def rank_params(plan: Plan, rank: int) -> int:
    """Parameters `rank` holds under `plan`."""
    return view_params(plan.model, plan.rank_view(rank))


def total_params(m: ModelSpec) -> int:
    """Parameters of the one-device model (untied: embedding and output layer both counted)."""
    return stage_params(
        m, m.num_query_groups, m.ffn_hidden_size, m.vocab_size, m.num_layers, True, True
    )


# -------------------------------------------------------------------------------------- segments


def gradient_segments(plan: Plan, ranks: Collection[int] | None = None) -> list[Segment]:
    """Every atomic gradient segment of the model, in one global order (parameter, start).

    `ranks`: only these ranks' shards (an island's pipelines, `island_segments`); all by default.

    All ranks compute the same list from the plan, so they can issue collectives in one order.
    A TP-replicated parameter (norms, row biases) has one contributor per stage, whose gradient
    every TP rank holds in full; under sequence parallelism each TP rank holds only its part of
    the sequence's sum, so every one of them contributes, and the one collective that sums the
    stage replicas also sums the parts (megatron-core all-reduces them over TP instead).
    """
    order = {sh.name: i for i, sh in enumerate(canonical_shards(plan.model))}
    holders: dict[str, list[tuple[int, RankView, ParamShard]]] = {}
    for rank in range(plan.world_size) if ranks is None else sorted(ranks):
        v = plan.rank_view(rank)
        for shard in rank_param_shards(plan, rank):
            holders.setdefault(shard.name, []).append((rank, v, shard))
    segments: list[Segment] = []
    for name in sorted(holders, key=order.__getitem__):
        entries = holders[name]
        bounds: set[int] = set()
        for _, _, shard in entries:
            for p in shard.pieces:
                bounds.update((p.global_start, p.global_start + p.length))
        cuts = sorted(bounds)
        for start, end in zip(cuts, cuts[1:]):
            members: list[tuple[int, int]] = []
            contributors: set[int] = set()
            for rank, v, shard in entries:
                for p in shard.pieces:
                    if p.global_start <= start and end <= p.global_start + p.length:
                        members.append((rank, p.local_start + start - p.global_start))
                        if (
                            not shard.tp_replicated
                            or v.tp_rank == 0
                            or (v.sequence_parallel and not shard.whole_sequence)
                        ):
                            contributors.add(rank)
            if members:
                members.sort()
                segments.append(
                    Segment(
                        name,
                        entries[0][2].dim,
                        start,
                        end,
                        tuple(members),
                        frozenset(contributors),
                        members[0][0],
                    )
                )
    return segments


def island_ranks(plan: Plan) -> list[tuple[int, ...]]:
    """The ranks of each island's pipelines, in island order (planner.islands)."""
    return [
        tuple(sorted(r for p in pipes for r in plan.pipelines[p].ranks))
        for pipes in plan.island_pipelines()
    ]


def island_segments(plan: Plan) -> list[Segment]:
    """The segments the per-step gradient sync sums: `gradient_segments` over each island's
    ranks, island after island (one island: the plan's own segments). Each island holds every
    parameter, so its segments sum to the gradient of its own batch."""
    if len(plan.island_pipelines()) == 1:
        return gradient_segments(plan)
    return [seg for ranks in island_ranks(plan) for seg in gradient_segments(plan, ranks)]


def segment_numel(shape: Sequence[int], seg: Segment) -> int:
    """Elements of one segment of a parameter of canonical `shape`."""
    return (seg.end - seg.start) * _row_numel(shape, seg.dim)


def _row_numel(shape: Sequence[int], dim: int) -> int:
    """Elements of one index along `dim` of a tensor of `shape`."""
    n = 1
    for i, size in enumerate(shape):
        if i != dim:
            n *= size
    return n


def reduced_together(seg: Segment, shard_optimizer_state: bool) -> bool:
    """Whether a segment takes part in a collective over its holders.

    Only a segment with several contributors needs one for the gradient sum; with the optimizer
    state sharded, TP replicas also share their segments' state, so every segment with several
    holders does."""
    return seg.needs_reduce or (shard_optimizer_state and len(seg.members) > 1)


# ----------------------------------------------------------------------- distributed optimizer


def optimizer_weight(gpu: str, optimizer_shard: str) -> float:
    """A holder's weight when a segment's fp32 master and Adam state is cut among its holders.

    `optimizer_shard` "memory": the catalog memory of the rank's GPU (`gpu` is the plan's
    ranks[r].gpu), so the split follows from the plan alone and is the same on every launch;
    "even": 1 for everyone.
    """
    return get_gpu(gpu).memory_gb if optimizer_shard == "memory" else 1.0


def optimizer_split(seg: Segment, weight_of: Callable[[int], float]) -> list[int]:
    """Rows along `seg.dim` of segment `seg` that each holder (in `seg.ranks` order) owns the
    optimizer state of: `weighted_split` of its length by `weight_of(rank)`."""
    return weighted_split(seg.end - seg.start, [weight_of(r) for r in seg.ranks])


def optimizer_elements(
    model: ModelSpec, segments: Iterable[Segment], weight_of: Callable[[int], float]
) -> dict[int, int]:
    """{rank: elements of fp32 master + Adam state it owns} under the distributed optimizer.

    Every segment (with the state sharded, each is its own holders' collective, see
    `reduced_together`) is cut by `optimizer_split`; a rank owns its rows times the elements
    per row. The runtime (megatron_hexi.distributed_optimizer) cuts with the same functions.
    """
    per_row = {sh.name: _row_numel(sh.shape, sh.dim) for sh in canonical_shards(model)}
    owned: dict[int, int] = {}
    for seg in segments:
        inner = per_row[seg.name]
        for r, rows in zip(seg.ranks, optimizer_split(seg, weight_of)):
            owned[r] = owned.get(r, 0) + rows * inner
    return owned


def plan_optimizer_elements(plan: Plan) -> dict[int, int]:
    """`optimizer_elements` of a plan under its own `training.optimizer_shard`."""
    mode = plan.training.optimizer_shard
    return optimizer_elements(
        plan.model, gradient_segments(plan), lambda r: optimizer_weight(plan.ranks[r].gpu, mode)
    )
