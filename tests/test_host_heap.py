"""A CPU rank keeps freed memory in its heap (fivefold.host_heap): counted in page
faults, not timed."""

import platform
import resource

import pytest
import torch

from fivefold.testing import run_on_ranks
from fivefold.host_heap import keep_host_heap, user_malloc_settings

GLIBC = platform.libc_ver()[0] == "glibc"


def _faults_of_a_freed_block_written_again(rt) -> tuple[int, int]:
    """Minor page faults of writing a fresh 64 MiB tensor, then of writing a 32 MiB one after
    the first was freed. The second is smaller on purpose: glibc's posix_memalign, which
    torch's CPU allocator calls, asks for the size plus the alignment, so a request of the
    very same size fits the freed block only once it has merged with a free neighbour."""
    faults = []
    for elements in (16 * 2**20, 8 * 2**20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(elements).fill_(1.0)  # allocated, written and freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[0], faults[1]


@pytest.mark.skipif(not GLIBC, reason="a glibc malloc setting")
def test_a_cpu_rank_writes_a_freed_large_block_again_without_faulting_it_in():
    first, again = run_on_ranks(_faults_of_a_freed_block_written_again, 1)[0]
    pages = 64 * 2**20 // resource.getpagesize()
    assert first > pages // 2  # the first write faults the block's pages in
    assert again < pages // 100  # the heap kept them: glibc would map 32 MiB afresh (8193)


def test_user_malloc_tunables_are_left_alone(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=8")
    assert keep_host_heap() is False


def test_only_malloc_settings_count_as_the_users():
    assert user_malloc_settings({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert user_malloc_settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.mmap_max=8"})
    assert not user_malloc_settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert not user_malloc_settings({})
