"""pretrain_gpt.py with one rank killing itself in the middle of a checkpoint save (tests only).

    python kill_in_save.py ITERATION:PLAN_RANK ARGS...

runs pretrain_gpt.py ARGS; the process of plan rank PLAN_RANK SIGKILLs itself during the save of
ITERATION, once its rank file is written and fsynced and nothing is committed (the window is
milliseconds long, so it cannot be hit from outside). The save's own code is untouched: this
wraps megatron_hexi.checkpoint.writer.write_rank_file in this process only.
"""

import os
import runpy
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    iteration, rank = (int(x) for x in sys.argv[1].split(":"))
    from megatron_hexi.checkpoint import rank_file_name, writer

    real = writer.write_rank_file

    def write_rank_file(path, entries, it, *args, **kwargs):
        index = real(path, entries, it, *args, **kwargs)
        if it == iteration and os.path.basename(path) == rank_file_name(rank):
            print(
                f"kill_in_save: rank {rank} kills itself in the save of iteration {it} "
                f"(its file written)",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        return index

    writer.write_rank_file = write_rank_file
    script = os.path.join(REPO, "pretrain_gpt.py")
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
