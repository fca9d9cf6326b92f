"""The data-parallel engine's checkpoint side: this rank's master weights and optimizer
states as tensors to save or load in place (DCP), from whole-model tensors of another layout
(fivefold.train.reshard), and every parameter gathered whole.

A mixin of `DataParallelEngine` (fivefold.parallel.data_parallel): it reads the engine's
units, masters, optimizer and stage.
"""

from __future__ import annotations

from typing import Callable

import torch

from fivefold.comm import collectives as C
from fivefold.parallel.flat_unit import place_flat


# the optimizer states a unit can hold: AdamW's (on the device or offloaded), SGD's
STATE_KINDS = ("exp_avg", "exp_avg_sq", "step", "momentum_buffer")


class EngineCheckpoint:
    """Checkpoint methods of `DataParallelEngine`."""

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Tensors to save or load in place: master weights and optimizer states of this
        rank (AdamW's moments and step, or SGD's momentum), cut like the masters.

        Keys name the shard (`.shard{r}of{n}`), so DCP stores every shard once (replicas
        hold identical ones); loading them in place needs the same data-parallel layout,
        another layout takes them through `load_whole_state`. With Muon the
        states are per parameter: Muon's momentum, or AdamW's moments and step.
        """
        n, r = self.shard_axis.size, self.shard_axis.rank  # Muon: stage 0, no experts apart
        if hasattr(self.optimizer, "checkpoint_state"):  # ShardedMuon: per parameter piece
            tags = [f"{unit.name}.shard{axis.rank}of{axis.size}"
                    for unit, axis in zip(self.units, self.unit_shard)]
            return {**{f"master.{tag}": master.data for tag, master in zip(tags, self.masters)},
                    **self.optimizer.checkpoint_state(tags)}
        if self.views:
            return {**{f"master.{unit.name}.shard{r}of{n}": master.data
                       for unit, master in zip(self.units, self.masters)},
                    **{f"{key}.{name}.shard{r}of{n}": value
                       for name, state in self._view_states() for key, value in state.items()}}
        out = {}
        for unit, master, state, axis in zip(self.units, self.masters, self._unit_states(),
                                             self.unit_shard):
            tag = f"{unit.name}.shard{axis.rank}of{axis.size}"
            out[f"master.{tag}"] = master.data
            for kind in STATE_KINDS:
                if kind in state:
                    out[f"{kind}.{tag}"] = state[kind]
        return out

    def _unit_states(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each master, created empty where no step has run yet, so
        that a checkpoint load can fill it; the offloaded units' from the host tier (nvme:
        the committed version, which `after_checkpoint_load` writes back once loaded).
        SGD's momentum starts at zero, which its first step turns into the gradient itself,
        as torch's first step does without one."""
        self.wait_updates()
        offloaded = self.host.states() if self.host else []
        for master in self.masters[self.offloaded:]:
            state = self.optimizer.state[master]
            if state:
                continue
            if not isinstance(self.optimizer, torch.optim.SGD):
                state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(master),
                             exp_avg_sq=torch.zeros_like(master))
            elif self.optimizer.defaults["momentum"]:
                state.update(momentum_buffer=torch.zeros_like(master))
        return offloaded + [self.optimizer.state[master]
                            for master in self.masters[self.offloaded:]]

    @torch.no_grad()
    def load_whole_state(self, weights: dict[str, torch.Tensor],
                         states: dict[str, dict[str, torch.Tensor]], step: torch.Tensor,
                         local: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Set this rank's master weights and optimizer state from whole-model tensors by
        parameter name, `weights[name]` and `states[name][kind]`, a checkpoint written under
        another layout (fivefold.train.reshard). `local(name, tensor)` is this rank's part of
        a whole parameter (its tensor-parallel shard); each unit is then laid out flat and
        padded as at construction (fivefold.parallel.flat_unit) and this rank keeps its shard
        of the buffer, AdamW's moments (SGD's momentum) exactly like the weights they belong
        to, and every unit's step count is `step`. With Muon (stage 0, no tp: whole matrices) each
        parameter's state is copied whole."""
        if hasattr(self.optimizer, "checkpoint_state"):
            raise ValueError("a checkpoint of another layout is not resharded into sharded "
                             "Muon's state yet: resume with the layout it was written under")
        unit_states = None if self.views else self._unit_states()
        for i, (unit, master) in enumerate(zip(self.units, self.masters)):
            place_flat(unit, master.data, weights, local, self.stage)
            for kind, tensor in unit_states[i].items() if unit_states else []:
                if kind == "step":
                    tensor.copy_(step)
                else:
                    place_flat(unit, tensor, {n: states[n][kind] for n in unit.names}, local,
                               self.stage)
        for name, state in self._view_states() if self.views else []:
            if state.keys() != states[name].keys():
                raise ValueError(f"{name}: the checkpoint holds {sorted(states[name])}, this "
                                 f"optimizer keeps {sorted(state)}")
            for kind, tensor in state.items():
                tensor.copy_(states[name][kind])
        self.after_checkpoint_load()

    def _view_states(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """(name, optimizer state) of every Muon-path view, created empty where no step has
        run yet, so that a checkpoint load can fill them."""
        out, names = [], {id(view): name for name, view in self.views}
        for opt in self._torch_optimizers():
            for group in opt.param_groups:
                for view in group["params"]:
                    state = opt.state[view]
                    if not state and isinstance(opt, torch.optim.Muon):
                        state["momentum_buffer"] = torch.zeros_like(view)
                    elif not state:  # fused AdamW keeps its step counter on the device
                        step_device = view.device if group.get("fused") else "cpu"
                        state.update(step=torch.zeros((), device=step_device),
                                     exp_avg=torch.zeros_like(view),
                                     exp_avg_sq=torch.zeros_like(view))
                    out.append((names[id(view)], state))
        return out

    @torch.no_grad()
    def after_checkpoint_load(self) -> None:
        """Re-publish the loaded master weights to the compute parameters (offload: and let
        the host tier take the loaded step count and moments)."""
        if self.host:
            self.host.after_load()
        for unit, master, axis in zip(self.units, self.masters, self.unit_shard):
            if self.stage == 3:
                unit.shard.copy_(master)
            elif self.stage == 0:
                unit.full.copy_(master)
            else:
                unit.full[unit.shard_slice].copy_(master)
                C.all_gather(unit.full, unit.full[unit.shard_slice], axis, "params")

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value by its model name, gathered on every rank."""
        self.wait_updates()
        out = {}
        for unit, master, axis in zip(self.units, self.masters, self.unit_shard):
            if self.stage == 0:
                flat = master.detach()
            else:
                flat = torch.empty(unit.padded, dtype=torch.float32, device=unit.device)
                C.all_gather(flat, master.detach().to(unit.device), axis, "state_dict")
            for name, view in zip(unit.names, unit.views(flat)):
                out[name] = view.clone()
        return out
