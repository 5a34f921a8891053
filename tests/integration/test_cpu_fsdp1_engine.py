"""verl's FSDP1 engine (``strategy=fsdp``) built on the CPU platform over two gloo ranks.

A random tiny Qwen2 with untied embeddings, so that verl builds it on the meta device on rank 1 and
rank 1 gets its weights only from the broadcast that ``sync_module_states`` stands for
(``sorl_verl.cpu.verl_compat._host_fsdp1``). On each rank verl's own ``FSDPEngineWithLMHead`` is
initialized as the actor (trainable) and as the forward-only reference model (verl asks FSDP1 for
parameter CPU offload there), and its weight export to the rollout (``get_per_tensor_param``, which
first "loads the model to the GPU": ``_host_flat_params``) must give the saved weights exactly.
"""

from __future__ import annotations

import pytest

#: each rank: argv = rank, world, port, model dir (conftest.gloo_ranks)
RANK_SCRIPT = """
import os, sys
os.environ["VERL_PLATFORM"] = "cpu"
import json, torch, torch.distributed as dist
import verl  # loads the sorl_verl plugin: the CPU platform, its engines and wrappers
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from verl.utils.fsdp_utils import fsdp_version
from verl.trainer.config import CheckpointConfig
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

rank, world, port, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
saved = load_file(os.path.join(model_dir, "model.safetensors"))
fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
result = {}
for role, forward_only in (("actor", False), ("ref", True)):
    engine = FSDPEngineWithLMHead(
        HFModelConfig(path=model_dir, override_config={"attn_implementation": "sdpa"}, use_remove_padding=False),
        FSDPEngineConfig(strategy="fsdp", forward_only=forward_only, mixed_precision=fp32, use_torch_compile=False),
        FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        CheckpointConfig(),
    )
    engine.initialize()
    params, _ = engine.get_per_tensor_param()
    exported = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float() for n, p in params}
    result[role] = {
        "fsdp_version": fsdp_version(engine.module),
        "names": sorted(exported) == sorted(saved),
        "max_abs_diff": max(float((exported[n] - saved[n].float()).abs().max()) for n in saved),
    }
finish("RESULT" + json.dumps(result))
"""


@pytest.mark.slow  # two ranks, each builds the engine twice: ~30 s on 2 cores
def test_verl_fsdp1_engine_builds_on_cpu_and_exports_rank0_weights(tmp_path, gloo_ranks):
    from sorl_verl.embedded.tiny_model import write_random_model

    model_dir = write_random_model(tmp_path / "model", tie_word_embeddings=False)
    for rank, result in enumerate(gloo_ranks(RANK_SCRIPT, 2, str(model_dir))):
        for role in ("actor", "ref"):
            got = result[role]
            assert got["fsdp_version"] == 1, (rank, role, got)
            assert got["names"], (rank, role)
            # fp32 weights copied and gathered, never computed on: equal bit for bit
            assert got["max_abs_diff"] == 0.0, (rank, role, got)
