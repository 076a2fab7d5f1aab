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
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    local_start: int
    global_start: int
    length: int


@dataclass(frozen=True)
class ParamShard:
    """One local parameter: its canonical name and shape, and the pieces it holds."""
    local_name: str                 # name inside this rank's stage model
    name: str                       # canonical name in the one-device model
    shape: tuple                    # canonical shape
    dim: int                        # dimension the pieces run along
    pieces: tuple
    tp_replicated: bool             # identical on every rank of the stage (norms, row biases)
    init: str                       # "normal", "scaled_normal" (output projections) or "ones"/"zeros"

    @property
    def local_shape(self):
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
    members: tuple                  # ((rank, local_start), ...) sorted by rank
    contributors: frozenset         # ranks whose gradient is summed (one per TP-replicated stage)
    owner: int                      # the rank that counts this segment in the gradient norm

    @property
    def ranks(self):
        return tuple(r for r, _ in self.members)

    @property
    def needs_reduce(self):
        """Only one contributor: every holder already has the full sum (TP replicas of one
        stage hold identical gradients), so no collective is needed."""
        return len(self.contributors) > 1


def _full(local_name, name, shape, init, replicated=True):
    return ParamShard(local_name, name, tuple(shape), 0, (Piece(0, 0, shape[0]),), replicated, init)


def rank_param_shards(plan, rank):
    """The ParamShards of `rank`'s stage model, in the model's own parameter order."""
    return param_shards(plan.model, plan.rank_view(rank))


def param_shards(m, v):
    """ParamShards of a stage model of spec `m` for a RankView-like `v`."""
    d, hpg = m.head_dim, m.heads_per_group
    h, F, V = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    qkv_rows_per_group = (hpg + 2) * d
    norm_params = ["weight"] + (["bias"] if m.normalization == "LayerNorm" else [])
    out = []
    if v.holds_embedding:
        out.append(ParamShard("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
                              (V, h), 0, (Piece(0, v.vocab[1], v.vocab[0]),), False, "normal"))
    qg_n, qg_off = v.query_groups
    heads_n, heads_off = v.heads
    f_n, f_off = v.ffn
    for j, layer in enumerate(range(*v.layers)):
        lp, gp = f"decoder.layers.{j}.", f"decoder.layers.{layer}."
        for p in norm_params:
            out.append(_full(f"{lp}input_layernorm.{p}", f"{gp}input_layernorm.{p}", (h,),
                             "ones" if p == "weight" else "zeros"))
        qkv = Piece(0, qg_off * qkv_rows_per_group, qg_n * qkv_rows_per_group)
        qkv_shape = (m.num_query_groups * qkv_rows_per_group, h)
        out.append(ParamShard(f"{lp}self_attention.linear_qkv.weight",
                              f"{gp}self_attention.linear_qkv.weight", qkv_shape, 0, (qkv,), False,
                              "normal"))
        if m.add_bias_linear:
            out.append(ParamShard(f"{lp}self_attention.linear_qkv.bias",
                                  f"{gp}self_attention.linear_qkv.bias", qkv_shape[:1], 0, (qkv,),
                                  False, "zeros"))
        out.append(ParamShard(f"{lp}self_attention.linear_proj.weight",
                              f"{gp}self_attention.linear_proj.weight",
                              (h, m.num_attention_heads * d), 1,
                              (Piece(0, heads_off * d, heads_n * d),), False, "scaled_normal"))
        if m.add_bias_linear:
            out.append(_full(f"{lp}self_attention.linear_proj.bias",
                             f"{gp}self_attention.linear_proj.bias", (h,), "zeros"))
        for p in norm_params:
            out.append(_full(f"{lp}pre_mlp_layernorm.{p}", f"{gp}pre_mlp_layernorm.{p}", (h,),
                             "ones" if p == "weight" else "zeros"))
        if m.swiglu:
            fc1_pieces = (Piece(0, f_off, f_n), Piece(f_n, F + f_off, f_n))
        else:
            fc1_pieces = (Piece(0, f_off, f_n),)
        out.append(ParamShard(f"{lp}mlp.linear_fc1.weight", f"{gp}mlp.linear_fc1.weight",
                              (m.ffn_width, h), 0, fc1_pieces, False, "normal"))
        if m.add_bias_linear:
            out.append(ParamShard(f"{lp}mlp.linear_fc1.bias", f"{gp}mlp.linear_fc1.bias",
                                  (m.ffn_width,), 0, fc1_pieces, False, "zeros"))
        out.append(ParamShard(f"{lp}mlp.linear_fc2.weight", f"{gp}mlp.linear_fc2.weight", (h, F),
                              1, (Piece(0, f_off, f_n),), False, "scaled_normal"))
        if m.add_bias_linear:
            out.append(_full(f"{lp}mlp.linear_fc2.bias", f"{gp}mlp.linear_fc2.bias", (h,), "zeros"))
    if v.holds_output:
        for p in norm_params:
            out.append(_full(f"decoder.final_layernorm.{p}", f"decoder.final_layernorm.{p}", (h,),
                             "ones" if p == "weight" else "zeros"))
        tied = not m.untie_embeddings_and_output_weights
        if not (tied and v.holds_embedding):   # tied on one stage: one tensor serves both uses
            out.append(ParamShard("output_layer.weight",
                                  "embedding.word_embeddings.weight" if tied else "output_layer.weight",
                                  (V, h), 0, (Piece(0, v.vocab[1], v.vocab[0]),), False, "normal"))
    return out


@dataclass(frozen=True)
class _WholeModel:
    """The view of a rank that holds the whole model: lists canonical parameters in order."""
    layers: tuple
    query_groups: tuple
    heads: tuple
    ffn: tuple
    vocab: tuple
    holds_embedding: bool = True
    holds_output: bool = True


def canonical_shards(m):
    """ParamShards of the one-device model of spec `m`: canonical names, shapes and order."""
    return param_shards(m, _WholeModel((0, m.num_layers), (m.num_query_groups, 0),
                                       (m.num_attention_heads, 0), (m.ffn_hidden_size, 0),
                                       (m.vocab_size, 0)))


def gradient_segments(plan):
    """Every atomic gradient segment of the model, in one global order (parameter, start).

    All ranks compute the same list from the plan, so they can issue collectives in one order.
    """
    order = {sh.name: i for i, sh in enumerate(canonical_shards(plan.model))}
    holders = {}
    for rank in range(plan.world_size):
        v = plan.rank_view(rank)
        for shard in rank_param_shards(plan, rank):
            holders.setdefault(shard.name, []).append((rank, v, shard))
    segments = []
    for name in sorted(holders, key=order.__getitem__):
        entries = holders[name]
        bounds = set()
        for _, _, shard in entries:
            for p in shard.pieces:
                bounds.update((p.global_start, p.global_start + p.length))
        bounds = sorted(bounds)
        for start, end in zip(bounds, bounds[1:]):
            members, contributors = [], set()
            for rank, v, shard in entries:
                for p in shard.pieces:
                    if p.global_start <= start and end <= p.global_start + p.length:
                        members.append((rank, p.local_start + start - p.global_start))
                        if not shard.tp_replicated or v.tp_rank == 0:
                            contributors.add(rank)
            if members:
                members.sort()
                segments.append(Segment(name, entries[0][2].dim, start, end, tuple(members),
                                        frozenset(contributors), members[0][0]))
    return segments


def segment_numel(shape, seg):
    """Elements of one segment of a parameter of canonical `shape`."""
    n = seg.end - seg.start
    for i, size in enumerate(shape):
        if i != seg.dim:
            n *= size
    return n
