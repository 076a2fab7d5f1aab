"""The multi-process harness itself: results come back, a raising or hanging rank fails fast."""

import os
import sys
import textwrap
import time

import pytest

from harness import (
    DistributedTestError,
    DistributedTimeout,
    free_port,
    run_distributed,
    run_ranks,
    run_script,
    run_torchrun,
)

# Rank bodies: module level, so that the spawned ranks can import them by name.


def _rank_info(scale, *, offset=0):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() * scale + offset)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": (
            os.environ["RANK"],
            os.environ["WORLD_SIZE"],
            os.environ["LOCAL_RANK"],
            os.environ["MASTER_ADDR"],
        ),
        "flag": os.environ.get("HEXI_HARNESS_FLAG"),
        "backend": dist.get_backend(),
        "sum": t.item(),
        "tensor": torch.arange(3) * dist.get_rank(),
    }


def _raise_on(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} refuses")
    dist.barrier()  # the others wait for the bad rank: they must not hang the test
    return dist.get_rank()


def _hang_on(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    return dist.get_rank()


def _exit_on(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


def test_results_come_back_in_rank_order():
    out = run_distributed(_rank_info, 3, 10, offset=1, timeout=60, env={"HEXI_HARNESS_FLAG": "on"})
    assert [o["rank"] for o in out] == [0, 1, 2]
    for r, o in enumerate(out):
        assert o["world"] == 3 and o["backend"] == "gloo" and o["flag"] == "on"
        assert o["env"] == (str(r), "3", str(r), "127.0.0.1")
        assert o["sum"] == (0 + 10 + 20) + 3 * 1
        assert o["tensor"].tolist() == [0, r, 2 * r]


def test_raising_rank_fails_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on, 2, 1, timeout=60)
    text = str(info.value)
    assert text.startswith("rank 1 of 2 raised:")
    assert "Traceback (most recent call last)" in text
    assert "ValueError: rank 1 refuses" in text and "_raise_on" in text
    assert time.monotonic() - t0 < 30


def test_hanging_rank_fails_within_the_timeout():
    t0 = time.monotonic()
    # Rank 1 returns at once; on a loaded machine it may not have got that far either.
    with pytest.raises(
        DistributedTimeout,
        match=r"timed out after 3 s: rank\(s\) \[0(, 1)?\] "
        r"had not finished",
    ):
        run_distributed(_hang_on, 2, 0, timeout=3)
    assert time.monotonic() - t0 < 3 + 10  # the timeout, plus killing and joining


def test_dead_rank_is_reported():
    with pytest.raises(DistributedTestError, match="rank 1 of 2 exited with code 3"):
        run_distributed(_exit_on, 2, 1, timeout=60)


def test_function_must_be_importable():
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(lambda: 0, 2, timeout=5)


_TORCHRUN_SCRIPT = """
import os, sys, time
if sys.argv[1] == "hang":
    open(os.path.join(sys.argv[2], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
    time.sleep(3600)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
line = (f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g} "
        f"{os.environ['HEXI_HARNESS_FLAG']}\\n")
os.write(1, line.encode())   # one write per line: both ranks share the pipe (print may split it)
from megatron_hexi.process_exit import exit_process
exit_process(0)              # never SIGABRT at interpreter exit (see that module)
"""


def test_torchrun_runs_a_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    code, out, err = run_torchrun(
        [script, "ok", tmp_path],
        2,
        timeout=90,
        env={"HEXI_HARNESS_FLAG": "x", "OMP_NUM_THREADS": "1"},
    )
    assert code == 0, err
    assert sorted(out.split("\n")[:-1]) == ["rank 0 of 2 sum 3 x", "rank 1 of 2 sum 3 x"]


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_torchrun_timeout_kills_the_whole_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    t0 = time.monotonic()
    # torchrun's own start (importing torch) must fit in the timeout, on a machine loaded by the
    # suite's other worker too: seconds.
    timeout = 12
    with pytest.raises(DistributedTimeout, match=f"timed out after {timeout} s"):
        run_torchrun([script, "hang", tmp_path], 2, timeout=timeout)
    assert time.monotonic() - t0 < timeout + 8
    pids = [
        int((tmp_path / f"pid{r}").read_text()) for r in range(2) if (tmp_path / f"pid{r}").exists()
    ]
    assert pids, "the workers never started: raise the timeout"
    deadline = time.monotonic() + 5
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)


def _threads():
    import torch

    return torch.get_num_threads()


def test_ranks_run_the_threads_they_are_given():
    """One compute thread per rank by default, fixed before torch is imported (a setting made
    after the import is not seen by torch); `env` may ask for more."""
    assert run_distributed(_threads, 2, timeout=60) == [1, 1]
    assert run_distributed(_threads, 2, timeout=60, env={"OMP_NUM_THREADS": "2"}) == [2, 2]


def _wait_forever():
    time.sleep(3600)


def _stuck_or_slow(slow_rank):
    """Every rank ends up waiting forever in `_wait_forever`, `slow_rank` after 3 s elsewhere."""
    import torch.distributed as dist

    if dist.get_rank() == slow_rank:
        time.sleep(3)
    _wait_forever()


def _slow_elsewhere():
    time.sleep(4)
    return "done"


def test_stuck_ranks_are_seen_in_seconds(capfd):
    """`stuck_in`: a job whose unfinished ranks all sit unmoved in the named function ends in
    seconds, long before its timeout, with each stuck rank's stack printed."""
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout, match=r"stuck in _wait_forever .* rank\(s\) \[0, 1\]"):
        run_distributed(_stuck_or_slow, 2, 1, timeout=120, stuck_in="_wait_forever")
    assert time.monotonic() - t0 < 60
    err = capfd.readouterr().err
    assert err.count("--- stacks of rank") == 2 and "in _wait_forever" in err, err[-3000:]


def test_a_slow_rank_is_not_stuck():
    """Ranks that take seconds elsewhere finish: only the named function counts as stuck."""
    assert run_distributed(_slow_elsewhere, 2, timeout=120, stuck_in="_wait_forever") == [
        "done",
        "done",
    ]


def test_sigabrt_fails_the_launch(tmp_path):
    """A process of the suite that ends in SIGABRT fails its test, whatever the test expects."""
    script = tmp_path / "abort.py"
    script.write_text("import os\nprint('before', flush=True)\nos.abort()\n")
    with pytest.raises(DistributedTestError, match=r"exited with SIGABRT \(-6\)"):
        run_script([script])
    with pytest.raises(DistributedTestError, match=r"exited with SIGABRT \(-6\)"):
        run_ranks([script], 2)


def test_script_runs_as_python_runs_it(tmp_path):
    """run_script: the exit code, both streams, the environment, the folder and the script's
    own folder on sys.path, as `python SCRIPT` gives them; an uncaught exception is a traceback
    and exit code 1."""
    (tmp_path / "neighbour.py").write_text("VALUE = 7\n")
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "import neighbour\n"
        "print(neighbour.VALUE, os.environ['HEXI_HARNESS_FLAG'], os.getcwd(), sys.argv[1:])\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    code, out, err = run_script([script, "3"], env={"HEXI_HARNESS_FLAG": "on"}, cwd=tmp_path)
    assert (code, out, err) == (3, f"7 on {tmp_path} ['3']\n", "to stderr\n")
    (tmp_path / "raise.py").write_text("raise ValueError('no')\n")
    code, out, err = run_script([tmp_path / "raise.py"])
    assert code == 1 and out == "" and err.startswith("Traceback") and "ValueError: no" in err


@pytest.mark.parametrize(
    "worker, count, first, end", [("", "", 20000, 25000), ("gw1", "2", 22500, 25000)]
)
def test_free_ports_come_from_the_workers_own_range(monkeypatch, worker, count, first, end):
    """free_port: outside the ephemeral range, in this xdist worker's own slice of PORT_RANGE
    (gw1 of 2: the upper half), each port free and none repeated until the slice is used up."""
    import socket

    import harness

    assert harness.PORT_RANGE == (20000, 25000)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count or "1")
    monkeypatch.setattr(harness, "_next_port", None)
    ports = [free_port() for _ in range(50)]
    assert all(first <= p < end for p in ports), ports
    assert len(set(ports)) == len(ports)
    with socket.socket() as held:  # a port in use is skipped
        held.bind(("127.0.0.1", harness._next_port))
        taken = held.getsockname()[1]
        assert free_port() != taken
