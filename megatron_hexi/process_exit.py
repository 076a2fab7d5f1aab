"""Ending a process that used torch.distributed: with its intended exit code, never SIGABRT.

Why the interpreter's own shutdown is not used. A gloo process group runs worker threads
(`ProcessGroupGloo::runLoop`) for as long as its C++ object lives, and every finished work object
those threads drop calls back into Python when it is destroyed. Python objects that hold groups
(the trainer, megatron-core modules and their `pg_collection`, schedule closures) can live until
`Py_FinalizeEx` collects them; `dist.destroy_process_group()` only forgets torch's own references.
If a runLoop thread destroys a work object while the interpreter finalises, it cannot take the GIL,
the thread is unwound through a `noexcept` destructor, and the process dies with SIGABRT: an
intended exit code 0 or 2 becomes -6 in about one run in seven.

So a run ends deliberately instead: once everything it wrote is closed (checkpoint files are
fsynced when saved, metrics files closed by the training loop), `exit_process` destroys the
process groups, flushes logging and the standard streams, and leaves with `os._exit`, which skips
interpreter finalisation. No thread can meet a finalising interpreter, because there is none.
"""

import logging
import os
import sys
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """Destroy the process groups, flush every stream, and end the process with `code`.

    Safe with or without an initialised process group; never returns.
    """
    code = 0 if code is None else int(code)
    try:
        dist = sys.modules.get("torch.distributed")  # not imported: no process group to end
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - tearing down must not change the exit code
        print(f"warning: process group teardown failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
