"""Memory traffic of fivefold's own AdamW update: torch's unfused passes, counted per element.

The update is memory bound, so its time is the bytes it moves over the device's bandwidth.
A fused AdamW kernel (Transformer Engine's and Apex's FusedAdam under Megatron-Core and
DeepSpeed; torch's `fused=True`, torchtitan's default `optimizer.implementation`) reads the
fp32 master, gradient and two moments and writes master and moments once: 28 bytes per
element (fivefold.hardware.ADAM_BYTES), which fivefold.planner.simulate charges those stacks.

fivefold's runtime steps torch.optim.AdamW without `fused`: on a CPU the per-tensor loop, on
CUDA the multi-tensor `foreach` form, the same sequence of element-wise passes either way
(torch/optim/adam.py, `_single_tensor_adam` and `_multi_tensor_adam`, non-capturable):

    lerp_ m towards g          read m, g; write m          12 B
    mul_ v by beta2            read v; write v              8 B
    addcmul_ v += (1-b2) g g   read v, g; write v          12 B
    sqrt(v) into a temporary   read v; write t              8 B
    div by the bias correction read t; write t              8 B
    add eps                    read t; write t              8 B
    addcdiv_ master            read master, m, t; write    16 B
                                                           ----
                                                           72 B  (TORCH_ADAMW_BYTES)

Around it, per element of the rank's optimizer shard (fivefold.parallel.grad_clip and
fivefold.parallel.data_parallel.DataParallelEngine.step):
- the gradient-norm clip reads the fp32 gradient for its norm (4 B) and scales it in place,
  always (torch's clamped coefficient: 8 B);
- with weight decay, the engine's decoupled decay multiplies the master by
  `where(decay_mask, 1 - lr wd, 1)`: the mask read and a fp32 factor written (5 B), then
  master and factor read and master written (12 B); the plain one-rank path leaves decay to
  AdamW itself, one in-place multiply (8 B) of the matrices, here counted on every element
  (the vectors, norm gains, are a few hundredths of a percent of them);
- a compute copy narrower than fp32 is re-published from the master (4 B read, a written);
  in fp32 it is the master (stages 0-2) or its shard is (stage 3);
- the engine zeroes its gradient buffers (the whole padded unit at stages 0-1, the shard at
  2-3, in its dtype); the plain path sets gradients to None.

Not counted: the stages 0-1 widening of a bf16 reduced gradient into the master's fp32 one
(g read, 4 B written), which the end of the last backward does, outside the update.
tests/test_update_traffic.py counts the bytes the runtime's update really moves, op by op.

Measured on the 2-core development VM (2026-12-02, fp32, 5.05M parameters, two gloo ranks):
the update phase of a DDP step took 33-34 ms, against 32 ms for these bytes at the
calibrated 16.6 GB/s and 12 ms for a fused count; torch's fused CPU AdamW ran the same 5.05M
elements 2.5x faster than the unfused one (6.1 ms against 15.4 ms, one process). The runtime
keeps the unfused kernel because CPU offload's default update is bit for bit the in-memory
one (`parallel.offload_kernel`).
"""

from __future__ import annotations

from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner.memory import Unit

TORCH_ADAMW_BYTES = 72
TORCH_ADAMW_OPS = 7  # element-wise passes per tensor, as counted above
CLIP_BYTES, CLIP_OPS = 4 + 8, 2
ENGINE_DECAY_BYTES, PLAIN_DECAY_BYTES = 5 + 12, 8


def eager_adamw_traffic(units: list[Unit], lay: ParallelPlan, weight_decay: float
                        ) -> tuple[float, int]:
    """(bytes, element-wise passes) of fivefold's AdamW update over one rank's device-resident
    `units` (module docstring)."""
    engine = lay.update == "engine"
    a, g = PRECISION_BYTES[lay.precision], PRECISION_BYTES[lay.reduce_dtype]
    decay = (ENGINE_DECAY_BYTES if engine else PLAIN_DECAY_BYTES) if weight_decay else 0
    per_element = TORCH_ADAMW_BYTES + CLIP_BYTES + decay + (0 if a == 4 else 4 + a)
    ops = TORCH_ADAMW_OPS + CLIP_OPS + (2 if engine else 1) * bool(weight_decay)
    traffic, passes = 0.0, 0
    for u in units:
        local = u.shard_numel if lay.zero_stage >= 1 else u.padded
        traffic += local * per_element
        if engine:  # the gradient buffers zeroed for the next step
            traffic += (u.padded * a if lay.zero_stage <= 1 else local * g)
            passes += 1
        passes += ops
    return traffic, passes
