"""When this process's runtime started: the first import of it, by the entry
(megatron_hexi.entry) before the command line is checked. --exit-duration-in-mins counts from it
(megatron_hexi.run_limits)."""

import time

STARTED = time.time()
