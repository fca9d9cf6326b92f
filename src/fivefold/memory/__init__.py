"""Memory techniques: activation accounting, checkpointing, offload, LOMO, GaLore."""
