"""tools/bench/host_overhead.py's machinery on a tiny model: both variants (this runtime's Trainer
and plain megatron-core's loop, in one process) train the same model on the same samples, so
they must compute the same losses, step after step; the ratio line is what the benchmark pages
and run_all.py read. No timing is checked (speed figures live in the benchmark itself)."""

import re
import types

from conftest import REPO
from harness import run_script

SCRIPT = REPO / "tools" / "bench" / "host_overhead.py"


def _run(*args, timeout=300):
    """`python SCRIPT ARGS...` forked from the harness's forkserver (torch and megatron-core
    already imported): what subprocess.run would return."""
    code, out, err = run_script([SCRIPT, *args], timeout=timeout, cwd=REPO)
    return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_both_variants_compute_the_same_losses_and_the_ratio_line_comes_last():
    r = _run(
        "--layers", 2, "--hidden", 32, "--seq", 16, "--micro-batches", 3,
        "--micro-batch-size", 2, "--rounds", 2, "--iters", 2, "--warmup", 1, "--profile", 1,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    loss = re.search(
        r"ours (\d+\.\d+) -> (\d+\.\d+), plain (\d+\.\d+) -> (\d+\.\d+); "
        r"largest relative difference (\S+)",
        r.stdout,
    )
    assert loss, r.stdout
    ours_first, ours_last, plain_first, plain_last = map(float, loss.groups()[:4])
    # the same initial weights and samples: the same loss at every one of the 5 steps (the
    # order of a few reductions differs between the two loops: not bit for bit)
    assert float(loss.group(5)) < 1e-5, loss.group(0)
    assert abs(ours_first - plain_first) < 1e-5 and abs(ours_last - plain_last) < 1e-5
    assert "2L h32 ffn128 heads 2 vocab 256 seq 16; 3 micro-batch(es) of 2" in r.stdout
    assert len(re.findall(r"^  round +\d+: median ours", r.stdout, re.M)) == 2
    assert "Python calls per step ours" in r.stdout  # --profile
    ratios = re.findall(r"paired ratio of CPU time over 2 rounds: median (\S+)x", r.stdout)
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"host overhead ratio: \d+\.\d\dx", last), last
    # one median, printed to 3 decimals and to 2: they differ by at most 0.0005 + 0.005
    assert ratios and abs(float(ratios[0]) - float(last.split()[-1][:-1])) < 0.0055 + 1e-9


def test_bad_sizes_are_one_clear_error():
    r = _run("--hidden", 40)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "host_overhead.py: error: --hidden must be a multiple of 16 (heads of 16) and --seq even"
    )
    assert "Traceback" not in r.stderr
