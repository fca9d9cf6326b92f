"""A CPU rank keeps freed memory in its heap (fivefold.train.host_heap): counted in page
faults, not timed."""

import platform
import resource

import pytest
import torch

from fivefold.testing import run_on_ranks
from fivefold.train.host_heap import keep_host_heap

GLIBC = platform.libc_ver()[0] == "glibc"


def _faults_of_a_reused_block(rt) -> tuple[int, int]:
    """Minor page faults of writing a fresh 64 MiB tensor, then of writing one again after
    the first was freed."""
    faults = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 * 2**20).fill_(1.0)  # allocated, written and freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[0], faults[1]


@pytest.mark.skipif(not GLIBC, reason="a glibc malloc setting")
def test_a_cpu_rank_writes_a_freed_large_block_again_without_faulting_it_in():
    first, again = run_on_ranks(_faults_of_a_reused_block, 1)[0]
    pages = 64 * 2**20 // resource.getpagesize()
    assert first > pages // 2  # the first write faults the block's pages in
    assert again < pages // 100  # the heap kept them: glibc would unmap and fault all again


def test_user_malloc_tunables_are_left_alone(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=8")
    assert keep_host_heap() is False
