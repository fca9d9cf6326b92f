"""Software stacks: what the software that runs a step does with the hardware (`train.stack`).

A hardware profile (fivefold.hardware) holds datasheet figures and the rates that kernels
reach in a microbenchmark. Which kernels a step runs, what it keeps for backward and what it
hides behind what is the software's: the same H100 runs Megatron-Core 35-57% faster than
eager PyTorch. A spec names its software with `train.stack`; each stack is a fixed set of
switches, every one with a physical effect and a source. The simulator reads the switches;
"fivefold" describes this runtime, and under it every prediction (memory, ledger,
activations) equals fivefold's own to the byte.

The stack says which kernels run, never how fast: a profile's `architecture` (never its
name) tells `attention_generation` which attention kernel a release runs there, and the
profile's kernel tables price it (fivefold.kernel_tables).

What was chosen by reading published rows: every switch of the megatron, torchtitan and
deepspeed stacks was introduced while the rows of calibration_runs.json that it changes were
being read and their misses studied, and three placements were made by where rows fall (the
Hopper and Blackwell FlashAttention-3 release dates, the per-chunk launch charge of
tp_overlap_chunks). A switch is not keyed by run, model or source, but cross-validation
cannot see a choice made while reading the held-out rows. fivefold.planner.fitted_to lists each
such switch with the rows it was chosen on; `fivefold plan validate` prints it next to its
figures. The fivefold stack's switches describe this runtime and are checked against it.

- fused_eltwise: element-wise chains (norms, rotary, activation, residual) run as fused
  kernels, one HBM pass per tensor (Megatron-Core with Transformer Engine: fused RMSNorm,
  SwiGLU, RoPE, bias-dropout-add); else the profile's eager `eltwise_passes` unless
  `train.compile` fuses them.
- flash2_attention: the stack's attention is a FlashAttention-2-class kernel (torch 2.5's
  SDPA, which torchtitan's Dec 2024 runs used) on every architecture whose FlashAttention-3-
  class kernel its release predates (fa3_since). The profile prices each kernel generation
  (fivefold.kernel_tables): on Hopper FlashAttention-2 runs at arXiv 2407.08608's H100
  ratio to FlashAttention-3 (0.565), on Ampere it is the only generation, and Blackwell has
  no FlashAttention-2-class figure.
- fa3_since: the software release (`train.stack_release`, "YYYY-MM") from which the
  stack's attention is FlashAttention-3-class on each architecture; before it, and on
  Hopper and later, flash2_attention holds. Megatron's attention is Transformer Engine's
  cuDNN fused attention (chosen over flash-attn on sm90 since TE 1.4: "Select
  FusedAttention on sm90"); cuDNN's Hopper kernel was FlashAttention-3-class by mid 2024
  (arXiv 2407.08608 measures it at 0.92 of FlashAttention-3, forward and backward), so on
  Hopper from 2024-07; the NeMo 24.03 long-context rows run at the FlashAttention-2-class
  rate. On Blackwell from 2025-09 (TE PR #2125 of 2025-09-17, which the Megatron-Core
  ModelZoo rows need); that boundary was placed between the NeMo 25.02-25.07 Blackwell rows
  and the Bridge 25.11 row, not by a Blackwell kernel measured here, and it prices nothing
  now: the Blackwell profiles have no FlashAttention-2-class figure, so both sides run at
  their one attention rate (docs/planner.md). No release given: the stack's newest.
- loss_logit_bytes: bytes per logit the loss holds beyond the saved activations: fivefold
  upcasts the logits and keeps their fp32 copy and gradient (a + 8); torchtitan (Dec 2024)
  deletes the bf16 logits after the loss and holds the fp32 gradient pair in backward (8);
  Megatron-Core's fused vocabulary-parallel cross-entropy writes the gradient into the
  logits buffer (a: no fp32 logits at all).
- loss_saves_fp32: the loss keeps an fp32 log-softmax (4 bytes per logit) for backward;
  Megatron's fused loss keeps nothing beyond its logits buffer.
- flash_attention_since: the first release (`train.stack_release`) whose attention is a
  fused FlashAttention-class kernel. Megatron-LM merged FlashAttention on 2023-01-11
  (merge 285068c "Merge branch 'tridao-flashattn' into 'main'" of Tri Dao's commit d693034,
  "Integrate FlashAttention into Megatron-LM", --use-flash-attn); RoPE, SwiGLU and RMSNorm
  followed in 2023. A release before it runs the older GPT block, whose unfused attention
  keeps the s x s scores and whose dropouts keep their masks; its activations are arXiv
  2205.05198's (fivefold.planner.activations_megatron2022) and its attention is the
  "unfused" generation (attention_generation): the full s x s scores of two batched GEMMs
  at the profile's GEMM rate, written, soft-maxed (Megatron's fused scale-mask-softmax),
  dropped out with a one-byte mask and read back through HBM
  (fivefold.planner.op_prices.unfused_attention_time). DeepSpeed's runs of arXiv
  2104.04473 Table 2 ran the same Megatron model code, so the deepspeed stack shares the
  date. The date is the merge's, not placed by published rows.
- tp_overlap: tensor-parallel collectives overlap the GEMMs they feed (Transformer
  Engine's userbuffers, NeMo's tp_comm_overlap = True): only the excess over the block's
  GEMM time and (1 - overlap_eff) of it show. Only with sequence parallelism: Megatron-LM
  refuses tp_comm_overlap without it (megatron/training/arguments.py `validate_args`:
  "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is
  enabled"), so a tp run without sequence parallelism runs its all-reduces exposed.
- tp_overlap_since: the first release (`train.stack_release`) with tp_overlap: Transformer
  Engine's userbuffers overlap arrived in TE v0.9 (2023-05; TE PR #147, "TP communication
  overlap with userbuffers"); Megatron-LM of 2021 (arXiv 2104.04473) runs its tensor-parallel
  all-reduces between the GEMMs, exposed.
- tp_async_grad_since: from this release a column-parallel linear's input-gradient
  collective (the all-reduce, or with sequence parallelism the reduce-scatter) runs beside
  its weight-gradient GEMM even without tp_overlap: Megatron-LM's
  `LinearWithGradAccumulationAndAsyncAllreduce` issues it with async_op before the weight
  gradient (megatron/mpu/layers.py, on by default since commit 3f65246 of 2021-09-02, which
  added --no-async-tensor-model-parallel-allreduce). The forward's collectives stay exposed.
- tp_overlap_chunks: the overlap is Transformer Engine's ring exchange: a GEMM fed by a
  sequence-parallel all-gather (qkv and fc1 forward, proj and fc2 input gradients) or
  drained by a reduce-scatter (proj and fc2 forward) runs as tp GEMMs of 1/tp of the rows,
  each overlapping one chunk's transfer, so each chunk reads the whole weight again and pays
  its own launch (`compute.tp_ring_gemm_time`); the reduce-scatters of qkv and fc1's input
  gradients ride behind the weight-gradient GEMMs whole ("bulk"). This is every fp8
  userbuffers configuration of NeMo 2.x (nemo/collections/llm/recipes/tp_overlap_configs/
  userbuffers.py @v2.3.0: RingExchangeOverlapCfg for those six GEMMs, BulkOverlapCfg for the
  rest) and TE's default for the all-gather side; NeMo's bf16 configurations, and TE's
  default for the reduce-scatter side (which runs without a NeMo config, as the 2024-03
  rows may have), drain proj and fc2 forward in 4 pipelined splits with 16-32 SMs held
  instead, which is timed here as ring chunks too. TE issues the chunks round-robin on up
  to three compute streams (comm_gemm_overlap.cpp), so part of each chunk's fixed cost may
  overlap the next; charging one launch per GEMM instead fitted the rows worse
  (docs/planner.md).
- dp_overlap: the distributed optimizer's parameter all-gather after the step overlaps the
  next forward (Megatron's overlap_param_gather, NeMo's performance recipes): only the
  excess over the first micro-batch's forward shows.
- fp8_param_gather_since: from this release, under fp8 that all-gather moves fp8
  parameters, one byte each (NeMo's fp8 precision recipes from PR #10208, 2024-09-19:
  `bf16_with_fp8_mixed` sets fp8_params, hence Megatron's fp8_param_gather; its current-
  scaling recipes set fp8_param_gather = True, its MXFP8 ones from v2.4.0; the NeMo docs:
  "reducing the all-gather overhead by half"). Megatron-LM scripts choose it by a flag
  (--fp8-param-gather) no row states; the rows of 2024-09 and later outside NeMo take the
  release's default, and their re-gather hides behind the forward either way. The weights
  then live as fp8 (`fp8_weight_bytes`, what fivefold.planner.memory counts): Megatron
  builds the model under Transformer Engine's fp8_model_init (pretrain_gpt.py
  model_provider), so every TE linear's weight (TransformerEngineBaseModule's
  primary_weights_in_fp8: qkv, proj, fc1, fc2, the grouped experts; not norms, router,
  embedding or head) is one byte; where the GPU's fp8 GEMMs take only the TN layout TE
  also keeps each weight's transpose, one byte more (transformer_engine/pytorch/tensor/
  utils.py post_all_gather_processing: "if backend does not support non-transposed FP8
  GEMM, pre-create the transpose"; utils.is_non_tn_fp8_gemm_supported: compute
  capability 10.x or 13+, i.e. NON_TN_FP8_ARCHITECTURES): on Hopper two bytes, as bf16.
  An MXFP8 weight holds a rowwise and a columnwise copy on any GPU (TE's MXFP8 master-weight
  cast writes `_rowwise_data` and `_columnwise_data`), two bytes; the spec cannot state
  MXFP8, so its rows are counted as per-tensor ones, one byte short on Blackwell.
- fp8_sp_gather: under fp8 with sequence parallelism the all-gather of a region's input
  moves its fp8 copy, one byte per element (Transformer Engine's LayerNormLinear writes the
  norm's output in fp8 and gathers that, `_LayerNormLinear.forward` @v1.7; torchao's
  `PrepareFloat8ModuleInput`, below). fivefold's runtime gathers the compute dtype and
  quantizes inside each linear (fivefold.parallel.fp8.linear; its ledger says bf16).
- fp8_shard_casts: torchao's Float8 tensor parallelism as torchtitan's plan applies it
  (`parallelize_llama.apply_tp` @9dec370: `PrepareFloat8ModuleInput` ahead of attention and
  feed_forward, `Float8RowwiseParallel` for wo and w2; torchao
  float8/float8_tensor_parallel.py): with tp > 1 and sequence parallelism each module's
  input is cast once, on its sequence shard (1/tp of the rows), before its fp8 all-gather,
  and wq, wk, wv (w1, w3) share it; a row-parallel linear's output gradient is cast on its
  shard before its all-gather back. Without it each linear casts its whole gathered input
  (compute.fp8_cast_bytes).
- fp8_fused_casts: fp8 scaling and casts are fused into the preceding norm / activation
  kernels and the weights cast once per step (Transformer Engine), so the per-micro-batch
  cast traffic is one read and one fp8 write of the activations only; else torchao's
  separate amax / cast / transpose passes (fivefold.planner.compute.fp8_cast_bytes).
- fp8_saved_inputs: under fp8 the linear layers keep their inputs for backward in fp8
  (Transformer Engine saves the fp8 copy it already made); activations accounted by
  Transformer Engine's modules (fivefold.planner.activations.te_block_saved_bytes: norms save
  their input and rsigma, attention saves q, k, v without repeating GQA heads).
- recompute_early_stop: full recomputation stops once backward has every tensor it saved
  (torch.utils.checkpoint without reentrancy, which fivefold.memory.recompute runs, stops
  there by default), so a dense block's last GEMM (w2) and the MLP region's closing
  collective are not run again, unless a split backward recomputes whole blocks
  (fivefold.planner.op_compute.early_stop; the ledger counts the same: ledger_model). The
  runtime's op trace shows it (tests/test_op_trace.py); other stacks rerun the whole forward.
- offload_copies_inline: activation offload's copies queue on the compute stream, each
  return issued when backward unpacks it (fivefold.memory.activation_offload), so every
  copy adds to its pass (fivefold.planner.activation_offload.inline_copy_s); else they run
  on a side stream with the returns prefetched, as Megatron-Core's cpu_offloading does.
- autocast_fp32_weights: a layout the data-parallel engine does not run (one rank, the
  plain, LOMO or GaLore update) trains fp32 weights under a bf16/fp16 autocast, which saves
  the norms' fp32 outputs, a cast of each linear's input and each weight's cast
  (fivefold.planner.activations_autocast, equal to the runtime's to the byte); other stacks
  hold half-precision weights with fp32 masters on every layout.
- zero3_recompute_gathers: all-gathers of a ZeRO-3 block per step under full recomputation:
  DeepSpeed's ZeRO-3 runs its pre-forward hook again for the recomputed forward (3);
  FSDP2, Megatron-FSDP and fivefold gather once for backward and recompute inside it (2).
- expert_group_stride_1: the expert-parallel group is folded onto adjacent ranks of the
  tensor x data grid (Megatron-Core's MoE parallel folding, arXiv 2504.14960), so an
  expert group of up to a node's size stays on NVLink; and with sequence parallelism each
  tensor-parallel rank dispatches only its 1/tp of the tokens.
- zero3_pp_unsharded: under pipeline parallelism each ZeRO-3 block stays gathered from its
  first forward of the step to its last backward (torchtitan's apply_fsdp: with pp,
  `reshard_after_forward = False`, "to avoid per-microbatch all-gathers, which can be
  expensive and non-overlapped"; torch.distributed.pipelining syncs and reshards FSDP
  gradients only on a stage's last backward): one all-gather per block per step, behind
  the stage's first forward, and one reduce-scatter, behind its last backward; the rank
  holds its blocks' unsharded parameters and their accumulated unsharded gradients (in the
  reduce dtype) all step. Else (fivefold's runtime, FSDP without pp) a block is gathered
  for every micro-batch's forward and backward.
- zero3_live_params: ZeRO-3 parameters held gathered at once: DeepSpeed gathers per
  sub-module up to `stage3_max_live_parameters` (default 1e9, DeepSpeed's config
  reference); FSDP2, Megatron-FSDP and fivefold hold the block being computed and the one
  prefetched (0 here).
- cp_kv_exchange: how ring context parallelism moves key/value shards. "ring": one
  point-to-point pass per attention step, hidden behind that step (Megatron-Core's
  Transformer Engine CP, arXiv 2310.01889; fivefold's ring). "allgather": torch's
  experimental `context_parallel` of torch 2.5/2.6 that torchtitan's Dec 2024 runs used
  (torch/distributed/tensor/experimental/_attention.py: `_ContextParallelOptions.
  rotate_method` defaults to ALL_GATHER, `convert_to_f32` and `enable_load_balance` to
  True): the forward all-gathers every rank's K/V once, issued before the local step and
  waited before the second, so only the first of cp equal (load-balanced) steps hides it;
  the backward all-gathers K/V again the same way and passes the fp32 dK/dV accumulators
  around the ring (an all-to-all permute per step, each waited one step later, the last
  after the loop); the partial outputs are merged in fp32 by eager element-wise ops
  (fivefold.planner.op_prices.torch_cp_merge_bytes).
- sdpa_repeats_kv: the model repeats grouped K/V heads to every query head before the
  attention call (torchtitan's Llama `repeat_kv` ahead of `F.scaled_dot_product_attention`),
  so context parallelism moves and merges query-width K/V; Transformer Engine and fivefold's
  ring pass the kv heads as they are.
- zero3_overlap: ZeRO-3's parameter all-gathers run ahead of the compute that needs them
  (FSDP2's and Megatron-FSDP's prefetch of the next block; fivefold's). DeepSpeed's ZeRO-3
  of early 2021 (the version arXiv 2104.04473 compared, April 2021) gathered each
  parameter tensor with its own all-gather and synchronised before the next
  (DeepSpeed issue #1069: per-parameter all_gather calls with a torch.cuda.synchronize()
  between them; PR #1170, June 2021, fixed the off-by-one trace that broke its prefetch;
  issue #1174: ZeRO-3's forward 8x ZeRO-2's, bound by the gathers): False here, so each
  tensor's gather is on the critical path. Its gradients are reduce-scattered tensor by
  tensor on their own stream (partition_parameters._reduce_scatter_gradient, a list
  reduce_scatter per parameter), but the next block's first gather calls
  torch.cuda.synchronize(), so they hide only behind the backward of their own block.
- zero3_persist_numel: ZeRO-3 parameters with fewer elements stay whole on every rank and are
  never gathered (DeepSpeed's stage3_param_persistence_threshold, default 100000 in v0.3.14
  of April 2021, runtime/zero/constants.py: norms and biases); 0: every tensor is sharded.
- zero3_list_gather: each synchronous gather (zero3_overlap False) is a
  torch.distributed.all_gather into a list of one view per rank (DeepSpeed v0.3.14,
  partition_parameters._allgather_param), which PyTorch's ProcessGroupNCCL of that time ran
  into a flat buffer and copied back with one copy_ per rank (ProcessGroupNCCL::allgather's
  copy-back loop; `_all_gather_base`, which avoids it, came later, as DeepSpeed PR #1188 of
  June 2021 notes): n kernels per gather on an n-rank group, each the profile's
  kernel_overhead_s; likewise each gradient's list reduce_scatter
  (partition_parameters._reduce_scatter_gradient) copies its n inputs into a flat buffer.
- ring_kernel: the kernel ring context parallelism runs per block. "math": fivefold's ring
  (fivefold.parallel.context.block_attention has only its explicit fp32 matmul path, on
  every device), timed by fivefold.planner.op_prices.math_ring_attention_time; "fused": a
  FlashAttention-class kernel that returns the log-sum-exp (Transformer Engine, torch's
  SDPA), timed like any fused attention.
- eager_adamw: the AdamW update runs as torch's unfused element-wise passes (72 bytes per
  element) with the runtime's clipping, decay and gradient zeroing around it
  (fivefold.planner.update_bytes: fivefold's runtime, which steps torch.optim.AdamW without
  `fused`); else one fused pass, 28 bytes per element (Megatron-Core's and DeepSpeed's
  FusedAdam; torchtitan's `optimizer.implementation = "fused"`, its default).
- experts_follow_tp: with tp > 1 an MoE layer is split over tp like a dense MLP: routed and
  shared experts' widths divided by tp, every tp rank on all the tokens (Megatron-Core's
  expert tensor parallelism at its default of the time, expert_tensor_parallel_size = tp;
  the torchtitan and DeepSpeed rows are dense models). Else the layer runs on the experts'
  own grid, as fivefold's runtime does (fivefold.expert_grid, MoE Parallel Folding): each
  tp rank routes its 1/tp of the tokens, the router and shared experts are whole on every
  tp rank, and the routed experts are split over the layout's ep x etp (their width over
  etp, each etp rank computing its group's rows).
- selective_modules: `recompute = "selective"` re-runs modules without GEMMs (Megatron's
  --recompute-modules layernorm / moe_act / core_attn, arXiv 2205.05198 Sec. 5) and drops
  their saved outputs; else torchtitan's per-op policy, which re-runs every second matmul
  (fivefold.planner.compute.selective_recomputed).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

# Architectures whose fp8 GEMMs read either operand layout (fp8_param_gather_since, above)
NON_TN_FP8_ARCHITECTURES = ("blackwell",)


@dataclass(frozen=True)
class Stack:
    name: str
    fused_eltwise: bool = False
    flash2_attention: bool = False
    loss_logit_bytes: str = "a+8"  # "a+8" | "8" | "a"
    loss_saves_fp32: bool = True
    tp_overlap: bool = False
    dp_overlap: bool = False
    fp8_fused_casts: bool = False
    fp8_saved_inputs: bool = False
    zero3_recompute_gathers: int = 2
    recompute_early_stop: bool = False
    offload_copies_inline: bool = False
    autocast_fp32_weights: bool = False
    expert_group_stride_1: bool = False
    selective_modules: bool = False
    eager_adamw: bool = False
    experts_follow_tp: bool = True
    zero3_live_params: int = 0  # 0: two whole blocks gathered at a time
    zero3_pp_unsharded: bool = False
    cp_kv_exchange: str = "ring"  # "ring" | "allgather"
    sdpa_repeats_kv: bool = False
    zero3_overlap: bool = True
    zero3_persist_numel: int = 0
    zero3_list_gather: bool = False
    ring_kernel: str = "fused"  # "fused" | "math": ring CP's per-block attention kernel
    fa3_since: tuple[tuple[str, str], ...] = ()  # (architecture, first "YYYY-MM" release)
    tp_overlap_since: str = ""  # first "YYYY-MM" release with tp_overlap; "": every one
    tp_async_grad_since: str | None = None  # first release with async input-gradient collectives
    flash_attention_since: str = ""  # first release with fused attention; "": every one
    tp_overlap_chunks: bool = False  # tp_overlap runs its GEMMs as tp ring-exchange chunks
    fp8_param_gather_since: str | None = None  # first release gathering fp8 parameters
    fp8_sp_gather: bool = False  # fp8 + sequence parallelism: the input gather moves fp8
    fp8_shard_casts: bool = False  # torchao Float8 TP: one cast per module, on its shard
    release: str | None = None  # train.stack_release; None: the newest
    source: str = ""

    def released_since(self, first: str) -> bool:
        """This release is `first` ("YYYY-MM") or later; no release given is the newest."""
        return self.release is None or self.release >= first

    @property
    def overlaps_tp(self) -> bool:
        """tp_overlap in this release."""
        return self.tp_overlap and self.released_since(self.tp_overlap_since)

    @property
    def async_tp_grads(self) -> bool:
        """Backward tensor-parallel collectives beside the weight gradients (this release)."""
        return (self.tp_async_grad_since is not None
                and self.released_since(self.tp_async_grad_since))

    def overlaps_tp_collectives(self, tp: int, sequence_parallel: bool) -> bool:
        """A layout's tensor-parallel collectives run beside its GEMMs: tp_overlap in this
        release, tp > 1 and sequence parallelism on (module docstring, tp_overlap)."""
        return self.overlaps_tp and tp > 1 and sequence_parallel

    @property
    def unfused_gpt_block(self) -> bool:
        """This release predates the stack's FlashAttention: its blocks are the older GPT
        block of arXiv 2205.05198 (flash_attention_since)."""
        return bool(self.flash_attention_since) and not self.released_since(
            self.flash_attention_since)

    @property
    def gathers_fp8_params(self) -> bool:
        """Under fp8 the distributed optimizer all-gathers fp8 parameters (this release)."""
        return (self.fp8_param_gather_since is not None
                and self.released_since(self.fp8_param_gather_since))

    def fp8_weight_bytes(self, precision: str, architecture: str) -> int | None:
        """Bytes per element of the blocks' linear weights where the stack keeps them as fp8
        (gathers_fp8_params; module docstring): one, and one more for the transpose off
        NON_TN_FP8_ARCHITECTURES; None where it does not (the compute dtype's bytes)."""
        if precision != "fp8" or not self.gathers_fp8_params:
            return None
        return 1 if architecture in NON_TN_FP8_ARCHITECTURES else 2

    def expert_width_split(self, tp: int, etp: int) -> int:
        """The degree a routed expert's width is split over under this stack."""
        return tp if self.experts_follow_tp else etp

    def moe_token_share(self, tp: int, sp: bool) -> int:
        """The divisor of a rank's tokens an MoE layer routes on it: tp on the experts' own
        grid; under an external stack, tp where sequence parallelism and its folding
        (expert_group_stride_1) hand each tp rank its sequence shard, else 1."""
        if not self.experts_follow_tp:
            return tp
        return tp if sp and self.expert_group_stride_1 else 1

    def logit_bytes(self, a: int) -> int:
        return {"a+8": a + 8, "8": 8, "a": a}[self.loss_logit_bytes]

    def attention_generation(self, architecture: str) -> str:
        """The attention kernel this release runs on `architecture` (a profile's
        `architecture` field): "unfused" before the stack's FlashAttention
        (flash_attention_since), "fa2" on an architecture whose FlashAttention-3-class
        kernel this release predates (flash2_attention, fa3_since), else "fa3"; the
        profile prices each generation (fivefold.kernel_tables.attention_rate)."""
        if self.unfused_gpt_block:
            return "unfused"
        if not self.flash2_attention:
            return "fa3"
        since = dict(self.fa3_since).get(architecture)
        return "fa3" if since is not None and self.released_since(since) else "fa2"


FIVEFOLD = Stack("fivefold", ring_kernel="math", eager_adamw=True, experts_follow_tp=False,
                 recompute_early_stop=True, offload_copies_inline=True,
                 autocast_fp32_weights=True,
                 source="this runtime: eager PyTorch blocks (train.compile fuses them), SDPA "
                        "attention (ring CP: explicit fp32 blocks), fp32 loss, exposed TP "
                        "collectives, torch's unfused AdamW, MoE layers on the experts' own "
                        "etp x ep x edp grid")
STACKS: dict[str, Stack] = {s.name: s for s in [
    FIVEFOLD,
    Stack("megatron", fused_eltwise=True, flash2_attention=True, loss_logit_bytes="a",
          loss_saves_fp32=False, tp_overlap=True, dp_overlap=True, fp8_fused_casts=True,
          fp8_saved_inputs=True, expert_group_stride_1=True, selective_modules=True,
          fa3_since=(("hopper", "2024-07"), ("blackwell", "2025-09")), tp_overlap_since="2023-05",
          tp_async_grad_since="2021-09",
          flash_attention_since="2023-01", tp_overlap_chunks=True,
          fp8_param_gather_since="2024-09", fp8_sp_gather=True,
          source="Megatron-Core / NeMo 2.0 / Megatron-Bridge with Transformer Engine: NeMo "
                 "performance recipes (tp_comm_overlap, overlap_grad_reduce, "
                 "overlap_param_gather, cross_entropy_loss_fusion), TE fused attention"),
    Stack("torchtitan", loss_logit_bytes="8", flash2_attention=True,
          cp_kv_exchange="allgather", sdpa_repeats_kv=True, zero3_pp_unsharded=True,
          fp8_sp_gather=True, fp8_shard_casts=True,
          source="torchtitan Dec 2024 (arXiv 2410.06511): eager blocks unless compiled, SDPA "
                 "(FlashAttention-2) on K/V repeated to every head, torch 2.5/2.6's "
                 "all-gather context parallelism, torchao Float8, FSDP2 prefetch, fp32 "
                 "cross-entropy"),
    Stack("deepspeed", zero3_recompute_gathers=3, flash_attention_since="2023-01",
          zero3_live_params=10**9,
          zero3_overlap=False, zero3_persist_numel=100_000, zero3_list_gather=True,
          source="DeepSpeed ZeRO-3 as compared in arXiv 2104.04473 Table 2 (Megatron kernels, "
                 "ZeRO-3 parameter hooks that re-gather for the recomputed forward, one "
                 "synchronous all-gather per parameter tensor: DeepSpeed issues #1069, #1174)"),
]}


@functools.lru_cache(maxsize=64)
def stack_of(name: str, release: str | None = None) -> Stack:
    """The switches of stack `name` as of `release` ("YYYY-MM"; None: the newest)."""
    return dataclasses.replace(STACKS[name], release=release)
