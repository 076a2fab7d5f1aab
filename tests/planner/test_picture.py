"""`hexi-plan show --png` (planner/picture.py): whole-number ticks, shards drawn to their share,
labels that fit, counts that agree with their nouns, MFU as a percent, and one clear error for a
path that cannot be written.

Plans: the bundled 4-rank example (a TP=2 stage split 3:1), a one-GPU plan, and a 64-GPU plan
written here (uneven TP=2 and TP=4 stages, TP=8 stages, one-layer stages, four pipelines).
"""

import errno
import os
import re

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.layout import layer_params
from planner.models import load_model
from planner.picture import (
    BOX_HEIGHT,
    draw_plan,
    percent,
    plan_figure,
    plural,
    shard_boxes,
    shard_shares,
)
from planner.plan import build_plan, load_plan
from planner.random_clusters import scaled_cluster
from planner.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "plans", "hetero-4rank.json")


def example_plan():
    return load_plan(EXAMPLE)


def one_gpu_plan():
    cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", "cpu-1.yaml"))
    pipes = [
        {"micro_batch_size": 1, "num_microbatches": 1, "stages": [{"ranks": [0], "layers": [0, 4]}]}
    ]
    return build_plan(cluster, load_model("tiny"), 1, pipes)


def plan_64():
    """8 machines of 8 GPUs (4 types); pipeline 0 has a 3:1 TP=2 stage and a 3:2:2:1 TP=4 one."""
    bounds = [0, 5, 10, 14, 18, 22, 27, 32]
    pipes = [
        {
            "micro_batch_size": 1,
            "num_microbatches": 10,
            "stages": [
                {
                    "ranks": [0, 1],
                    "layers": [0, 6],
                    "shards": {
                        "query_groups": [24, 8],
                        "ffn": [8256, 2752],
                        "vocab": [24000, 8000],
                    },
                },
                {
                    "ranks": [2, 3, 4, 5],
                    "layers": [6, 14],
                    "shards": {"query_groups": [12, 8, 8, 4], "ffn": [4128, 2752, 2752, 1376]},
                },
                {"ranks": [6], "layers": [14, 15]},
                {"ranks": [7], "layers": [15, 16]},
                {"ranks": list(range(8, 16)), "layers": [16, 32]},
            ],
        },
        {
            "micro_batch_size": 2,
            "num_microbatches": 5,
            "stages": [
                {"ranks": list(range(16, 24)), "layers": [0, 10]},
                {"ranks": list(range(24, 32)), "layers": [10, 32]},
            ],
        },
        {
            "micro_batch_size": 1,
            "num_microbatches": 12,
            "stages": [
                {"ranks": list(range(32 + 4 * i, 36 + 4 * i)), "layers": bounds[i : i + 2]}
                for i in range(7)
            ],
        },
        {
            "micro_batch_size": 1,
            "num_microbatches": 32,
            "stages": [{"ranks": [60 + i], "layers": [8 * i, 8 * i + 8]} for i in range(4)],
        },
    ]
    return build_plan(scaled_cluster(64, types=4), load_model("llama2-7b"), 64, pipes)


@pytest.fixture(scope="module")
def figures():
    """{name: (plan, figure)} for the three plans, drawn once."""
    out = {}
    for name, make in (("example", example_plan), ("one", one_gpu_plan), ("64", plan_64)):
        plan = make()
        out[name] = (plan, plan_figure(plan))
    return out


def texts(fig):
    return [t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("name", ["example", "one", "64"])
def test_ticks_are_whole_layers_and_ranks(figures, name):
    plan, fig = figures[name]
    top, bottom = fig.axes
    for axis, count in ((top.xaxis, plan.model.num_layers + 1), (bottom.xaxis, plan.world_size)):
        lo, hi = axis.get_view_interval()
        shown = [(t.get_loc(), t.label1.get_text()) for t in axis.get_major_ticks()]
        shown = [(x, label) for x, label in shown if lo <= x <= hi]
        assert len(shown) >= min(count, 5), shown
        for x, label in shown:
            assert float(x).is_integer() and 0 <= x < count, shown
            assert re.fullmatch(r"\d+", label.replace("\u2212", "-")), shown
            assert int(label) == x
    # The pipelines' labels are names, not positions.
    assert [t.get_text().split("\n")[0] for t in top.get_yticklabels()][:2] == ["P0", "P1"][
        : len(plan.pipelines)
    ]


def test_shards_are_drawn_to_their_share(figures):
    plan, fig = figures["example"]
    stage = plan.pipelines[0].stages[0]
    assert stage.shards["query_groups"] == (3, 1) and stage.shards["ffn"] == (192, 64)
    top = fig.axes[0]
    drawn = {
        int(p.get_gid().split(":")[1]): p
        for p in top.patches
        if isinstance(p, Rectangle) and (p.get_gid() or "").startswith("shard:")
    }
    assert sorted(drawn) == list(range(plan.world_size))
    r0, r1 = drawn[0], drawn[1]
    assert r0.get_height() == pytest.approx(3 * r1.get_height())
    assert r0.get_height() + r1.get_height() == pytest.approx(BOX_HEIGHT)
    assert r0.get_width() == r1.get_width() == 3  # layers [0, 3)
    assert r0.get_y() == pytest.approx(r1.get_y() + r1.get_height())  # rank 0 on top
    # In the 64-GPU plan: 3:1, then 3:2:2:1, and even TP=8 stages.
    plan, fig = figures["64"]
    heights = {
        int(p.get_gid().split(":")[1]): p.get_height()
        for p in fig.axes[0].patches
        if (p.get_gid() or "").startswith("shard:")
    }
    assert [heights[r] / BOX_HEIGHT for r in (0, 1)] == pytest.approx([0.75, 0.25])
    q = [heights[r] for r in (2, 3, 4, 5)]
    assert q[1] == pytest.approx(q[2]) and q[0] > q[1] > q[3]
    assert {round(heights[r], 9) for r in range(8, 16)} == {round(BOX_HEIGHT / 8, 9)}


def test_share_is_the_ranks_part_of_the_sharded_layer_weights():
    """With heads and FFN split differently, the share weighs each by its parameters."""
    m = load_model("tiny")  # 4 query groups, FFN 256
    cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", "mini-hetero.yaml"))
    pipes = [
        {
            "micro_batch_size": 1,
            "num_microbatches": 8,
            "stages": [
                {
                    "ranks": [0, 1],
                    "layers": [0, 2],
                    "shards": {"query_groups": [3, 1], "ffn": [64, 192]},
                },
                {"ranks": [2, 3], "layers": [2, 4]},
            ],
        }
    ]
    plan = build_plan(cluster, m, 8, pipes)
    sharded = [layer_params(m, q, f) - layer_params(m, 0, 0) for q, f in ((3, 64), (1, 192))]
    first, second = plan.pipelines[0].stages
    assert shard_shares(plan, first) == pytest.approx([s / sum(sharded) for s in sharded])
    assert shard_shares(plan, second) == [0.5, 0.5]
    boxes = [b for b in shard_boxes(plan) if b.stage == 0]
    assert [b.height / BOX_HEIGHT for b in boxes] == pytest.approx(shard_shares(plan, first))


def test_labels_fit_and_do_not_overlap(figures):
    """Every label in the stage panel is at least 6 pt, inside the panel, and clear of the
    others; a shard's label lies inside its own rectangle. Where none fits, the picture says
    so."""
    plan, fig = figures["64"]
    top = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    panel = top.get_window_extent(renderer)
    labels = [t for t in top.texts if t.get_text()]
    assert len(labels) > 40
    extents = [t.get_window_extent(renderer) for t in labels]
    for t, e in zip(labels, extents):
        assert t.get_fontsize() >= 6, t.get_text()
        assert panel.x0 <= e.x0 and e.x1 <= panel.x1 and panel.y0 <= e.y0 and e.y1 <= panel.y1
    for i, a in enumerate(extents):
        for j in range(i + 1, len(extents)):
            assert not a.overlaps(extents[j]), (labels[i].get_text(), labels[j].get_text())
    rects = {
        int(p.get_gid().split(":")[1]): p
        for p in top.patches
        if (p.get_gid() or "").startswith("shard:")
    }
    placed = 0
    for t, e in zip(labels, extents):
        m = re.match(r"r(\d+)\b", t.get_text())
        if m:
            box = rects[int(m.group(1))].get_window_extent(renderer)
            assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1
            placed += 1
    assert placed >= 30
    # The uneven shards carry their share; TP=8 ranks are too thin for a label, and the
    # picture names where to find them.
    assert "r0 m0-0: 75%" in texts(fig)
    assert not any(re.match(r"r(8|9|1[0-5])\b", s) for s in texts(fig))
    assert any("left out where too small to read" in s for s in texts(fig))
    assert any(s.startswith("S4 TP8, layers 16-31, ranks 8-15") for s in texts(fig))


def test_counts_agree_with_their_nouns(figures):
    assert [plural(n, "pipeline") for n in (0, 1, 2)] == [
        "0 pipelines",
        "1 pipeline",
        "2 pipelines",
    ]
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert plural(3, "micro-batch", "micro-batches") == "3 micro-batches"
    assert plural(1200, "GPU") == "1,200 GPUs"
    one = "\n".join(texts(figures["one"][1]))
    assert "1 pipeline, 1 GPU, global batch 1" in one
    assert "1 micro-batch of 1 sample" in one
    example = "\n".join(texts(figures["example"][1]))
    assert "2 pipelines, 4 GPUs" in example
    assert "6 micro-batches of 1 sample" in example and "1 micro-batch of 2 samples" in example
    for _, fig in figures.values():
        for s in texts(fig):
            assert not re.search(r"\b1 (pipelines|GPUs|micro-batches|samples|labels|ranks)\b", s), s


def test_mfu_is_a_percent(figures):
    assert [percent(x) for x in (0.333, 0.0555, 0.00025, 0.0)] == [
        "33.3%",
        "5.5%",
        "0.025%",
        "0.0%",
    ]
    for plan, fig in figures.values():
        mfu = simulate(plan).mfu
        title = fig.axes[0].get_title(loc="left")
        assert f"MFU {percent(mfu)}" in title
        assert re.search(r"MFU \d+(\.\d+)?%", title)


def test_unwritable_path_is_one_clear_error(tmp_path, monkeypatch):
    plan = example_plan()
    missing = tmp_path / "no-such-folder" / "plan.png"
    with pytest.raises(SpecError) as err:
        draw_plan(plan, missing)
    assert err.value.problems == [
        f"{missing}: cannot write the picture: folder {missing.parent} does not exist"
    ]
    (tmp_path / "a-file").write_text("")
    with pytest.raises(
        SpecError, match=r"a-file/plan\.png: cannot write the picture: .*a-file is not a folder"
    ):
        draw_plan(plan, tmp_path / "a-file" / "plan.png")
    with pytest.raises(SpecError, match="is a folder"):
        draw_plan(plan, tmp_path)

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", disk_full)
    with pytest.raises(SpecError, match=r"full\.png: cannot write the picture \(No space left"):
        draw_plan(plan, tmp_path / "full.png")


def test_cli_reports_the_path_without_a_traceback(hexi_plan, tmp_path):
    missing = tmp_path / "missing" / "plan.png"
    code, out, err = hexi_plan("show", EXAMPLE, "--png", missing)
    assert code == 2
    reason = f"cannot write the picture: folder {missing.parent} does not exist"
    assert err == f"hexi-plan: error: {missing}: {reason}\n"
    good = tmp_path / "plan.png"
    code, out, err = hexi_plan("show", EXAMPLE, "--png", good)
    assert code == 0 and err == ""
    assert good.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
