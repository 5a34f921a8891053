"""The seeded off-policy stability study: verl ``main_ppo`` over a grid of algorithms x regimes x seeds.

* :mod:`~sorl_verl.study.grid`: the grid YAML (``recipe/sorl/study/*.yaml``): named algorithms and
  regimes (hydra overrides; a regime may set its own steps, test_freq and val_max_samples), seeds,
  steps; expanded into cells.
* :mod:`~sorl_verl.study.metrics`: verl's metrics file (file logger) read into per-step series.
* :mod:`~sorl_verl.study.collapse`: the collapse rule, fixed before any run (pure function).
* :mod:`~sorl_verl.study.runner`: one cell = one ``python -m verl.trainer.main_ppo`` run, the way
  ``scripts/demo.sh`` runs it; resumable grid, one run directory per cell.
* :mod:`~sorl_verl.study.aggregate`: every cell -> ``stability.json`` and the markdown table.
* :mod:`~sorl_verl.study.plots`: one PNG per regime (mean and min-max band over seeds).
* :mod:`~sorl_verl.study.archive`: a grid's finished runs (``cell.json`` + ``metrics.jsonl``) in one
  ``.tar.xz``, what the repository keeps (``docs/results/study/<grid>.tar.xz``); aggregate reads it back.
* :mod:`~sorl_verl.study.cli`: ``python -m sorl_verl.study`` / ``sorl-verl study``.
"""
