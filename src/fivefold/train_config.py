"""The `[train]` section of a config: optimizer, learning-rate schedule, the training loop's
cadences (evaluation, checkpoints, logging), device and the software stack planned for.
fivefold.config assembles the sections, and fivefold.validate checks these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config_fields import doc_field as _doc


@dataclass
class TrainConfig:
    optimizer: str = _doc('"adamw" | "muon" (Muon on the blocks\' matrices and stacked '
                          'experts, AdamW on the rest; every data, tensor, pipeline and expert '
                          'layout) | "galore" (low-rank Adam on the blocks\' matrices; data, '
                          'tensor and pipeline parallel, ZeRO 0-3) | "sgd" | "lomo" (SGD '
                          'fused into backward; data parallel, zero_stage 0-2)', "adamw")
    seed: int = _doc("seed for initialization, data order and sampling", 0)
    steps: int = _doc("total optimizer steps (the schedule's length); --steps sets it", 200)
    lr: float = _doc("peak learning rate", 1e-3)
    lr_schedule: str = _doc('after warm-up: "cosine" | "linear" decay to the floor | '
                            '"constant" | "wsd" (warmup-stable-decay; fivefold.lr_schedule)',
                            "cosine")
    min_lr_ratio: float = _doc("final learning rate as a fraction of lr (the decay's floor)",
                               0.1)
    warmup_steps: int | None = _doc("linear warm-up steps; absent: min(20, steps // 10)", None)
    decay_fraction: float = _doc("wsd: the share of the steps, at the end, that decay", 0.1)
    decay_shape: str = _doc('wsd: the decay\'s shape "linear" | "cosine" | "sqrt" '
                            "(1 - sqrt of its progress)", "sqrt")
    weight_decay: float = _doc("AdamW decoupled weight decay (matrices only)", 0.1)
    beta1: float = _doc("AdamW beta1 / SGD momentum", 0.9)
    muon_momentum: float = _doc("Muon's (Nesterov) momentum on the blocks' matrices", 0.95)
    galore_update_gap: int = _doc("GaLore: steps between refreshes of each matrix's gradient "
                                  "subspace (its rank is a quarter of the smaller side)", 200)
    galore_scale: float = _doc("GaLore: scale of the projected-back update", 0.25)
    galore_svd: str = _doc('GaLore: the subspace refresh by "exact" SVD or "randomized" SVD '
                           "(GaLore 2, arXiv 2504.20437: cheaper on large matrices)", "exact")
    galore_reduce: str = _doc('GaLore with data parallelism alone (ZeRO 0-2): what the ranks '
                              'reduce on steps without a subspace refresh, the "full" gradient '
                              'or its "projected" one (a quarter of each matrix\'s bytes; needs '
                              'grad_clip = 0, and grad_norm is then the projected one\'s)',
                              "full")
    beta2: float = _doc("AdamW beta2", 0.95)
    eps: float = _doc("AdamW epsilon", 1e-8)
    grad_clip: float = _doc("clip the global gradient norm to this; 0 disables", 1.0)
    eval_every: int = _doc("validation every this many steps (and at the end)", 50)
    eval_batches: int = _doc("global batches per validation pass", 4)
    checkpoint_every: int = _doc("checkpoint every this many steps (and at the end)", 100)
    checkpoint_minutes: float | None = _doc("also checkpoint once this many minutes of training"
                                            " have passed since the last save (rank 0's clock,"
                                            " broadcast: every rank saves at the same step); "
                                            "absent = by steps only", None)
    keep_checkpoints: int = _doc("most recent checkpoints kept on disk", 2)
    reset_data: bool = _doc("resuming from a checkpoint written with other data keys (data.*, "
                            "train.seed): keep its weights and optimizer state and start the "
                            "data order afresh, instead of refusing", False)
    log_every: int = _doc("print a progress line every this many steps", 10)
    sample_tokens: int = _doc("tokens of text sampled at the end; 0 disables", 64)
    device: str = _doc('"auto" (cuda if available) | "cpu" | "cuda"', "auto")
    compile: bool = _doc("torch.compile each transformer block", False)
    timeout_s: float = _doc("collective timeout; a hung rank fails after this, and each rank "
                            "writes RUN_DIR/flight_recorder/rank_R.json", 600.0)
    on_nonfinite: str = _doc('a step whose loss or global gradient norm is NaN or infinite: '
                             '"stop" (raise, naming the step and the first parameter with a '
                             'non-finite gradient) | "skip" (drop its update, counted as '
                             'skipped_steps in the metrics); not with PipeDream-2BW, nor LOMO '
                             'without grad_clip', "stop")
    tensorboard: bool = _doc("write TensorBoard event files to RUN_DIR/tb", True)
    preflight: bool = _doc("before any rank starts, refuse a run whose predicted memory "
                           "exceeds this machine's (fivefold.preflight)", True)
    stack: str = _doc('the software stack the step runs on: "fivefold" (this runtime; the only '
                      'one `fivefold train` runs) | "megatron" (Megatron-Core / NeMo / '
                      'Megatron-Bridge) | "torchtitan" | "deepspeed"; plan and simulate '
                      'predict with its switches (docs/planner.md, "Software stacks")',
                      "fivefold")
    stack_release: str | None = _doc('the release of that stack, "YYYY-MM" (its container or '
                                     'version date): which attention kernel it runs '
                                     '(docs/planner.md, "Software stacks"); absent = its '
                                     'newest; not with "fivefold"', None)
