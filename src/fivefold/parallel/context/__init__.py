"""Context parallelism: every sequence split over the cp ranks, attention computed across them.

Three modes, one file each: Ulysses (all-to-all to head shards, .ulysses), ring attention
(key/value blocks around a ring, zigzag-balanced, hand-written ring backward, .ring_attention)
and their 2D hybrid (.hybrid). `attention.context_attention` is the one entry the model's
attention seam calls (installed by fivefold.parallel.parallelize); `layout.context_positions`
says which tokens each rank holds (the trainer's samplers hand it those). Ring and Ulysses
train (`parallel.cp`, `parallel.cp_mode`); the hybrid is tested on its own but not in the
runtime yet (docs/context_parallel.md).
"""
