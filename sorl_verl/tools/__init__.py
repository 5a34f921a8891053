"""User tools behind ``sorl-verl`` subcommands that are not part of another subpackage:
``eval`` (EM/F1 tables from verl validation metrics, generations, or a slow HF fallback),
``plot`` (training-health curves) and ``demo`` (the CPU main job of a source checkout)."""
