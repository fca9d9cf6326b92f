"""The `[parallel]` section of a config: the layout of a run over its ranks (data, tensor,
pipeline, context and expert degrees, ZeRO, schedules, recomputation, offload, precision).
fivefold.config assembles the sections, and fivefold.validate_parallel checks these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config_fields import doc_field as _doc


@dataclass
class ParallelConfig:
    auto: bool = _doc('let the planner choose the layout for the launched ranks (also written '
                      '`parallel = "auto"`); keys set alongside are held fixed (docs/planner.md)',
                      False)
    dp: int | None = _doc("data-parallel degree; default = ranks / (tp*pp*cp)", None)
    tp: int = _doc("tensor-parallel degree", 1)
    pp: int = _doc("pipeline-parallel degree", 1)
    cp: int = _doc("context-parallel degree", 1)
    ep: int = _doc("expert-parallel degree", 1)
    etp: int = _doc("expert tensor-parallel degree: each routed expert's MLP split over etp "
                   "ranks (column then row parallel); the experts' grid etp x ep x "
                   "expert-data folds onto the tp x cp x dp ranks of a stage (docs/moe.md)", 1)
    zero_group: int | None = _doc("shard within groups of this many dp ranks (MiCS/HSDP)", None)
    cp_mode: str = _doc('"ulysses" | "ring" | "hybrid" (Ulysses inside groups of cp_ulysses '
                        'ranks, ring across them)', "ring")
    cp_ulysses: int | None = _doc("hybrid context parallelism: the Ulysses degree (neighbouring "
                                  "ranks, one node); the ring degree is cp / cp_ulysses", None)
    vpp: int = _doc("virtual pipeline stages per rank (interleaved schedule; 2 for zbv and "
                    "dualpipev)", 1)
    schedule: str = _doc('"gpipe" | "1f1b" | "interleaved" | "zb" | "zbv" | "dualpipev" | '
                         '"pipedream-2bw" | "terapipe"', "1f1b")
    stage_layers: list[int] | None = _doc("blocks per pipeline stage, pp*vpp numbers from the "
                                          "first stage; default balanced by cost", None)
    token_slices: int | None = _doc("TeraPipe: slices each sequence is cut into; default pp",
                                    None)
    weight_prediction: bool = _doc("PipeDream-2BW: compute with weights extrapolated one "
                                   "update ahead, offsetting part of the one-step staleness "
                                   "(one more copy of the weights)", False)
    zero_stage: int = _doc("0 plain data parallel, 1 shard optimizer, 2 +grads, 3 +params", 0)
    micro_batch: int | None = _doc("sequences per micro-batch per dp rank; default no accumulation",
                                   None)
    global_batch: int = _doc("sequences per optimizer step, all ranks together", 8)
    dp_batch_shares: list[int] | None = _doc("each dp replica's share of the global batch, "
                                             "e.g. [2, 1, 1] (docs/data_parallel.md); default "
                                             "even", None)
    recompute: str = _doc('"none" | "selective" | "full" activation recomputation', "none")
    offload: str = _doc('"none" | "cpu" (fp32 master weights and optimizer states in host '
                        'memory, the optimizer step on the CPU) | "nvme" (optimizer states in '
                        'files under offload_path, streamed through the CPU step) '
                        '(ZeRO-Offload / ZeRO-Infinity; docs/memory.md)', "none")
    offload_path: str | None = _doc('offload = "nvme": a writable directory for the '
                                    'optimizer-state files (one subdirectory per rank)', None)
    offload_fraction: float = _doc("share of the optimizer (by parameters, Megatron-style) "
                                   "that offload moves off the device; in (0, 1]", 1.0)
    offload_kernel: str = _doc('the offloaded CPU AdamW: "foreach" (torch\'s multi-tensor '
                               'kernel, bit for bit the in-memory update) | "fused" (torch\'s '
                               'fused CPU kernel, about 5x faster, rounds differently: within '
                               'the parity tolerance); docs/memory.md', "foreach")
    offload_activations: int = _doc("blocks per pipeline stage (its first ones; under vpp > 1 "
                                    "of each model chunk) whose tensors saved for backward are "
                                    "copied to host memory (pinned on CUDA) in forward and back "
                                    "in backward (Megatron-Core's cpu_offloading_num_layers; "
                                    "docs/memory.md)", 0)
    sequence_parallel: bool = _doc("Megatron sequence parallelism with tp", False)
    precision: str | None = _doc('"bf16" | "fp16" | "fp8" | "fp32"; default bf16 on GPU, '
                                 'fp32 on CPU; fp8: the blocks\' linears in fp8, the rest in '
                                 'bf16 on GPU, fp32 on CPU', None)
    fp8_emulate: bool | None = _doc("precision fp8: round each GEMM input to fp8 and run the "
                                    "GEMM in fp32 (any device) instead of fp8 GEMMs; default "
                                    "true where the device has no fp8 units (CPU, GPUs before "
                                    "compute capability 8.9) (docs/fp8.md)", None)
    fp8_recipe: str = _doc('precision fp8: "tensorwise" (one scale per tensor) | "rowwise" '
                           "(one per row along each GEMM's contracted dim)", "tensorwise")
    fp8_tensors: list[str] = _doc('precision fp8: the tensor classes rounded to fp8, of '
                                  '"input", "weight" (e4m3) and "grad_output" (e5m2); a GEMM '
                                  "with both operands in fp8 runs on fp8 units", factory=lambda:
                                  ["input", "weight", "grad_output"])
    reduce_dtype: str | None = _doc('gradient reduce-scatter dtype for zero_stage 2-3 "fp32" | '
                                    '"bf16" | "fp16"; default: the compute dtype (stages 0-1 '
                                    "reduce the gradient buffer itself, in the compute dtype)",
                                    None)
    qwz: bool = _doc("ZeRO++ qwZ: int8 block-quantized weight all-gather (zero_stage 3)", False)
    hpz: bool = _doc("ZeRO++ hpZ: node-local secondary weight shard for backward (zero_stage 3)",
                     False)
    qgz: bool = _doc("ZeRO++ qgZ: int8 gradient reduce-scatter by hierarchical all-to-all "
                     "(zero_stage >= 1)", False)
