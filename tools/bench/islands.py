"""Islands benchmark: convergence against synchronous training, the planner's predictions for the
paper's clusters split over two sites, and the benchmark page's plots of both.

    python tools/bench/islands.py [--out DIR] [--iters 256] [--runs H:M ...]
    python tools/bench/islands.py convergence [islands_convergence.py's flags]
    python tools/bench/islands.py planner [islands_planner.py's flags]
    python tools/bench/islands.py plot --convergence F.json --planner F.json [--out DIR]

Without a subcommand it runs both parts (their tables on stdout), keeps their rows as
DIR/islands_convergence.json and DIR/islands_planner.json, and draws DIR/islands_convergence.png
(validation loss over the synchronous plan's, and cross-island bytes per token, against H) and
DIR/islands_planner.png (predicted tokens/s of islands over synchronous per cluster and link).
The parts are tools/bench/islands_convergence.py (the runtime on a real corpus, about 25 minutes
on two cores) and tools/bench/islands_planner.py (about 2 minutes); `plot` redraws from rows
kept before. Plotting needs matplotlib (`pip install -e .[plot]`).
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def plot_convergence(rows: list[dict], path: str) -> None:
    """Loss over synchronous and bytes per token against H, one line per island count and outer
    momentum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, bytes_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for islands in sorted({r["islands"] for r in rows}):
        mine = [r for r in rows if r["islands"] == islands]
        sync = next(r for r in mine if r["H"] == 0)
        for momentum in sorted({r["momentum"] for r in mine if r["H"]}):
            line = sorted((r for r in mine if r["momentum"] == momentum), key=lambda r: r["H"])
            hs = [r["H"] for r in line]
            label = f"{islands} islands, momentum {momentum}"
            loss_ax.plot(
                hs, [r["valid_loss"] / sync["valid_loss"] for r in line], "o-", label=label
            )
        outer = sorted((r for r in mine if r["H"]), key=lambda r: r["H"])
        hs = sorted({r["H"] for r in outer})
        per_h = [next(r["bytes_per_token"] for r in outer if r["H"] == h) for h in hs]
        bytes_ax.plot(hs, per_h, "o-", label=f"{islands} islands")
        bytes_ax.axhline(sync["bytes_per_token"], linestyle=":", color="grey")
    loss_ax.axhline(1.0, linestyle=":", color="grey")
    for ax in (loss_ax, bytes_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("H (inner steps per outer step)")
        ax.legend(fontsize=8)
    loss_ax.set_ylabel("validation loss / synchronous")
    bytes_ax.set_yscale("log")
    bytes_ax.set_ylabel("cross-island bytes per token (dotted: synchronous)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_planner(rows: list[dict], path: str) -> None:
    """Predicted islands / synchronous tokens/s, bars per cluster, one colour per link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(links)
    for j, link in enumerate(links):
        ratio = {
            r["cluster"]: r["islands_tokens_per_s"] / r["sync_tokens_per_s"]
            for r in rows
            if r["link"] == link
        }
        xs = [i + j * width for i, c in enumerate(clusters) if c in ratio]
        ax.bar(xs, [ratio[c] for c in clusters if c in ratio], width, label=f"site link {link}")
    ax.axhline(1.0, linestyle=":", color="grey")
    ax.set_xticks([i + width * (len(links) - 1) / 2 for i in range(len(clusters))])
    ax.set_xticklabels(clusters, fontsize=8)
    ax.set_ylabel("islands / synchronous tokens/s (predicted)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(convergence: str | None, planner: str | None, out: str) -> None:
    for rows_file, draw, name in (
        (convergence, plot_convergence, "islands_convergence.png"),
        (planner, plot_planner, "islands_planner.png"),
    ):
        if rows_file:
            with open(rows_file) as f:
                draw(json.load(f), os.path.join(out, name))
            print(f"wrote {os.path.join(out, name)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convergence"]:
        import islands_convergence

        return islands_convergence.main(argv[1:]) or 0
    if argv[:1] == ["planner"]:
        import islands_planner

        return islands_planner.main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv[:1] == ["plot"]:
        ap.add_argument("--convergence", default=None, help="rows of islands_convergence.py")
        ap.add_argument("--planner", default=None, help="rows of islands_planner.py")
        ap.add_argument("--out", default=".")
        args = ap.parse_args(argv[1:])
        plot(args.convergence, args.planner, args.out)
        return 0
    ap.add_argument("--out", default=".", help="folder for the rows (JSON) and the plots")
    ap.add_argument("--iters", default="256", help="steps per convergence run")
    ap.add_argument("--runs", nargs="+", default=None, help="convergence runs, H:momentum")
    args = ap.parse_args(argv)
    import islands_convergence
    import islands_planner

    conv = os.path.join(args.out, "islands_convergence.json")
    plan = os.path.join(args.out, "islands_planner.json")
    runs = ["--runs", *args.runs] if args.runs else []
    status = islands_convergence.main(["--iters", args.iters, *runs, "--json", conv]) or 0
    status = status or islands_planner.main(["--json", plan])
    if status == 0:
        plot(conv, plan, args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
