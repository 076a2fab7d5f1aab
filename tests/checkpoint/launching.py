"""pretrain_gpt.py ranks as plain processes that each must exit on their own (what torchrun
starts, without its agent): the failure and integrity tests kill, stop and watch them. They fork
from the test harness's forkserver: each starts in milliseconds, so a test's deadlines measure
training, not imports."""

import os
import time

from conftest import REPO
from harness import check_no_abort, free_port, start_script

TWO_STAGES = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "stages": [{"ranks": [0], "layers": [0, 2]}, {"ranks": [1], "layers": [2, 4]}],
    }
]


def launch(tmp_path, tag, argv, world, env=None, script=None):
    """The ranks as plain processes (what torchrun starts, without its agent, which would kill
    the survivors itself): each must exit on its own. `script`: [program, its arguments] to run
    instead of pretrain_gpt.py (which receives `argv`)."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        procs.append(
            start_script(
                [*(script or [REPO / "pretrain_gpt.py"]), *argv],
                e,
                REPO,
                tmp_path / f"{tag}.{rank}.out",
                tmp_path / f"{tag}.{rank}.err",
                new_session=True,
            )
        )
    return procs


def wait_all(procs, deadline):
    """Exit codes once all have ended or at `deadline` (None: still running). A SIGABRT exit
    fails the test (the harness's rule for every launch)."""
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    codes = [p.poll() for p in procs]
    check_no_abort(codes, "pretrain_gpt.py")
    return codes
