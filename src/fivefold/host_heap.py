"""Keep a CPU rank's freed memory in its heap, so that each step reuses last step's pages.

PyTorch's CPU tensors come straight from malloc. glibc serves a request of 32 MiB or more
(its largest mmap threshold on 64-bit) with a fresh anonymous mapping and unmaps it on free,
so every large temporary of a step (the head's logits and their gradient, log-softmax's
output, a gradient buffer being zeroed) starts as untouched pages that the kernel faults in
one 4 KiB page at a time, and zeroes, on first write. On this development machine (2 cores,
2026-12-02), 40 steps of the tiny preset on one rank (bench/planner_cpu.py's first case),
run back to back: with glibc's defaults every step took about 254 thousand page faults and
0.94-1.02 s; with the heap kept, 2-8 faults a step from the tenth step on and 0.67-0.74 s.
The price is resident memory: 824 MiB at the peak against 1086 MiB kept (32% more). The
kept heap grows over the first steps (870 MiB after the first step, 1059 MiB after the
eighth, then 0.2-0.3 MiB a step, as with the defaults) because a freed block serves a
request of its own size only once it has merged with a free neighbour: glibc's
posix_memalign, which torch calls, asks for the size plus the alignment.

`keep_host_heap()` tells glibc (mallopt) to serve every size from its heap and not to
return freed memory at the top of the heap to the system, the job a caching allocator does
on a GPU. The process's resident memory then stays at its peak. It is for CPU ranks only: a
GPU rank's large buffers are the device's or pinned (cudaHostAlloc), which malloc does not
serve. Without glibc, or when the user set glibc's malloc in the environment, it does
nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: trim only a free top above 2 GiB
MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def user_malloc_settings(environ) -> bool:
    """Whether the environment sets glibc's malloc itself: one of its MALLOC_ variables, or a
    glibc.malloc tunable in GLIBC_TUNABLES (other tunables there, rseq say, are no choice
    about the heap)."""
    return (any(v in environ for v in MALLOC_VARIABLES)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


def keep_host_heap() -> bool:
    """Serve all sizes from the heap and never trim it; True when glibc accepted both."""
    if platform.libc_ver()[0] != "glibc" or user_malloc_settings(os.environ):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                   NEVER_TRIM))
