"""Draw a plan: pipelines, stages, TP groups and layers on top; per-rank memory below.

Top panel: one row per pipeline, x = layers; each stage is a box over its layers, cut into its
TP ranks in proportion to their shards (coloured by GPU type, labelled with rank and machine).
Bottom panel: every rank's simulated peak memory against its capacity, ranks grouped by machine.
A label that does not fit its box is shortened, set smaller or vertical, and left out when even
that does not fit (the picture says so). matplotlib (Agg) is imported here only, so the rest of
the planner never needs it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import SpecError
from planner.layout import unit_params

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure

    from planner.plan import Plan, Stage
    from planner.simulator import Estimate

BOX_BOTTOM, BOX_HEIGHT = 0.05, 0.72  # a stage's box inside its pipeline's row (row height 1)
STRIP_BOTTOM = BOX_BOTTOM + BOX_HEIGHT  # the stage labels sit between the box and the next row
FONT_SIZES = (7.5, 6.5, 6.0)  # points, largest first; a label that needs less is left out
DPI = 130


@dataclass(frozen=True)
class ShardBox:
    """One TP rank's rectangle in the top panel, in data coordinates (x: layers, y: rows)."""

    pipeline: int
    stage: int
    rank: int
    x: float
    y: float
    width: float
    height: float
    share: float  # the rank's fraction of its stage's sharded layer weights


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n word` with the noun agreeing with the count: 1 pipeline, 2 pipelines."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def percent(fraction: float) -> str:
    """A fraction as a percent, one decimal (33.3%); tiny non-zero values keep two digits."""
    if 0 < abs(fraction) < 0.001:
        return f"{100 * fraction:.2g}%"
    return f"{fraction:.1%}"


def shard_shares(plan: Plan, stage: Stage) -> list[float]:
    """Each TP rank's fraction of the stage's per-layer sharded weights (its query groups and
    FFN columns, which also set its share of the layer's matmul work): what its box shows."""
    u = unit_params(plan.model)
    weights = [
        q * u.query_group + f * u.ffn_column
        for q, f in zip(plan.shard_sizes(stage, "query_groups"), plan.shard_sizes(stage, "ffn"))
    ]
    total = sum(weights)
    return [w / total for w in weights]


def shard_boxes(plan: Plan) -> list[ShardBox]:
    """The top panel's geometry: pipeline p's row spans y in [P-1-p, P-p) (pipeline 0 on top);
    a stage's box spans its layers [first, last) along x, and its TP ranks are stacked from top
    to bottom in shard order, each as high as its share of the box."""
    boxes = []
    n = len(plan.pipelines)
    for p, pipe in enumerate(plan.pipelines):
        row = n - 1 - p
        for s, stage in enumerate(pipe.stages):
            a, b = stage.layers
            top = row + BOX_BOTTOM + BOX_HEIGHT
            for r, share in zip(stage.ranks, shard_shares(plan, stage)):
                h = share * BOX_HEIGHT
                top -= h
                boxes.append(ShardBox(p, s, r, a, top, b - a, h, share))
    return boxes


def _span(first: int, last: int, one: str, many: str) -> str:
    """`layer 3` or `layers 0-4` for the inclusive range [first, last]."""
    return f"{one} {first}" if first == last else f"{many} {first}-{last}"


def _rank_list(ranks: Sequence[int]) -> str:
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return _span(ranks[0], ranks[-1], "rank", "ranks")
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


class _Labeller:
    """Places each label at the largest readable form that fits its box, in pixels of the final
    layout; counts what it had to leave out."""

    def __init__(self, renderer: RendererBase) -> None:
        self.renderer = renderer
        self.omitted = 0

    def place(
        self,
        ax: Axes,
        box: tuple[float, float, float, float],
        candidates: Sequence[str],
        rotate: bool = True,
        pad_px: float = 2.0,
    ) -> str | None:
        """Put the first of `candidates` (longest first) that fits data box (x0, y0, x1, y1),
        horizontal before vertical and larger fonts first, the smallest font only once nothing
        fits at a larger one; returns the text placed, None if none fits."""
        x0, y0, x1, y1 = box
        (px0, py0), (px1, py1) = ax.transData.transform([(x0, y0), (x1, y1)])
        width, height = abs(px1 - px0) - 2 * pad_px, abs(py1 - py0) - 2 * pad_px
        line_px = FONT_SIZES[-1] * DPI / 72  # the figure is drawn at DPI
        if (max(width, height) if rotate else height) < line_px:  # no text fits: skip measuring
            self.omitted += 1
            return None
        text = ax.text((x0 + x1) / 2, (y0 + y1) / 2, "", ha="center", va="center")
        rotations = (0, 90) if rotate else (0,)
        # More words before the smallest font: the smallest size is the last resort.
        tries = [
            (label, rotation, size)
            for sizes in (FONT_SIZES[:-1], FONT_SIZES[-1:])
            for label in candidates
            for rotation in rotations
            for size in sizes
        ]
        for label, rotation, size in tries:
            text.set_text(label)
            text.set_fontsize(size)
            text.set_rotation(rotation)
            extent = text.get_window_extent(self.renderer)
            if extent.width <= width and extent.height <= height:
                return label
        text.remove()
        self.omitted += 1
        return None


def _integer_ticks(axis: Axis, count: int) -> None:
    """Ticks on whole numbers only (layers, ranks): every one of a few, else a round step."""
    from matplotlib.ticker import MaxNLocator

    if count <= 25:
        axis.set_ticks(range(count))
    else:
        axis.set_major_locator(MaxNLocator(nbins=20, integer=True, steps=[1, 2, 4, 5, 8, 10]))


def _check_path(path: str | os.PathLike[str]) -> None:
    """Refuse, before any drawing, a path that cannot take the file (one line naming it)."""
    name = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name):
        raise SpecError(f"{name}: is a folder; give the picture a file name")
    if not os.path.exists(folder):
        raise SpecError(f"{name}: cannot write the picture: folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise SpecError(f"{name}: cannot write the picture: {folder} is not a folder")
    if not os.access(folder, os.W_OK):
        raise SpecError(f"{name}: cannot write the picture: folder {folder} is not writable")


def _islands_line(plan: Plan, est: Estimate) -> str:
    """The title's line on islands (I<i> before a pipeline's label is its island), or ''."""
    o = plan.training.outer
    if o is None or est.inner_step_time_s is None:
        return ""
    k = len(plan.island_pipelines())
    return (
        f"\n{plural(k, 'island')}, outer step every {o.interval} steps ({o.optimizer}, "
        f"{o.compression}, {plural(o.fragments, 'fragment')}): inner step "
        f"{est.inner_step_time_s:.3g} s + outer sync {est.outer_sync_time_s or 0:.3g} s/step, "
        f"{(est.cross_site_bytes_per_step or 0) / 1e6:,.3g} MB across sites/step"
    )


def draw_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write the plan's picture to `path` as PNG; a path that cannot be written is a SpecError
    naming it, which the CLI prints as one line."""
    _check_path(path)
    fig = plan_figure(plan)
    try:
        fig.savefig(path, dpi=DPI, format="png")
    except OSError as e:
        raise SpecError(f"{os.fspath(path)}: cannot write the picture ({e.strerror or e})")


def plan_figure(plan: Plan) -> Figure:
    """The plan's picture as a matplotlib Figure on an Agg canvas (no pyplot, so no global
    backend or open-figure state); each shard's rectangle has gid `shard:RANK`."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    from planner.simulator import simulate

    est = simulate(plan)
    L = plan.model.num_layers
    P = len(plan.pipelines)
    n = plan.world_size
    gpus = sorted({r.gpu for r in plan.ranks})
    palette = matplotlib.colormaps["tab10"]
    colour = {g: palette(i % 10) for i, g in enumerate(gpus)}

    # Rows of 0.75 in, thinner from 13 pipelines on; the top panel stays within 14 in.
    row_in = min(0.75, max(0.2, 9.0 / P), 14.0 / P)
    top_in = max(1.6, P * row_in)
    fig = Figure(figsize=(13, top_in + 4.4), dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [top_in, 2.6]})

    boxes = shard_boxes(plan)
    for bx in boxes:
        top.add_patch(
            Rectangle(
                (bx.x, bx.y),
                bx.width,
                bx.height,
                facecolor=colour[plan.ranks[bx.rank].gpu],
                edgecolor="white",
                linewidth=0.6,
                gid=f"shard:{bx.rank}",
            )
        )
    for p, pipe in enumerate(plan.pipelines):
        for st in pipe.stages:
            a, b = st.layers
            top.add_patch(
                Rectangle(
                    (a, P - 1 - p + BOX_BOTTOM),
                    b - a,
                    BOX_HEIGHT,
                    fill=False,
                    edgecolor="black",
                    linewidth=1.0,
                )
            )
    top.set_xlim(0, L)
    top.set_ylim(0, P)
    _integer_ticks(top.xaxis, L + 1)
    top.set_xlabel("layer (a stage's box covers its layers [first, last))")
    step = math.ceil(P / 40)  # at most 40 pipeline labels
    long_labels = row_in >= 0.4  # room for two lines
    island = plan.island_of()
    tag = [f"I{island[p]} " if plan.islands else "" for p in range(P)]
    top.set_yticks(
        [P - 1 - p + BOX_BOTTOM + BOX_HEIGHT / 2 for p in range(0, P, step)],
        [
            f"{tag[p]}P{p}\n{plural(pipe.num_microbatches, 'micro-batch', 'micro-batches')}"
            f" of {plural(pipe.micro_batch_size, 'sample')}"
            if long_labels
            else f"{tag[p]}P{p}"
            for p, pipe in list(enumerate(plan.pipelines))[::step]
        ],
        fontsize=8 if row_in >= 0.25 else 6,
    )
    top.tick_params(axis="y", length=0)
    top.legend(
        handles=[Patch(color=colour[g], label=g) for g in gpus],
        loc="lower right",
        bbox_to_anchor=(1, 1.0),
        fontsize=7.5,
        ncol=min(4, len(gpus)),
        frameon=False,
    )
    flags = [
        name
        for name, on in (
            ("recompute", plan.training.recompute),
            ("distributed optimizer", plan.training.use_distributed_optimizer),
            ("overlap grad reduce", plan.training.overlap_grad_reduce),
            ("overlap param gather", plan.training.overlap_param_gather),
            (f"{plan.training.attention_backend} attention", True),
            ("sequence parallel", plan.training.sequence_parallel),
            ("Transformer Engine", plan.training.transformer_impl == "transformer_engine"),
            (
                f"{plan.training.cuda_graph_impl} CUDA graphs",
                plan.training.cuda_graph_impl != "none",
            ),
        )
        if on
    ]
    top.set_title(
        f"{plan.model.name or 'model'} on {plan.cluster.name}: {plural(P, 'pipeline')}, "
        f"{plural(n, 'GPU')}, global batch {plan.global_batch_size}"
        f"{''.join(', ' + f for f in flags)}{_islands_line(plan, est)}\n"
        f"{est.iteration_time_s:.3g} s/iteration, {est.tokens_per_s:,.0f} tokens/s, "
        f"MFU {percent(est.mfu)}",
        fontsize=10,
        loc="left",
    )

    xs = list(range(n))
    over = [est.peak_memory_gb[r] > est.memory_capacity_gb[r] for r in xs]
    bottom.bar(xs, est.memory_capacity_gb, color="#dddddd", width=0.9)
    bottom.bar(
        xs,
        est.peak_memory_gb,
        width=0.6,
        color=[colour[plan.ranks[r].gpu] for r in xs],
        edgecolor=["black" if o else "none" for o in over],
        hatch=["////" if o else "" for o in over],
        linewidth=0.8,
    )
    groups: list[tuple[str, int, int]] = []  # (machine, first rank, last rank + 1)
    for r in xs:
        node = plan.ranks[r].node
        if groups and groups[-1][0] == node and groups[-1][2] == r:
            groups[-1] = (node, groups[-1][1], r + 1)
        else:
            groups.append((node, r, r + 1))
    separate = len(groups) <= 64  # beyond that the lines hide the bars
    if separate:
        for _, first, _ in groups[1:]:
            bottom.axvline(first - 0.5, color="grey", linewidth=0.5)
    bottom.set_xlim(-0.6, n - 0.4)
    top_gb = max(max(est.memory_capacity_gb), max(est.peak_memory_gb))
    bottom.set_ylim(0, top_gb * 1.18)  # headroom for the machine names
    _integer_ticks(bottom.xaxis, n)
    bottom.set_ylabel("GB")
    bottom.set_xlabel(f"rank{' (machines separated by lines)' if separate else ''}")
    bottom.set_title("simulated peak memory per rank vs capacity", fontsize=9, loc="left")
    bottom.legend(
        handles=[
            Patch(color="#dddddd", label="capacity"),
            Patch(color="grey", label="peak use (GPU colour)"),
            *(
                [Patch(facecolor="white", edgecolor="black", hatch="////", label="over capacity")]
                if any(over)
                else []
            ),
        ],
        loc="lower right",
        bbox_to_anchor=(1, 1.0),
        fontsize=7.5,
        ncol=3,
        frameon=False,
    )
    fig.text(0.01, 0.035, f"bottleneck: {est.bottleneck}"[:220], fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))

    # Labels go in last, sized against the final layout.
    canvas.draw()
    labeller = _Labeller(canvas.get_renderer())
    for bx in boxes:
        rk = plan.ranks[bx.rank]
        even = all(
            abs(o.share - bx.share) < 1e-9
            for o in boxes
            if o.pipeline == bx.pipeline and o.stage == bx.stage
        )
        # An uneven shard shows its share before it shows its machine.
        names = (
            [f"r{bx.rank} {rk.node}"]
            if even
            else [f"r{bx.rank} {rk.node}: {bx.share:.0%}", f"r{bx.rank}: {bx.share:.0%}"]
        )
        names.append(f"r{bx.rank}")
        labeller.place(top, (bx.x, bx.y, bx.x + bx.width, bx.y + bx.height), names)
    for p, pipe in enumerate(plan.pipelines):
        row = P - 1 - p
        for s, st in enumerate(pipe.stages):
            a, b = st.layers
            layers = _span(a, b - 1, "layer", "layers")
            labeller.place(
                top,
                (a, row + STRIP_BOTTOM, b, row + 1),
                [
                    f"S{s} TP{st.tp_size}, {layers}, {_rank_list(st.ranks)}",
                    f"S{s} TP{st.tp_size}, {layers}",
                    f"S{s} TP{st.tp_size}",
                    f"S{s}",
                ],
                rotate=False,
                pad_px=0.5,
            )
    for node, first, end in groups:
        labeller.place(
            bottom, (first - 0.45, top_gb * 1.02, end - 0.55, top_gb * 1.18), [node], rotate=False
        )
    if labeller.omitted:
        fig.text(
            0.01,
            0.012,
            f"{plural(labeller.omitted, 'label')} left out where too small to read; "
            f"`hexi-plan show PLAN` lists every stage's ranks, layers and shards.",
            fontsize=7,
            color="#555555",
        )
    return fig
