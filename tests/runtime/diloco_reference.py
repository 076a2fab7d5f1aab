"""A one-process DiLoCo that the island runs must equal: the rules of planner.islands written
out on full tensors, independently of megatron_hexi.outer_step.

One one-rank model (the runtime's, built from a one-rank plan of the same model and data) runs
each island's samples in turn: the samples its pipelines read from each global batch. Every
island keeps its own full parameters and its own AdamW (fp32, Megatron's no-decay rule for 1-D
tensors); its gradient is the mean over its tokens, clipped by its own norm. Every `interval`
steps (per fragment, at its offset) each canonical range (planner.outer_traffic.outer_ranges:
the same cuts the plan's holders make) is averaged over the islands by their samples, rounded
first under bf16 / int8, and the outer sgd or Nesterov step applied; with several fragments the
result is written before the next step's update (which applies to it; after the last step, never),
with one at once.
"""

import copy
import math

import torch

from runtime.workers import BASE_FLAGS

INT8_BLOCK = 256  # planner.islands.INT8_BLOCK, restated: the reference reads the rule, not code


def _int8_round_trip(x):
    """Blocks of 256, fp32 scale max|x| / 127, round half to even, dequantised."""
    flat = x.reshape(-1)
    n = flat.numel()
    blocks = math.ceil(n / INT8_BLOCK)
    rows = torch.nn.functional.pad(flat, (0, blocks * INT8_BLOCK - n)).view(blocks, INT8_BLOCK)
    scale = rows.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return (q.float() * scale[:, None]).reshape(-1)[:n].view_as(x)


def _sent(x, compression):
    if compression == "bf16":
        return x.to(torch.bfloat16).float()
    if compression == "int8":
        return _int8_round_trip(x)
    return x


def _island_samples(plan, island, iteration):
    """Global sample indices of the island's pipelines' micro-batches, as [[index, ...], ...]."""
    micro, offset = [], 0
    starts = []
    for p in plan.pipelines:
        starts.append(offset)
        offset += p.num_samples
    for p in plan.island_pipelines()[island]:
        pipe = plan.pipelines[p]
        base = iteration * plan.global_batch_size + starts[p]
        for m in range(pipe.num_microbatches):
            first = base + m * pipe.micro_batch_size
            micro.append(list(range(first, first + pipe.micro_batch_size)))
    return micro


def _island_sites(plan):
    """Each island's sites (the sets of its nodes' sites): what names an island across plans."""
    site = {n.name: n.site for n in plan.cluster.nodes}
    return [
        frozenset(site[plan.ranks[r].node] for p in pipes for r in plan.pipelines[p].ranks)
        for pipes in plan.island_pipelines()
    ]


def _full(values, ranges, like):
    """Values per range of `ranges` ({range index: tensor}) as full tensors ({name: tensor},
    shaped as `like`'s)."""
    whole = {n: torch.zeros_like(t) for n, t in like.items()}
    for r, v in values.items():
        seg = ranges[r].segment
        whole[seg.name].narrow(seg.dim, seg.start, seg.end - seg.start).copy_(v)
    return whole


def _recut(values, ranges, new_ranges, like):
    """Values per range of `ranges` as values per range of `new_ranges` (through `_full`)."""
    whole = _full(values, ranges, like)
    out = {}
    for r, rr in enumerate(new_ranges):
        seg = rr.segment
        out[r] = whole[seg.name].narrow(seg.dim, seg.start, seg.end - seg.start).clone()
    return out


def diloco(island_plan_paths, one_rank_plan_path, extra_flags=()):
    """Run the reference for each island plan (same model, same flags); a list of
    {"losses", "islands": [{name: tensor}] per island}.

    An entry (path, step, next_path, ...) is a run that continues after `step` steps under the
    plan `next_path` with other islands (a site lost or back, a restart from the checkpoint of
    that step), and so on: each of its islands continues from the weights and AdamW state of the
    island on the same sites, or, on a site that joins, from theta_outer with the AdamW state of
    the first island that continues; theta_outer and the outer momentum carry over, a fragment
    whose outer step was taken but not yet written is written by the islands of the new plan (it
    averaged the islands of before), and later outer steps average the new plan's islands by
    their samples. With no outer step in `next_path` (one island left, synchronous), the outer
    state and any result not yet written are dropped."""
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import Trainer, init_distributed
    from planner.outer_traffic import outer_ranges
    from planner.plan import load_plan

    args = parse_args(["--hetero-plan-path", str(one_rank_plan_path), *BASE_FLAGS, *extra_flags])
    one, config = load_plan(args.hetero_plan_path), run_config(args)
    device = init_distributed(one, config)
    trainer = Trainer(one, config, device)
    names = [shard.name for shard, _ in trainer.params]
    params = [p for _, p in trainer.params]
    initial = [p.detach().clone() for p in params]
    o = config.optimizer
    results = []
    for path in island_plan_paths:
        path, *chain = path if isinstance(path, tuple) else (path,)
        restarts = dict(zip(chain[0::2], chain[1::2]))  # step -> the plan from there
        plan = load_plan(path)
        outer, k = plan.training.outer, len(plan.island_pipelines())
        weights = [
            sum(plan.pipelines[p].num_samples for p in pipes) / plan.global_batch_size
            for pipes in plan.island_pipelines()
        ]
        islands = [[t.clone() for t in initial] for _ in range(k)]

        def adamw(own):
            decay = [t for n, t in zip(names, own) if t.ndim > 1 and not n.endswith(".bias")]
            rest = [t for n, t in zip(names, own) if t.ndim == 1 or n.endswith(".bias")]
            groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
            return torch.optim.AdamW(
                groups,
                lr=o.lr,
                betas=(o.adam_beta1, o.adam_beta2),
                eps=o.adam_eps,
                weight_decay=o.weight_decay,
                fused=True,
            )

        opts = [adamw(own) for own in islands]
        index = {n: i for i, n in enumerate(names)}
        ranges = outer_ranges(plan)
        theta = {}
        for r, rr in enumerate(ranges):
            seg = rr.segment
            start = islands[0][index[seg.name]]
            theta[r] = start.narrow(seg.dim, seg.start, seg.end - seg.start).clone()
        buf = {r: torch.zeros_like(t) for r, t in theta.items()}
        landing = []  # (range, value) to write before the next update
        quantum = 0.0  # bf16 / int8: the largest change of theta one rounding step makes
        losses = []
        for it in range(config.training.train_iters):
            if it in restarts:  # the restart under other islands
                new = load_plan(restarts[it])
                before, after = _island_sites(plan), _island_sites(new)
                source = [before.index(s) if s in before else None for s in after]
                like = dict(zip(names, initial))
                start = _full(theta, ranges, like)  # where an island that joins starts
                first = next(i for i in source if i is not None)
                moved = []
                for i in source:
                    if i is not None:
                        moved.append((islands[i], opts[i]))
                        continue
                    own = [start[n].clone() for n in names]
                    opt = adamw(own)  # the first continuing island's Adam state, copied
                    opt.load_state_dict(copy.deepcopy(opts[first].state_dict()))
                    moved.append((own, opt))
                islands, opts = [m[0] for m in moved], [m[1] for m in moved]
                outer, k = new.training.outer, len(new.island_pipelines())
                weights = [
                    sum(new.pipelines[p].num_samples for p in pipes) / new.global_batch_size
                    for pipes in new.island_pipelines()
                ]
                new_ranges = outer_ranges(new) if outer is not None else []
                landed = {ranges[r].fragment for r, _ in landing}
                theta = _recut(theta, ranges, new_ranges, like)
                buf = _recut(buf, ranges, new_ranges, like)
                ranges, plan = new_ranges, new
                landing = [
                    (r, theta[r].clone()) for r, rr in enumerate(ranges) if rr.fragment in landed
                ]
            loss_sum, tokens_all, grads = 0.0, 0.0, []
            for isl in range(k):
                with torch.no_grad():
                    for p, t in zip(params, islands[isl]):
                        p.copy_(t)
                        p.grad = None
                tokens = 0.0
                for micro in _island_samples(plan, isl, it):
                    batch = [trainer.dataset[i] for i in micro]
                    b = {key: torch.stack([s[key] for s in batch]) for key in batch[0]}
                    logits = trainer.model(b["tokens"], b["position_ids"], None)
                    loss, _, _ = trainer._loss(b["labels"], b["loss_mask"], logits)
                    loss.backward()
                    loss_sum += loss.item()
                    tokens += b["loss_mask"].sum().item()
                g = [p.grad.detach() / tokens for p in params]
                if o.clip_grad > 0:
                    norm = torch.stack([x.norm() for x in g]).double().square().sum().sqrt()
                    factor = min(1.0, o.clip_grad / (norm.item() + 1e-6))
                    g = [x * factor for x in g]
                grads.append(g)
                tokens_all += tokens
            losses.append(loss_sum / tokens_all)
            _write(landing, ranges, islands, index)
            landing = []
            for isl in range(k):
                for t, x in zip(islands[isl], grads[isl]):
                    t.grad = x.clone()
                opts[isl].step()
            step = it + 1
            if outer is None:
                continue
            for f in range(outer.fragments):
                if step % outer.interval != (f * outer.interval) // outer.fragments:
                    continue
                for r, rr in enumerate(ranges):
                    if rr.fragment != f:
                        continue
                    seg = rr.segment
                    delta = None
                    for isl in range(k):
                        mine = islands[isl][index[seg.name]].narrow(
                            seg.dim, seg.start, seg.end - seg.start
                        )
                        d = theta[r] - mine
                        if outer.compression != "none":  # one rounding step, as it moves theta
                            spacing = 1 / 127 if outer.compression == "int8" else 2.0**-7
                            step_size = outer.lr * (1 + outer.momentum) * weights[isl] * spacing
                            quantum = max(quantum, step_size * d.abs().max().item())
                        term = weights[isl] * (_sent(d, outer.compression) if k > 1 else d)
                        delta = term if delta is None else delta + term
                    buf[r] = outer.momentum * buf[r] + delta
                    stepped = buf[r]
                    if outer.optimizer == "nesterov":
                        stepped = delta + outer.momentum * buf[r]
                    theta[r] = theta[r] - outer.lr * stepped
                    landing.append((r, theta[r].clone()))
            if outer.fragments == 1:
                _write(landing, ranges, islands, index)
                landing = []
        # an outer step started after the last step lands before a next one's update: never
        results.append(
            {
                "losses": losses,
                "islands": [{n: t.clone() for n, t in zip(names, own)} for own in islands],
                "rounding_quantum": quantum,
            }
        )
    return results


@torch.no_grad()
def _write(landing, ranges, islands, index):
    for r, value in landing:
        seg = ranges[r].segment
        for own in islands:
            own[index[seg.name]].narrow(seg.dim, seg.start, seg.end - seg.start).copy_(value)
