"""The rank mesh: one explicit object naming every parallel axis and its process group.

Axes, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is innermost
so that its ranks are neighbours (the same node); the data-parallel degree splits into
`dp_shard` (ZeRO / FSDP sharding within a group, MiCS's partition group) and `dp_replicate`
(copies across groups). The sizes are the plan's (`ParallelPlan.mesh_shape`). Built on
torch's DeviceMesh; no global state: the mesh is passed to whatever needs an axis.

`expert_axes(ep, etp)` cuts a stage's ranks into the experts' grid (fivefold.expert_grid);
`expert_zero_axes` cuts its edp groups by zero group (hierarchical sharding of the experts).

`use_algorithms(choice, gpus_per_node)` (the `[comm]` config section, see
fivefold.comm.choice) makes every axis handed out afterwards carry the chosen collective
algorithms and its ranks per node; without it axes run the builtin collectives.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fivefold.comm.choice import CommAlgorithms, ranks_per_node
from fivefold.comm.collectives import Axis
from fivefold.comm.executor import ScheduledCollectives
from fivefold.comm.ledger import Ledger
from fivefold.parallel.plan import MESH_AXES


class Mesh:
    def __init__(self, shape: dict[str, int], device_type: str, ledger: Ledger):
        self.shape, self.ledger, self.device_type = shape, ledger, device_type
        self.world_size = 1
        for size in shape.values():
            self.world_size *= size
        self.device_mesh = None
        self.collectives: ScheduledCollectives | None = None
        self.gpus_per_node = 1
        self._expert_axes: dict[tuple[int, int], ExpertAxes] = {}
        if self.world_size > 1:
            self.device_mesh = init_device_mesh(device_type, tuple(shape[a] for a in MESH_AXES),
                                                mesh_dim_names=MESH_AXES)

    def use_algorithms(self, choice: CommAlgorithms | None, gpus_per_node: int) -> "Mesh":
        """Run collectives by `choice` (None: builtin) on the axes handed out from now on;
        call it right after building the mesh, before anything takes an axis."""
        self.collectives = None if choice is None else ScheduledCollectives(choice)
        self.gpus_per_node = gpus_per_node
        return self

    def _with_algorithms(self, axis: Axis) -> Axis:
        if self.collectives is None or axis.group is None:
            return axis
        members = dist.get_process_group_ranks(axis.group)
        return dataclasses.replace(axis, algorithms=self.collectives,
                                   per_node=ranks_per_node(members, self.gpus_per_node))

    def axis(self, name: str) -> Axis:
        if self.device_mesh is None:
            return Axis(name, None, 1, 0, self.ledger)
        group = self.device_mesh.get_group(name)
        return self._with_algorithms(Axis(name, group, self.shape[name], dist.get_rank(group),
                                          self.ledger))

    def joint_axis(self, *names: str) -> Axis:
        """Several adjacent axes flattened into one (e.g. the whole data-parallel group)."""
        sizes = [self.shape[n] for n in names]
        size = 1
        for s in sizes:
            size *= s
        if size == 1 or self.device_mesh is None:
            return Axis("+".join(names), None, 1, 0, self.ledger)
        if len(names) == 1:
            return self.axis(names[0])
        flat = self.device_mesh[names]._flatten("_".join(names))
        group = flat.get_group()
        return self._with_algorithms(Axis("+".join(names), group, size, dist.get_rank(group),
                                          self.ledger))

    def split_axis(self, name: str, inner: int, names: tuple[str, str]) -> tuple[Axis, Axis]:
        """Axis `name` cut into (outer, inner) sub-axes named `names`, the inner one of
        `inner` neighbouring ranks (hybrid context parallelism: ring across Ulysses groups).
        The sub-axes come from a second DeviceMesh over the same ranks, in the same order."""
        outer = self.shape[name] // inner
        if self.device_mesh is None or self.shape[name] == 1:
            return (Axis(names[0], None, 1, 0, self.ledger),
                    Axis(names[1], None, 1, 0, self.ledger))
        dims, sizes = [], []
        for axis in MESH_AXES:
            dims += list(names) if axis == name else [axis]
            sizes += [outer, inner] if axis == name else [self.shape[axis]]
        sub = init_device_mesh(self.device_mesh.device_type, tuple(sizes),
                               mesh_dim_names=tuple(dims))
        return tuple(Axis(n, sub.get_group(n), size, dist.get_rank(sub.get_group(n)),
                          self.ledger) for n, size in zip(names, (outer, inner)))

    def expert_axes(self, ep: int, etp: int = 1) -> ExpertAxes:
        """The experts' grid (fivefold.expert_grid, Megatron-Core's parallel folding): the
        dp x cp x tp ranks of one pp stage, in mesh order, cut into groups of `etp`
        neighbours ("etp": they hold slices of the same experts), `ep` of those groups
        ("ep": they hold different experts), and the ranks at the same place in every such
        block ("edp": copies of the same expert shards). Built once per degree, from a
        second DeviceMesh over the same ranks."""
        if (ep, etp) in self._expert_axes:
            return self._expert_axes[ep, etp]
        stage = self.shape["dp_replicate"] * self.shape["dp_shard"] * self.shape["cp"] \
            * self.shape["tp"]
        sizes = {"edp": stage // (ep * etp), "ep": ep, "etp": etp}
        if self.device_mesh is None or stage == 1:
            axes = ExpertAxes(*(Axis(n, None, 1, 0, self.ledger) for n in ("ep", "edp", "etp")))
        else:
            sub = init_device_mesh(self.device_mesh.device_type,
                                   (self.shape["pp"], *sizes.values()),
                                   mesh_dim_names=("pp", *sizes))
            axes = ExpertAxes(*(self._with_algorithms(Axis(n, sub.get_group(n), sizes[n],
                                                           dist.get_rank(sub.get_group(n)),
                                                           self.ledger))
                                if sizes[n] > 1 else Axis(n, None, 1, 0, self.ledger)
                                for n in ("ep", "edp", "etp")))
        self._expert_axes[ep, etp] = axes
        return axes

    def expert_data_groups(self, ep: int, etp: int = 1) -> list[list[int]]:
        """The global ranks of every edp group of `expert_axes(ep, etp)`, in axis order, the
        same list on every rank (for subgroups that every rank must create,
        fivefold.comm.zeropp)."""
        stage = self.shape["dp_replicate"] * self.shape["dp_shard"] * self.shape["cp"] \
            * self.shape["tp"]
        edp = stage // (ep * etp)
        ranks = torch.arange(self.world_size).view(self.shape["pp"], edp, ep, etp)
        return ranks.permute(0, 2, 3, 1).reshape(-1, edp).tolist()

    def expert_zero_axes(self, ep: int, etp: int = 1) -> tuple[Axis, Axis, list[list[int]]]:
        """Hierarchical sharding of the experts (MiCS, arXiv 2205.00119, Sec. 3, with
        `parallel.zero_group`): each edp group of `expert_axes(ep, etp)` cut into its
        dp_replicate parts, each the members inside one zero group (a zero group holds whole
        ep x etp grids, fivefold.expert_grid's check), as ("edp_shard", "edp_replicate")
        axes, and the members of every edp_shard group (the same list on every rank, for
        ZeRO++'s node subgroups, fivefold.comm.zeropp.split_by_node)."""
        stage = self.world_size // self.shape["pp"]
        replicas = self.shape["dp_replicate"]
        sizes = {"edp_replicate": replicas, "edp_shard": stage // (ep * etp * replicas),
                 "ep": ep, "etp": etp}
        sub = init_device_mesh(self.device_mesh.device_type, (self.shape["pp"], *sizes.values()),
                               mesh_dim_names=("pp", *sizes))
        shard, replicate = (self._with_algorithms(Axis(n, sub.get_group(n), sizes[n],
                                                       dist.get_rank(sub.get_group(n)),
                                                       self.ledger))
                            if sizes[n] > 1 else Axis(n, None, 1, 0, self.ledger)
                            for n in ("edp_shard", "edp_replicate"))
        ranks = torch.arange(self.world_size).view(self.shape["pp"], *sizes.values())
        return shard, replicate, ranks.permute(0, 1, 3, 4, 2).reshape(-1, sizes["edp_shard"]
                                                                    ).tolist()

    def axis_groups(self, *names: str) -> list[list[int]]:
        """The global ranks of every group of `joint_axis(*names)`, in axis order, the same
        list on every rank (torch.distributed.new_group must see every group's calls on
        every rank, fivefold.comm.zeropp.split_by_node)."""
        ranks = torch.arange(self.world_size).view(*(self.shape[a] for a in MESH_AXES))
        inner = [MESH_AXES.index(n) for n in names]
        outer = [d for d in range(len(MESH_AXES)) if d not in inner]
        size = 1
        for n in names:
            size *= self.shape[n]
        return ranks.permute(*outer, *inner).reshape(-1, size).tolist()


class ExpertAxes(NamedTuple):
    """The experts' grid axes of a rank (`Mesh.expert_axes`)."""

    ep: Axis
    edp: Axis
    etp: Axis
