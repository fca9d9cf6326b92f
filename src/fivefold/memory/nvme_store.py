"""The disk tier of optimizer offload: Adam's moments in files, streamed in chunks through
the CPU step, crash-consistent (ZeRO-Infinity, arXiv 2104.07857, Sec. 5-6: optimizer states
on NVMe, read and written in bounded chunks that overlap the CPU update). SGD's momentum
is stored the same way as one state instead of two (`moments = 1`).

Layout under `directory` (offload_path/rank{r}/): for each offloaded unit two slot files,
`{unit}.slot0.bin` and `{unit}.slot1.bin`, each holding the unit's shard of exp_avg and
exp_avg_sq chunk by chunk ([exp_avg of chunk 0 | exp_avg_sq of chunk 0 | exp_avg of chunk
1 | ...], fp32), and `manifest.json`, which names the committed slot and how many updates
it holds.

Crash consistency (two versions): an optimizer step reads every unit's moments from the
committed slot and writes the updated ones to the other slot, which it fsyncs unit by unit;
only after all units does `commit` write the manifest naming the new slot to a temporary
file, fsync it, `os.replace` it over the old one (atomic on POSIX) and fsync the directory.
The committed slot is never written during a step, so a crash at any moment (SIGKILL
included) leaves the manifest naming a slot that holds the complete state after some whole
step: never a half-updated one. Checkpoints read that committed version (`read_unit`) and a
resume writes the loaded one back (`write_unit` + `commit`). Disk use is two versions: 16
bytes per element of each offloaded shard.

Asynchronous I/O with threads (concurrent.futures.ThreadPoolExecutor): `os.preadv` and
`os.pwritev` release the GIL, so the read of chunk j+1 and the write of chunk j-1 proceed
while the CPU step updates chunk j; the standard library needs no new dependency, and
libaio / io_uring bindings for Python are not well kept. At most `BUFFERS` chunk buffers
exist at once (bounded streaming buffers, not model state).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

CHUNK_ELEMENTS = 1 << 16  # per moment: 256 KiB of exp_avg and 256 KiB of exp_avg_sq a chunk
BUFFERS = 3  # chunk buffers in flight: one being updated, one being read, one being written
MANIFEST = "manifest.json"


class NvmeStore:
    """exp_avg and exp_avg_sq (or, `moments = 1`, SGD's momentum) of one rank's offloaded
    units, two versions on disk.

    `units` are (name, shard elements). A new store holds zero moments and 0 updates, as
    torch's AdamW before its first step (a zero momentum, which SGD's first step turns into
    the gradient itself, as torch's does without one)."""

    def __init__(self, directory: str | Path, units: list[tuple[str, int]],
                 chunk_elements: int = CHUNK_ELEMENTS, moments: int = 2):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.numels = dict(units)
        self.chunk = chunk_elements
        self.moments = moments
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-io")
        self.fds: dict[tuple[str, int], int] = {}
        for name, numel in units:
            for slot in (0, 1):
                fd = os.open(self._path(name, slot), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                os.ftruncate(fd, 4 * moments * numel)  # zeros: the moments before any update
                self.fds[name, slot] = fd
        self.slot, self.updates = 0, 0
        self._write_manifest()

    def _path(self, name: str, slot: int) -> Path:
        return self.directory / f"{name}.slot{slot}.bin"

    def disk_bytes(self) -> int:
        """Bytes of every slot file (both versions)."""
        return sum(os.fstat(fd).st_size for fd in self.fds.values())

    def close(self) -> None:
        self.io.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    # ------------------------------------------------------------------ chunks

    def _chunks(self, name: str) -> list[tuple[int, int]]:
        numel = self.numels[name]
        return [(start, min(start + self.chunk, numel)) for start in range(0, numel, self.chunk)]

    def _read_chunk(self, name: str, slot: int, start: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.numpy()).cast("B")
        done = os.preadv(self.fds[name, slot], [view], 4 * self.moments * start)
        if done != view.nbytes:
            raise OSError(f"{self._path(name, slot)}: read {done} of {view.nbytes} bytes")

    def _write_chunk(self, name: str, slot: int, start: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.numpy()).cast("B")
        done = os.pwritev(self.fds[name, slot], [view], 4 * self.moments * start)
        if done != view.nbytes:
            raise OSError(f"{self._path(name, slot)}: wrote {done} of {view.nbytes} bytes")

    def update_unit(self, name: str,
                    update: Callable[..., None]) -> None:
        """Stream unit `name`'s moments from the committed slot through
        `update(start, stop, *moments)` (exp_avg, exp_avg_sq; or the momentum; it changes the chunk in place) into
        the other slot, prefetching the next chunk's read and writing behind on the I/O
        threads; fsync the new slot before returning. The committed slot is not touched."""
        src, dst = self.slot, 1 - self.slot
        chunks = self._chunks(name)
        buffers = [torch.empty(self.moments * self.chunk, dtype=torch.float32)
                   for _ in range(min(BUFFERS, len(chunks)))]
        writes: list[Future | None] = [None] * len(buffers)

        def read(j: int) -> Future:
            b = j % len(buffers)
            if writes[b] is not None:  # the buffer's last chunk is still being written
                writes[b].result()
            start, stop = chunks[j]
            buf = buffers[b][:self.moments * (stop - start)]
            return self.io.submit(self._read_chunk, name, src, start, buf)

        pending = read(0) if chunks else None
        for j, (start, stop) in enumerate(chunks):
            pending.result()
            if j + 1 < len(chunks):
                pending = read(j + 1)
            n, b = stop - start, j % len(buffers)
            buf = buffers[b][:self.moments * n]
            update(start, stop, *buf.split(n))
            writes[b] = self.io.submit(self._write_chunk, name, dst, start, buf)
        for work in writes:
            if work is not None:
                work.result()
        os.fsync(self.fds[name, dst])

    # ------------------------------------------------------------------ versions

    def commit(self, updates: int) -> None:
        """Make the slot written since the last commit the committed one, holding `updates`
        Adam updates: the manifest replaced atomically, then the directory fsynced."""
        self.slot, self.updates = 1 - self.slot, updates
        self._write_manifest()

    def _write_manifest(self) -> None:
        tmp = self.directory / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"slot": self.slot, "updates": self.updates}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / MANIFEST)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read_unit(self, name: str) -> tuple[torch.Tensor, ...]:
        """The committed moments of unit `name`, whole, in new CPU tensors."""
        return read_committed(self.directory, name, self.numels[name], self.chunk, self.slot,
                              self.moments)

    def write_unit(self, name: str, *moments: torch.Tensor) -> None:
        """Write whole moments (a checkpoint's) to the uncommitted slot; `commit` then makes
        them the state."""
        def replace(start, stop, *chunks):
            for chunk, whole in zip(chunks, moments):
                chunk.copy_(whole[start:stop])
        self.update_unit(name, replace)


def read_manifest(directory: str | Path) -> dict:
    """The committed slot and update count of the store in `directory`."""
    return json.loads((Path(directory) / MANIFEST).read_text())


def read_committed(directory: str | Path, name: str, numel: int,
                   chunk_elements: int = CHUNK_ELEMENTS, slot: int | None = None,
                   moments: int = 2) -> tuple[torch.Tensor, ...]:
    """The moments ((exp_avg, exp_avg_sq), or (momentum,)) of unit `name` from the slot the
    manifest in `directory` names (or `slot`): what a checkpoint, or a reader after a
    crash, takes as the state."""
    if slot is None:
        slot = read_manifest(directory)["slot"]
    raw = torch.from_file(str(Path(directory) / f"{name}.slot{slot}.bin"), shared=False,
                          size=moments * numel, dtype=torch.float32)
    out = tuple(torch.empty(numel) for _ in range(moments))
    for start in range(0, numel, chunk_elements):
        stop = min(start + chunk_elements, numel)
        chunk = raw[moments * start:moments * stop].view(moments, stop - start)
        for whole, part in zip(out, chunk):
            whole[start:stop] = part
    return out
