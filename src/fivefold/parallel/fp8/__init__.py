"""FP8 training of the blocks' linear layers, real (torch._scaled_mm) or emulated in fp32.

formats.py  the e4m3 / e5m2 (and bf16) number formats and their rounding, written out
scaling.py  amax-based scales, tensorwise or rowwise, agreed over the tp ranks of a shard
linear.py   the fp8 linear (an autograd function) and `apply_fp8`, which parallelize calls
experts.py  MoE layers: the experts' GEMMs and the shared experts in fp8, the router not
recipe.py   the recipe as data (torch-free): which tensors are fp8, which GEMMs run in fp8
"""
