"""Count the activation bytes autograd keeps for backward, per module, exactly.

`torch.autograd.graph.saved_tensors_hooks` sees every tensor an operation saves for its
backward, so the count is exact, as the communication ledger's is (fivefold.comm.ledger).
`SavedActivations` installs a pack hook that records each saved tensor's storage once, so a
tensor saved by several operations (the input of wq, wk and wv) counts once, and skips the
storages of parameters and buffers (model state, not activations; a weight's transposed view
shares its storage). Each storage is charged to the module named by `label_modules` that was
running when it was first saved; anything saved outside them (embedding, final norm, output
head, loss) is charged to "root". Under selective recomputation the tensors torch's
checkpoint cache keeps are counted too, as the policy keeps them
(fivefold.memory.recompute.observe_selective_saves). Under activation offload
(fivefold.memory.activation_offload) an offloaded block's saved tensors go to host memory
through its own hooks, which replace this counter's while the block runs; the offload tells
the counter of each storage it copies, and those bytes count in `host_bytes_by_label`, not in
`bytes_by_label` (the device's) nor in `resident_bytes`.

    with SavedActivations(model, {f"layers.{i}": b for i, b in enumerate(model.layers)}) as acts:
        loss = compute_loss(model, batch)
    acts.bytes_by_label   # {"layers.0": ..., "layers.1": ..., "root": ...}
    acts.host_bytes_by_label  # the offloaded blocks' share, in host memory

The counter keeps only weak references to the saved tensors, so counting does not change
what the step holds. `bytes_by_label` counts each storage as it was when first saved;
`resident_bytes`, taken at exit, what those storages still hold then, parameters' storages
as they are then left out: a ZeRO-3 unit's gathered weights, saved by its linears, are
either released after its forward (their storage shrunk to nothing, re-gathered for
backward) or still the parameters' own storage, so they count in the first and not in the
second. The selective cache keeps its own detached aliases of the tensors the policy shows
the counter, whose tensor objects die with the forward, so those storages are followed by
weak references to the storage itself (else `resident_bytes` would leave out the cache
that `bytes_by_label` counts).
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fivefold.memory.activation_offload import observe_offloaded_saves, state_pointers
from fivefold.memory.recompute import observe_selective_saves


class SavedActivations:
    def __init__(self, model: nn.Module, label_modules: dict[str, nn.Module] | None = None):
        self.model = model
        self.label_modules = label_modules or {}
        self.bytes_by_label: dict[str, int] = defaultdict(int)
        self.host_bytes_by_label: dict[str, int] = defaultdict(int)
        self._seen: set[int] = set()
        self._saved: list[weakref.ref] = []  # every saved tensor, for `resident_bytes`
        self._cached: list[tuple] = []  # the selective cache's (weak storage, ptr, bytes)
        self.resident_bytes = 0  # at exit: what the saved storages still hold (docstring)
        self._state = state_pointers(model)
        self._label = ["root"]
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._selective = observe_selective_saves(self._pack_cached)
        self._offloaded = observe_offloaded_saves(self._pack_host)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_label.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host_bytes_by_label.values())

    def _pack_host(self, t: torch.Tensor) -> None:
        """A storage the offload copied to the host (once each, and never model state)."""
        self.host_bytes_by_label[self._label[0]] += t.untyped_storage().nbytes()

    def _pack_cached(self, t: torch.Tensor) -> None:
        """A tensor the selective policy keeps (its cache holds a detached alias)."""
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._state:
            self._cached.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        self._pack(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._state:
            return t
        self._saved.append(weakref.ref(t))
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes_by_label[self._label[0]] += storage.nbytes()
        return t

    def __enter__(self) -> "SavedActivations":
        for name, module in self.label_modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: self._label.__setitem__(0, name)))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out: self._label.__setitem__(0, "root")))
        self._hooks.__enter__()
        self._selective.__enter__()
        self._offloaded.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._offloaded.__exit__(*exc)
        self._selective.__exit__(*exc)
        self._hooks.__exit__(*exc)
        state = state_pointers(self.model)  # ZeRO-3's gathered storages are new ones
        resident = {}
        for t in (ref() for ref in self._saved):
            if t is not None and t.untyped_storage().data_ptr() not in state:
                resident[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for ref, ptr, nbytes in self._cached:
            if not ref.expired():
                resident[ptr] = nbytes
        resident.pop(0, None)  # released storages
        self.resident_bytes = sum(resident.values())
        self._saved.clear()
        self._cached.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

