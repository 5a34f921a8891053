"""The embedded defaults: offline, CPU-sized worlds, tokenizer, tiny model, warm-start and builds of both tasks.

``world`` (what the worlds share), ``qa_world`` / ``medical_world`` (the synthetic multi-hop QA and
medical multiple-choice worlds), ``tokenizer``, ``tiny_model`` (the one tiny-Qwen2 builder, also of
the tests' random models), ``warmstart`` (expert search trajectories, SFT, rollout evaluation),
``qa_trajectories`` / ``medical_trajectories``, ``steps`` (stamped atomic build steps),
``qa_build`` (``ensure_embedded_default``, ``$SORL_HOME/embedded``) / ``medical_build``
(``ensure_embedded_medical``, ``$SORL_HOME/embedded_medical``) and ``demo_paths`` (what a
``main_ppo`` launch of a task needs). docs/embedded-default.md describes both.
"""
