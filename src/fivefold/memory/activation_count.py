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
(fivefold.memory.recompute.observe_selective_saves).

    with SavedActivations(model, {f"layers.{i}": b for i, b in enumerate(model.layers)}) as acts:
        loss = compute_loss(model, batch)
    acts.bytes_by_label   # {"layers.0": ..., "layers.1": ..., "root": ...}

The counter keeps only weak references to the saved tensors, so counting does not change
what the step holds. `bytes_by_label` counts each storage as it was when first saved;
`resident_bytes`, taken at exit, what those storages still hold then, parameters' storages
as they are then left out: a ZeRO-3 unit's gathered weights, saved by its linears, are
either released after its forward (their storage shrunk to nothing, re-gathered for
backward) or still the parameters' own storage, so they count in the first and not in the
second.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn

from fivefold.memory.recompute import observe_selective_saves


class SavedActivations:
    def __init__(self, model: nn.Module, label_modules: dict[str, nn.Module] | None = None):
        self.model = model
        self.label_modules = label_modules or {}
        self.bytes_by_label: dict[str, int] = defaultdict(int)
        self._seen: set[int] = set()
        self._saved: list[weakref.ref] = []  # every saved tensor, for `resident_bytes`
        self.resident_bytes = 0  # at exit: what the saved storages still hold (docstring)
        self._state = _state_pointers(model)
        self._label = ["root"]
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._selective = observe_selective_saves(self._pack)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_label.values())

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
        return self

    def __exit__(self, *exc) -> None:
        self._selective.__exit__(*exc)
        self._hooks.__exit__(*exc)
        state = _state_pointers(self.model)  # ZeRO-3's gathered storages are new ones
        resident = {}
        for t in (ref() for ref in self._saved):
            if t is not None and t.untyped_storage().data_ptr() not in state:
                resident[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        resident.pop(0, None)  # released storages
        self.resident_bytes = sum(resident.values())
        self._saved.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _state_pointers(model: nn.Module) -> set[int]:
    """Storage addresses of the model's parameters and buffers as they are now."""
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
