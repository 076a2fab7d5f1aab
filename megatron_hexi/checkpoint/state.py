"""What a rank writes and reads besides its weights: which canonical ranges it owns
(`writer_segments`, `owned_ranges`), the optimizer state (Adam's moments and step, read back by
`restore_optimizer`), the loss scaler's state (`scaler_state`, `restore_scaler`) and the RNG
states. A checkpoint reads a trainer through `TrainState` only.

Optimizer state is reached only through `owned_ranges` (what a rank writes) and
`restore_optimizer` (what it reads), for megatron-core's FP32/Float16 optimizers and for the
distributed optimizer (megatron_hexi.distributed_optimizer) alike: the files hold canonical
ranges, so a checkpoint saved with either loads with either, under any plan.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import numpy as np
import torch

from megatron_hexi.adam import step_state
from megatron_hexi.checkpoint.format import ADAM_MOMENTS, SGD_MOMENTS, island_kind
from planner.layout import canonical_shards, island_segments, segment_numel

if TYPE_CHECKING:
    import numpy.typing as npt
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_hexi.checkpoint.reader import Checkpoint
    from megatron_hexi.outer_step import OuterStep
    from planner.layout import ParamShard, Segment
    from planner.plan import Plan


class TrainState(Protocol):
    """What a checkpoint reads of a trainer (megatron_hexi.training.Trainer): the plan, this
    process's plan rank, its local parameters, the optimizer and the learning-rate schedule."""

    @property
    def plan(self) -> Plan: ...

    @property
    def rank(self) -> int: ...

    @property
    def params(self) -> Sequence[tuple[ParamShard, torch.Tensor]]: ...

    @property
    def optimizer(self) -> MegatronOptimizer: ...

    @property
    def scheduler(self) -> OptimizerParamScheduler: ...

    @property
    def outer(self) -> OuterStep: ...


class OwnedRange(NamedTuple):
    """What this rank writes of one canonical range: [start, start + length) along `dim` of
    canonical tensor `name` of shape `shape`, as {kind: tensor}."""

    name: str
    dim: int
    shape: tuple[int, ...]
    start: int
    tensors: dict[str, torch.Tensor]


class Run(NamedTuple):
    """Owned segments of one local parameter, merged: `length` elements along the shard's dim,
    from `local_start` in `param` and from `global_start` in the canonical tensor."""

    shard: ParamShard
    param: torch.Tensor
    local_start: int
    global_start: int
    length: int


def writer_segments(plan: Plan) -> dict[int, list[Segment]]:
    """{plan rank: [Segment]}: every atomic segment once, by the least-loaded rank holding it;
    under islands once per island (each island holds its own weights), by one of its ranks."""
    shapes = {s.name: s.shape for s in canonical_shards(plan.model)}
    load = [0] * plan.world_size
    out: dict[int, list[Segment]] = {r: [] for r in range(plan.world_size)}
    for seg in island_segments(plan):
        writer = min(seg.ranks, key=lambda r: (load[r], r))
        load[writer] += segment_numel(shapes[seg.name], seg)
        out[writer].append(seg)
    return out


def local_runs(
    params: Iterable[tuple[ParamShard, torch.Tensor]], segments: Iterable[Segment]
) -> list[Run]:
    """This rank's owned segments, merged into runs that are contiguous both locally and in the
    canonical tensor."""
    owned: dict[str, list[tuple[int, int]]] = {}
    for seg in segments:
        owned.setdefault(seg.name, []).append((seg.start, seg.end))
    runs = []
    for shard, param in params:
        intervals = owned.get(shard.name, [])
        for piece in shard.pieces:
            lo, hi = piece.global_start, piece.global_start + piece.length
            inside = sorted(iv for iv in intervals if lo <= iv[0] and iv[1] <= hi)
            intervals = [iv for iv in intervals if iv not in inside]
            merged: list[list[int]] = []
            for s, e in inside:
                if merged and merged[-1][1] == s:
                    merged[-1][1] = e
                else:
                    merged.append([s, e])
            for s, e in merged:
                runs.append(Run(shard, param, piece.local_start + s - lo, s, e - s))
        owned[shard.name] = intervals
    left = {n: iv for n, iv in owned.items() if iv}
    if left:
        raise RuntimeError(
            f"checkpoint: segments {left} are assigned to a rank that does not "
            f"hold them (layout bug)"
        )
    return runs


# ------------------------------------------------------------------------------ optimizer state
# The only functions that know how optimizer state is held. Two layouts:
# * megatron-core's FP32Optimizer / Float16Optimizer: torch AdamW state per local parameter (the
#   parameter itself in fp32, an fp32 master copy under bf16); this rank writes the segments
#   that writer_segments() gives it;
# * the distributed optimizer (megatron_hexi.distributed_optimizer): fp32 master weights and
#   Adam state per MasterPart, a canonical range owned by exactly one rank; each rank writes its
#   parts.
# Either way the files hold canonical ranges, so either optimizer loads what the other saved.


def _is_sharded(optimizer: MegatronOptimizer) -> bool:
    return hasattr(optimizer, "parts") and hasattr(optimizer, "all_gather_params")


def _main_params(optimizer: MegatronOptimizer) -> dict[int, torch.Tensor]:
    """{id(model parameter): the fp32 tensor the optimizer updates (itself in fp32 training)}."""
    if hasattr(optimizer, "float16_groups"):
        out = {}
        for g16, g32 in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            out.update({id(a): b for a, b in zip(g16, g32)})
        for group in optimizer.fp32_from_fp32_groups:
            out.update({id(a): a for a in group})
        return out
    return {id(p): p for g in optimizer.param_groups for p in g["params"]}


def _state(optimizer: MegatronOptimizer) -> dict[torch.Tensor, dict[str, Any]]:
    return optimizer.optimizer.state  # torch AdamW inside megatron-core's wrapper


def _with_moments(
    tensors: dict[str, torch.Tensor], state: Mapping[str, Any] | None
) -> dict[str, torch.Tensor]:
    for kind in (*ADAM_MOMENTS, *SGD_MOMENTS):
        if state and state.get(kind) is not None:
            tensors[kind] = state[kind]
    return tensors


def owned_ranges(trainer: TrainState) -> list[OwnedRange]:
    """What this rank writes: its canonical ranges of parameters and Adam moments (under its
    island's kinds), and of the outer state it represents (islands)."""
    island = trainer.plan.rank_view(trainer.rank).island
    shapes = {shard.name: shard.shape for shard, _ in trainer.params}
    outer = [
        OwnedRange(name, dim, shapes[name], start, tensors)
        for name, dim, start, tensors in trainer.outer.saved_ranges()
    ]
    return outer + [
        r._replace(tensors={island_kind(k, island): t for k, t in r.tensors.items()})
        for r in _model_ranges(trainer)
    ]


def _model_ranges(trainer: TrainState) -> list[OwnedRange]:
    opt = trainer.optimizer
    shapes = {shard.name: shard.shape for shard, _ in trainer.params}
    state = _state(opt)
    if _is_sharded(opt):
        return [
            OwnedRange(
                p.name,
                p.dim,
                shapes[p.name],
                p.global_start,
                _with_moments({"param": p.master}, state.get(p.master)),
            )
            for p in opt.parts
            if p.length
        ]
    main = _main_params(opt)
    out = []
    for run in local_runs(trainer.params, writer_segments(trainer.plan)[trainer.rank]):
        shard = run.shard
        mp = main[id(run.param)]
        tensors = _with_moments({"param": mp}, state.get(mp))
        out.append(
            OwnedRange(
                shard.name,
                shard.dim,
                shard.shape,
                run.global_start,
                {k: t.narrow(shard.dim, run.local_start, run.length) for k, t in tensors.items()},
            )
        )
    return out


def holds_sgd_momentum(optimizer: MegatronOptimizer) -> bool:
    """Whether this rank's optimizer holds SGD momentum buffers (--optimizer sgd, after step 1)."""
    return any(s.get("momentum_buffer") is not None for s in _state(optimizer).values())


def adam_steps(optimizer: MegatronOptimizer) -> set[int]:
    """The set of Adam step counts over this rank's optimizer state (empty before step 1)."""
    return {int(float(s["step"])) for s in _state(optimizer).values() if "step" in s}


@torch.no_grad()
def restore_optimizer(
    trainer: TrainState,
    ckpt: Checkpoint,
    adam_step: int | None,
    sgd: bool = False,
    island: int | None = None,
    weights: str | None = None,
) -> None:
    """Fill the fp32 master weights from the checkpoint's params and, if adam_step is not None,
    Adam's moments and step (`sgd`: SGD's momentum buffers instead); otherwise the optimizer
    state stays empty (fresh). Under islands, each rank reads the saved island `island` (None:
    its own island's); `weights`: the kind the masters are read from instead of that island's
    params (an island that joins starts from "outer_param")."""
    opt = trainer.optimizer
    state = _state(opt)
    if island is None:
        island = trainer.plan.rank_view(trainer.rank).island
    weights = weights or island_kind("param", island)
    kinds = SGD_MOMENTS if sgd else ADAM_MOMENTS

    def moments(
        name: str, dim: int, shape: Sequence[int], start: int, like: torch.Tensor, step: int
    ) -> dict[str, torch.Tensor]:
        out = {}
        for kind in kinds:
            t = torch.empty(like.shape, dtype=torch.float32)
            ckpt.read_range(island_kind(kind, island), name, dim, start, like.shape[dim], shape, t)
            out[kind] = t.to(like.device, like.dtype)
        return out if sgd else {"step": step_state(step, like, opt.optimizer), **out}

    if _is_sharded(opt):
        shapes = {shard.name: shard.shape for shard, _ in trainer.params}
        for p in opt.parts:
            if not p.length:
                continue
            value = torch.empty(p.master.shape, dtype=torch.float32)
            ckpt.read_range(
                weights,
                p.name,
                p.dim,
                p.global_start,
                p.length,
                shapes[p.name],
                value,
            )
            p.master.copy_(value)
            if adam_step is not None:
                state[p.master] = moments(
                    p.name, p.dim, shapes[p.name], p.global_start, p.master, adam_step
                )
        return
    main = _main_params(opt)
    for shard, param in trainer.params:
        mp = main[id(param)]
        if mp is not param:
            mp.copy_(ckpt.read_local(shard, weights))
        if adam_step is not None:
            st = {} if sgd else {"step": step_state(adam_step, mp, opt.optimizer)}
            for kind in kinds:
                st[kind] = ckpt.read_local(shard, island_kind(kind, island)).to(mp.device, mp.dtype)
            state[mp] = st


# ------------------------------------------------------------------------------- loss scaler


def scaler_state(optimizer: MegatronOptimizer) -> dict[str, Any] | None:
    """The loss scaler's state, JSON-ready (the same on every rank: they agree on every inf):
    the scale and, for dynamic scaling, its growth and hysteresis trackers; None unscaled."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is None:
        return None
    state: dict[str, Any] = {"scale": float(scaler.scale.item())}
    if isinstance(scaler, DynamicGradScaler):
        state["growth_tracker"] = int(scaler._growth_tracker)
        state["hysteresis_tracker"] = int(scaler._hysteresis_tracker)
    return state


def restore_scaler(optimizer: MegatronOptimizer, saved: Mapping[str, Any]) -> bool:
    """Continue dynamic loss scaling where `saved` (scaler_state) left it; False where there is
    nothing to restore (no scaler, a constant one: the run's --loss-scale holds, as in
    megatron-core, or a save without dynamic state). Set field by field: megatron-core's
    load_state_dict moves the scale to CUDA."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    scaler = getattr(optimizer, "grad_scaler", None)
    if not isinstance(scaler, DynamicGradScaler) or "growth_tracker" not in saved:
        return False
    scale, growth, hysteresis = (
        saved["scale"],
        saved["growth_tracker"],
        saved["hysteresis_tracker"],
    )
    if not (isinstance(scale, float) and scale > 0 and scale != float("inf")):
        raise ValueError(f"scale {scale!r} is not a positive finite number")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (growth, hysteresis)):
        raise ValueError(f"trackers {growth!r}, {hysteresis!r} are not integers")
    scaler._scale = torch.tensor([scale], dtype=torch.float, device=scaler.scale.device)
    scaler._growth_tracker = growth
    scaler._hysteresis_tracker = hysteresis
    return True


# ------------------------------------------------------------------------------------ RNG state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG states, JSON-ready: torch CPU, CUDA, megatron's tracker, Python, NumPy."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # the legacy tuple (get_state's default): numpy's stubs give the dict form too
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    py_state = random.getstate()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = _b64(torch.cuda.get_rng_state())
    return {
        "torch_cpu": _b64(torch.get_rng_state()),
        "cuda": cuda,
        "tracker": {
            k: _b64(_state_tensor(v)) for k, v in get_cuda_rng_tracker().get_states().items()
        },
        "python": [py_state[0], _b64_words(py_state[1]), py_state[2]],
        "numpy": [
            np_state[0],
            _b64_words(np_state[1]),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }


def _state_tensor(state: torch.Tensor | torch.Generator) -> torch.Tensor:
    """A tracker state as bytes: the graph-safe tracker (CUDA graphs) holds generators."""
    return state.get_state() if isinstance(state, torch.Generator) else state


def _into(held: object, saved: torch.Tensor) -> torch.Tensor | torch.Generator:
    """A saved tracker state for the tracker as it is: into its generator where it holds one
    (CUDA graphs register those generators), else the state tensor itself."""
    if isinstance(held, torch.Generator):
        held.set_state(saved)
        return held
    return saved


def _b64_words(words: npt.ArrayLike) -> str:
    return base64.b64encode(np.asarray(words, dtype=np.uint32).tobytes()).decode()


def _words(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.uint32)


def set_rng_state(state: Mapping[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    tracker = get_cuda_rng_tracker()
    held = tracker.get_states()
    tracker.set_states({k: _into(held.get(k), _unb64(v)) for k, v in state["tracker"].items()})
    py = state["python"]
    random.setstate((py[0], tuple(int(w) for w in _words(py[1])), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], _words(n[1]).copy(), n[2], n[3], n[4]))
