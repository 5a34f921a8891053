"""The ``hf`` rollout's device option (``engine_kwargs.hf.device``): validated at construction, the CPU
path keeps the model where it is, and asking for CUDA where there is none fails before any model loads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode

from sorl_verl.cpu.hf_engine import HFGenerationEngine
from sorl_verl.cpu.hf_rollout import HFServer, engine_device
from sorl_verl.embedded.tiny_model import write_random_model


def config(device=None) -> RolloutConfig:
    hf = {} if device is None else {"device": device}
    return RolloutConfig(name="hf", prompt_length=16, response_length=8, dtype="float32", engine_kwargs={"hf": hf})


def test_device_defaults_to_cpu_and_accepts_cuda_devices():
    assert engine_device(config()) == "cpu"
    assert engine_device(config("cuda")) == "cuda"
    assert engine_device(config("cuda:1")) == "cuda:1"


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_other_devices_are_refused_by_name(device):
    with pytest.raises(ValueError, match=f"engine_kwargs.hf.device.*{device}"):
        engine_device(config(device))


def test_cpu_engine_keeps_the_model_s_own_parameters(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(write_random_model(tmp_path), dtype=torch.float32)
    pointers = [p.data_ptr() for p in model.parameters()]
    engine = HFGenerationEngine(model, max_model_len=64)
    assert engine.device == torch.device("cpu") and engine.model is model
    assert [p.data_ptr() for p in engine.model.parameters()] == pointers  # no copy on the CPU path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
async def test_cuda_without_a_gpu_fails_before_loading(tmp_path):
    server = HFServer(config("cuda"), HFModelConfig(path=str(write_random_model(tmp_path))), RolloutMode.HYBRID)
    with pytest.raises(RuntimeError, match="device='cuda'.*no CUDA device"):
        await server.launch_server()
    assert server.engine is None
