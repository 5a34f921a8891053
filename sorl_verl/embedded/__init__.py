"""The embedded default's worlds, trajectories and builds (offline, CPU-sized).

``medical_world`` (synthetic medical knowledge world, multiple-choice questions),
``medical_trajectories`` (warm-start expert trajectories ending with an option letter) and
``medical_build`` (``ensure_embedded_medical``: world -> corpus -> BM25 index -> verl parquet ->
tokenizer -> warm-started tiny model, cached under ``$SORL_HOME/embedded_medical``).
"""
