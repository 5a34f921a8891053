"""Loopback only: on the CPU platform a Ray instance started the way verl's ``main_ppo`` starts it
registers its node on 127.0.0.1 and every Ray process listens on loopback; the retrieval server's
default bind address is loopback too. Checked with Ray's own view (``ray.nodes()``) and the
kernel's (the listening sockets of the whole process tree, via psutil)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

LOOPBACK_ADDRESSES = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

RAY_PROBE = textwrap.dedent(
    """
    import json, os, psutil, ray
    import verl  # loads the sorl_verl plugin: on the CPU platform it keeps Ray on loopback
    from omegaconf import OmegaConf
    cpu = OmegaConf.load("recipe/sorl/config/platform/cpu.yaml")
    ray_init = OmegaConf.to_container(cpu.ray_kwargs.ray_init)
    ray_init.update(num_cpus=2)  # verl merges its runtime env into the same kwargs
    ray.init(**ray_init)

    @ray.remote(num_cpus=1)
    class Probe:
        def address(self):
            return ray.util.get_node_ip_address(), os.environ.get("PYTHONHASHSEED")

    probe = Probe.remote()
    actor_ip, hash_seed = ray.get(probe.address.remote())
    me = psutil.Process()
    listening = set()
    for proc in [me, *me.children(recursive=True)]:
        try:
            listening |= {(c.laddr.ip, c.laddr.port, proc.name()) for c in proc.net_connections("tcp")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    print(json.dumps({"nodes": [n["NodeManagerAddress"] for n in ray.nodes()], "actor_ip": actor_ip,
                      "gcs": ray.get_runtime_context().gcs_address, "hash_seed": hash_seed,
                      "listening": sorted(listening)}))
    ray.shutdown()
    """
)


@pytest.mark.slow
def test_ray_node_and_every_ray_listener_are_on_loopback():
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the default, not a value inherited from the shell
    env.pop("RAY_ADDRESS", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", RAY_PROBE], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["nodes"] == ["127.0.0.1"]
    assert out["actor_ip"] == "127.0.0.1"
    assert out["gcs"].rsplit(":", 1)[0] == "127.0.0.1"
    assert out["hash_seed"] == "0"  # platform/cpu.yaml's runtime env reaches Ray's workers
    assert {name for _, _, name in out["listening"]} >= {"gcs_server", "raylet"}
    exposed = [s for s in out["listening"] if s[0] not in LOOPBACK_ADDRESSES]
    assert not exposed, f"Ray listens beyond loopback: {exposed}"


def test_retrieval_server_binds_loopback_by_default(tmp_path):
    """Any index will do (the bind address is the server's): a three-document BM25 index, not the
    embedded default, whose first build (the warm-start SFT, minutes) this test would otherwise wait for."""
    from sorl_verl.retrieval.build import build_index
    from sorl_verl.retrieval.server import serve_in_background

    corpus = tmp_path / "corpus.jsonl"
    docs = [("Paris", "Paris is the capital of France."), ("Rome", "Rome is the capital of Italy."),
            ("Oslo", "Oslo is the capital of Norway.")]  # fmt: skip
    corpus.write_text(
        "".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{x}'}) + "\n" for i, (t, x) in enumerate(docs))
    )
    index = build_index(corpus, tmp_path / "index", show_progress=False)
    with serve_in_background(index) as server:
        listening = {
            c.laddr
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == int(server.url.rsplit(":", 1)[1])
        }
    assert listening and {addr.ip for addr in listening} <= LOOPBACK_ADDRESSES
