"""Activation offload: the tensors a block saves for backward live in host memory between its
forward and its backward (`parallel.offload_activations` = the number of blocks, the first
ones of each pipeline stage, or under vpp > 1 of each of a rank's model chunks: which blocks
is fivefold.parallel.parallelize.offloaded_blocks' choice, this file wraps them).

Megatron-Core's `cpu_offloading` / `cpu_offloading_num_layers` (TransformerConfig; the
context in megatron.core.cpu_offload) and PyTorch's `torch.autograd.graph.save_on_cpu` do
the same: a saved-tensor pack hook copies each saved tensor to (pinned) host memory during
forward, so the device copy is freed once nothing else holds it, and the unpack hook copies
it back to the block's device when backward needs it. The device keeps the other blocks'
activations; the offloaded ones cross the host link twice per micro-batch (the planner's
fivefold.planner.activation_offload prices that).

Why not `save_on_cpu` itself:

* it copies every saved tensor, parameters included: a linear saves its weight (or a
  transposed view of it) for the input gradient, so each micro-batch would move the model's
  weights to the host and back and hold a second host copy of them, freeing no device
  memory (the parameter stays). Here a tensor whose storage is a parameter's or buffer's
  (the weights, their views, the rotary tables) stays as it is, the rule
  fivefold.memory.activation_count uses to tell model state from activations;
* it copies one storage once per saving op (a block's normalised input is saved by wq, wk
  and wv): here each storage is copied once per block call and every saved view of it is
  rebuilt from that copy (same dtype, sizes, strides and offset), so backward reads the
  same bytes and the run is bit for bit the one without offload, whatever the layout does
  between forward and backward (ZeRO-3's gathers, expert dispatch, context exchanges, loss
  scaling, split or sliced pipeline backwards, compiled blocks: tests/test_activation_
  offload.py and tests/test_activation_offload_layouts.py);
* saved-tensor hooks do not nest (only the innermost pair runs), so the activation counter
  would stop seeing an offloaded block's tensors: `observe_offloaded_saves` lets it count
  each storage copied to the host, once, as it is copied.

What stays a copy that frees nothing: a tensor made outside the block that every block
saves, as context parallelism's rotary rows of the rank's tokens (gathered per micro-batch,
not a buffer), is copied with the block's own saves while the device keeps it for the
others (its bytes are small: positions x d_head, no batch or width).

Within one block call a device storage's address identifies it: the call keeps the
originals until it returns, so the allocator cannot hand a freed address to a new tensor
meanwhile; across calls the table starts empty. The device copy made in backward is shared
by the views of one storage and freed with the graph's last reference to them. On CUDA the
host buffers are pinned and both copies are issued on the current stream (non-blocking:
stream order makes them safe, the allocator reusing a freed block only behind the copy), so
they queue with compute rather than run beside it on a side stream as Megatron-Core's do,
and each copy back is issued when backward unpacks it, with no prefetch.
Like recomputation (fivefold.memory.recompute) it wraps each block's forward from outside:
the model stays free of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

_observers: list[Callable[[torch.Tensor], None]] = []


def apply_activation_offload(model: nn.Module, blocks: Iterable[nn.Module]) -> None:
    """Keep the saved tensors of every block in `blocks` in host memory between forward and
    backward; `model`: the module whose parameters and buffers are not activations."""
    for block in blocks:
        block.forward = _offloaded(block.forward, model)


@contextlib.contextmanager
def observe_offloaded_saves(observer: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `observer(tensor)` once for every device storage copied to the host while inside
    (`tensor`: the first saved tensor over it)."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def state_pointers(model: nn.Module) -> set[int]:
    """Storage addresses of the model's parameters and buffers as they are now."""
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


class _HostCopy:
    """One device storage's bytes in host memory, and their copy back once backward asks."""

    __slots__ = ("host", "device", "back")

    def __init__(self, storage: torch.UntypedStorage):
        self.device = storage.device
        pin = self.device.type == "cuda"
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        self.host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(src, non_blocking=pin)
        self.back: torch.UntypedStorage | None = None

    def on_device(self) -> torch.UntypedStorage:
        if self.back is None:  # on the CPU, `to` returns the host copy itself
            self.back = self.host.to(self.device, non_blocking=True).untyped_storage()
        return self.back


def _offloaded(forward, model: nn.Module):
    def run(*args, **kwargs):
        state = state_pointers(model)  # now: an engine may have moved them since
        copies: dict[int, _HostCopy] = {}
        originals: list[torch.Tensor] = []  # held until return: addresses stay unique

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in state:
                return t
            copy = copies.get(ptr)
            if copy is None:
                copy = copies[ptr] = _HostCopy(storage)
                originals.append(t)
                for observer in _observers:
                    observer(t)
            return copy, t.dtype, t.size(), t.stride(), t.storage_offset()

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return forward(*args, **kwargs)
    return run


def _unpack(packed) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    copy, dtype, size, stride, offset = packed
    return torch.empty(0, dtype=dtype, device=copy.device).set_(copy.on_device(), offset,
                                                                  size, stride)
