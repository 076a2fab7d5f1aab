"""Draw a plan: pipelines, stages, TP groups and layers on top; per-rank memory below.

Top panel: one row per pipeline, x = layers; each stage is a box over its layers, cut into its
TP ranks (coloured by GPU type, labelled with rank and machine). Bottom panel: every rank's
simulated peak memory against its capacity, ranks grouped by machine. matplotlib (Agg) is
imported here only, so the rest of the planner never needs it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.plan import Plan


def draw_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from planner.simulator import simulate

    est = simulate(plan)
    L = plan.model.num_layers
    gpus = sorted({r.gpu for r in plan.ranks})
    palette = plt.get_cmap("tab10")
    colour = {g: palette(i % 10) for i, g in enumerate(gpus)}
    P = len(plan.pipelines)
    fig_h = 2.5 + 0.9 * P + 2.5
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, fig_h), gridspec_kw={"height_ratios": [max(1.5, 0.9 * P), 2.5]}
    )
    for p, pipe in enumerate(plan.pipelines):
        y0 = P - 1 - p
        for s, st in enumerate(pipe.stages):
            a, b = st.layers
            t = len(st.ranks)
            h = 0.8 / t
            for i, r in enumerate(st.ranks):
                rk = plan.ranks[r]
                top.add_patch(
                    Rectangle(
                        (a, y0 + 0.1 + i * h),
                        b - a,
                        h,
                        facecolor=colour[rk.gpu],
                        edgecolor="white",
                        linewidth=0.5,
                    )
                )
                if t <= 4 and (b - a) / L >= 0.12:
                    top.text(
                        (a + b) / 2,
                        y0 + 0.1 + (i + 0.5) * h,
                        f"r{r} {rk.node}",
                        ha="center",
                        va="center",
                        fontsize=6,
                    )
            top.add_patch(
                Rectangle((a, y0 + 0.1), b - a, 0.8, fill=False, edgecolor="black", linewidth=1.2)
            )
            label = f"S{s} TP{t} [{a},{b})"
            if (b - a) / L >= 0.12:
                top.text((a + b) / 2, y0 + 0.93, label, ha="center", va="bottom", fontsize=6)
            else:  # narrow stage: vertical label inside the box
                top.text(
                    (a + b) / 2, y0 + 0.5, label, ha="center", va="center", fontsize=5, rotation=90
                )
        top.text(
            -0.01 * L,
            y0 + 0.5,
            f"P{p}\nmb {pipe.micro_batch_size}x{pipe.num_microbatches}",
            ha="right",
            va="center",
            fontsize=8,
        )
    top.set_xlim(0, L)
    top.set_ylim(0, P + 0.1)
    top.set_yticks([])
    top.set_xlabel("layer")
    top.legend(
        handles=[Patch(color=colour[g], label=g) for g in gpus],
        loc="upper right",
        fontsize=7,
        ncol=min(4, len(gpus)),
        bbox_to_anchor=(1, 1.25),
    )
    top.set_title(
        f"{plan.model.name or 'model'} on {plan.cluster.name}: {len(plan.pipelines)} "
        f"pipelines, {plan.world_size} GPUs, global batch {plan.global_batch_size}"
        f"{', recompute' if plan.training.recompute else ''}\n"
        f"{est.iteration_time_s:.3g} s/iteration, {est.tokens_per_s:.4g} tokens/s, "
        f"MFU {est.mfu:.3f}",
        fontsize=10,
        loc="left",
    )

    n = plan.world_size
    xs = list(range(n))
    bottom.bar(xs, est.memory_capacity_gb, color="#dddddd", width=0.9, label="capacity")
    bottom.bar(
        xs,
        est.peak_memory_gb,
        width=0.6,
        color=[colour[plan.ranks[r].gpu] for r in xs],
        label="peak use",
    )
    prev = None
    for r in xs:
        node = plan.ranks[r].node
        if prev is not None and node != prev:
            bottom.axvline(r - 0.5, color="grey", linewidth=0.5)
        prev = node
    bottom.set_xlim(-0.6, n - 0.4)
    bottom.set_ylabel("GB")
    bottom.set_xlabel("rank (machines separated by lines)")
    bottom.set_title("simulated peak memory per rank vs capacity", fontsize=9, loc="left")
    fig.text(0.01, 0.005, f"bottleneck: {est.bottleneck}"[:200], fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
