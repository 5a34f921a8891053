"""CPU platform, CPU engine registration, the pinned gloo wrapper, and the ChatML alias."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sorl_verl.cpu.platform import PlatformCPU, cpu_platform_selected


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=300)


def test_platform_answers():
    p = PlatformCPU()
    assert (p.device_name, p.vendor_name, p.communication_backend_name()) == ("cpu", "cpu", "gloo")
    assert p.current_device() == "cpu"  # verl calls .to(device=get_device_id()); an int would mean cuda:<int>
    assert p.ray_resource_name() == "GPU" and p.ray_resource_options(0.5) == {"num_gpus": 0.5}
    assert p.get_device_capability() == (None, None)
    assert p.is_available() and not p.is_ipc_supported()
    mod = p.device_module
    assert mod.memory_allocated() == 0 and mod.max_memory_reserved() == 0
    mod.manual_seed(3)
    a = mod.get_rng_state()
    import torch

    x = torch.rand(3)
    mod.set_rng_state(a)
    assert torch.equal(torch.rand(3), x)
    with p.nvtx_range("x"):
        pass


def test_selection_follows_verl_platform_only(monkeypatch):
    """CPU mode only when asked for: a process without an accelerator (this one) and without
    ``VERL_PLATFORM`` is not on the CPU platform (a GPU cluster's CPU-only driver or head node)."""
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert cpu_platform_selected() and PlatformCPU().is_platform_available()
    monkeypatch.setenv("VERL_PLATFORM", "nvidia")
    assert not cpu_platform_selected()
    monkeypatch.delenv("VERL_PLATFORM")
    assert not cpu_platform_selected()
    assert not PlatformCPU().is_platform_available()  # verl's auto-detection never picks it


def test_a_process_without_accelerator_and_without_verl_platform_gets_nothing_cpu_specific():
    """verl's driver on a CPU-only head node: no CPU wrappers or engines, Ray not bound to loopback,
    verl's own platform choice (its fallback), not the CPU platform."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(
            """
            import json, os, verl, sorl_verl.plugin as plugin
            from verl.plugin.platform.platform_manager import _detect_platform_name
            print(json.dumps({"registered": sorted(plugin.REGISTERED), "platform": _detect_platform_name(),
                              "ray_cluster_env": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}))
            """
        )],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "cpu_wrappers" not in out["registered"] and "EngineRegistry" not in out["registered"]
    assert out["platform"] != "cpu"
    assert out["ray_cluster_env"] is None


def test_the_cpu_overlays_device_without_verl_platform_fails_at_start_up_naming_it(monkeypatch):
    """``trainer.device=cpu`` (what ``+platform=cpu`` sets) in a process not on the CPU platform would
    run verl's CUDA paths on a machine without one: the SORL trainers stop before any worker."""
    from hydra import compose, initialize_config_dir

    from sorl_verl.trainer.trainers import SORLTrainerSync

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    config_dir = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(
            config_name="sorl_trainer",
            overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.device=cpu"],
        )
    with pytest.raises(ValueError, match="trainer.device=cpu.*VERL_PLATFORM=cpu"):
        SORLTrainerSync(config)


def test_verl_on_cpu_platform_inits_gloo_and_finds_fsdp_engines():
    """In a fresh process: verl resolves the CPU platform, its FSDP engines and a gloo process group."""
    r = run_py(
        """
        import json, socket
        import verl, sorl_verl.plugin as plugin
        from verl.utils.device import get_device_name, get_nccl_backend, get_device_id
        from verl.workers.engine import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
        import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
        import verl.workers.engine_workers as ew
        import torch.distributed as dist
        import psutil
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        ew.initialize_global_process_group_ray(timeout_second=None)
        print(json.dumps({
            "device": get_device_name(), "backend": get_nccl_backend(), "device_id": get_device_id(),
            "lm": EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead,
            "value": EngineRegistry.get_engine_cls("value_model", "fsdp") is FSDPEngineWithValueHead,
            "pg_backend": dist.get_backend(), "errors": plugin.ERRORS,
            "wrappers": plugin.REGISTERED.get("cpu_wrappers"),
            "ref_pinned": fsdp_engine.CPUOffloadPolicy(pin_memory=True).pin_memory,
            "listening": sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}),
        }))
        """,
        VERL_PLATFORM="cpu",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["backend"] == "gloo" and out["device_id"] == "cpu"
    assert out["lm"] and out["value"]
    assert out["pg_backend"] == "gloo"
    # the rendezvous store listens on MASTER_ADDR only (torch's env:// store would listen on "::")
    assert out["listening"] == ["127.0.0.1"]
    assert out["errors"] == {}
    assert out["wrappers"] == ["verl.utils.distributed.initialize_global_process_group_ray",
                               "verl.utils.model.load_valuehead_model",
                               "verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy",
                               "verl.workers.engine.fsdp.transformer_impl.FSDP",
                               "verl.workers.engine.fsdp.transformer_impl.load_fsdp_model_to_gpu"]
    # the reference model's offload policy no longer pins host memory (that needs an accelerator)
    assert out["ref_pinned"] is False


def test_nothing_cpu_specific_when_another_platform_is_chosen():
    r = run_py(
        """
        import json, verl, sorl_verl.plugin as plugin
        import verl.utils.distributed as d
        import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
        from verl.workers.engine import EngineRegistry
        print(json.dumps({"registered": sorted(plugin.REGISTERED),
                          "wrapped": getattr(d.initialize_global_process_group_ray, "__sorl_cpu_wrapped__", False),
                          "ref_pinned": fsdp_engine.CPUOffloadPolicy().pin_memory,
                          "cpu_engine": "cpu" in EngineRegistry._engines["language_model"]["fsdp2"]}))
        """,
        VERL_PLATFORM="nvidia",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "cpu_wrappers" not in out["registered"] and "EngineRegistry" not in out["registered"]
    assert "PlatformRegistry" in out["registered"] and "RolloutReplicaRegistry" in out["registered"]
    assert not out["wrapped"] and not out["cpu_engine"] and out["ref_pinned"] is True


def test_wrappers_refuse_an_unchecked_verl(monkeypatch):
    import verl

    from sorl_verl.cpu import verl_compat

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.raises(RuntimeError, match="0.10.0"):
        verl_compat.apply_cpu_wrappers()


def _tokenizer_dir(tmp: Path, eos: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["search the answer\nof the city"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|pad|>", eos, "<|user|>", "<|assistant|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|pad|>")
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                       "{% else %}<|assistant|>{{ m['content'] }}" + eos + "{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    out = tmp / "model"
    t.save_pretrained(out)
    (out / "model.safetensors").write_bytes(b"weights")
    return out


def test_chatml_alias_renames_eos_keeping_ids(tmp_path):
    from transformers import AutoTokenizer

    from sorl_verl.cpu.chatml_alias import CHATML_EOS, chatml_alias

    src = _tokenizer_dir(tmp_path, "<|end|>")
    dst = chatml_alias(src)
    assert dst != src and (dst / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    a, b = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(dst)
    assert b.eos_token == CHATML_EOS and b.convert_tokens_to_ids(CHATML_EOS) == a.eos_token_id
    msgs = [{"role": "user", "content": "search the city"}, {"role": "assistant", "content": "the answer"}]
    ids_a = a.apply_chat_template(msgs, tokenize=True)
    ids_b = b.apply_chat_template(msgs, tokenize=True)
    ids_a = ids_a["input_ids"] if isinstance(ids_a, dict) or hasattr(ids_a, "keys") else ids_a
    ids_b = ids_b["input_ids"] if isinstance(ids_b, dict) or hasattr(ids_b, "keys") else ids_b
    assert ids_a == ids_b and ids_b[-1] == a.eos_token_id
    assert chatml_alias(src) == dst  # reused
    assert chatml_alias(dst) == dst  # already ChatML: returned as is


def test_chatml_alias_keeps_a_chatml_model(tmp_path):
    from sorl_verl.cpu.chatml_alias import chatml_alias

    src = _tokenizer_dir(tmp_path, "<|im_end|>")
    assert chatml_alias(src) == src.resolve()
