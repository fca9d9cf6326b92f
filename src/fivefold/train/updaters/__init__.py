"""One update path: an updater per update rule, chosen once from `ParallelPlan.update`
(`choose.build_updater`).

The trainer's step is the same loop for every rule (fivefold.train.trainer): each
micro-batch's passes around `prepare_backward` / `backward` / `after_backward`, the loss
summed over the token axes, then `update(lr, clip, keep)`. What differs, who owns the
gradients and the optimizer state, and when the update happens, is the updater's
(fivefold.train.updaters.base): the data-parallel engine (`engine`), data-parallel GaLore
(`galore`), torch's optimizer on one plain rank, LOMO and PipeDream-2BW's stages (`plain`).
fp16 loss scaling (fivefold.train.loss_scale) is part of the shared clipped update, so every
rule but LOMO and PipeDream-2BW has it.
"""
