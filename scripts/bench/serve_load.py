"""Load-generation helpers for the serving benchmarks: CPU pinning and a ``wrk`` load generator.

- :func:`parse_cpus`, :func:`pin_process`, :func:`spawn_affinity`, :func:`task_affinity`: give a
  server process and the load generator cores of their own (Linux ``sched_setaffinity``).
- :func:`run_wrk`: a closed loop of ``connections`` keep-alive connections posting single-query
  JSON bodies with ``wrk`` (a C load generator; far less client CPU per request than Python
  coroutines). ``wrk`` is optional: :func:`wrk_path` says whether it is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WRK_TAG = "WRK_JSON "

# Lua for wrk: cycle through the bodies; ``done`` prints one JSON line (latencies in microseconds).
_LUA_TEMPLATE = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {
%s
}
local n = #bodies
local i = 0
request = function()
  i = i %% n + 1
  return wrk.format(nil, "%s", nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('%s{"requests": %%d, "duration_us": %%d, "bytes": %%d, '
    .. '"errors": {"connect": %%d, "read": %%d, "write": %%d, "status": %%d, "timeout": %%d}, '
    .. '"p50_us": %%d, "p99_us": %%d, "mean_us": %%.1f, "max_us": %%d}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean, latency.max))
end
"""


def parse_cpus(spec: str | None) -> set[int] | None:
    """``"0"``, ``"0,2"``, ``"0-3,6"`` -> a set of CPU numbers; ``None``/``""`` -> None (no pinning)."""
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"bad CPU list {spec!r} (expected e.g. 0 or 0,1 or 0-3)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process to ``cpus`` (threads and processes started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def spawn_affinity(cpus: set[int] | None) -> Iterator[None]:
    """Run the body with the calling thread pinned to ``cpus``, so a process it starts inherits them."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def task_affinity(pid: int) -> dict[str, Any]:
    """Threads of process ``pid`` and the distinct CPU lists they may run on (from /proc)."""
    lists: set[str] = set()
    tasks = os.listdir(f"/proc/{pid}/task")
    for tid in tasks:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    lists.add(line.split(":", 1)[1].strip())
    return {"threads": len(tasks), "cpus_allowed": sorted(lists)}


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_simd(cpuinfo: str | None = None) -> list[str]:
    """Which of the vector extensions that faiss/torch kernels use the CPU has (``/proc/cpuinfo`` flags).

    ``cpuinfo``: that file's text (default: read it; [] when unreadable). The model name with the
    widest extension is :func:`sorl_verl.study.runner.cpu_name`.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [f for f in SIMD_FLAGS if f in flags]
    return []


def wait_idle(cpu_s: Any, interval: float = 0.3, busy_share: float = 0.05, timeout: float = 120.0) -> float:
    """Block until a process is idle: ``cpu_s()`` (its CPU seconds) grows by < ``busy_share`` of an interval.

    After a closed-loop load generator stops, a server may still owe the answers to the
    requests that were in flight (64 of them at 32 ms each is 2 s of work); a measurement that
    starts before they are done charges them to the next run. Returns the seconds waited;
    raises ``TimeoutError`` after ``timeout``.
    """
    t0 = time.perf_counter()
    last = cpu_s()
    while True:
        time.sleep(interval)
        now = cpu_s()
        if now - last < busy_share * interval:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"process still busy after {timeout:g} s ({now - last:.2f} CPU s in {interval:g} s)")
        last = now


def wrk_path() -> str | None:
    """Path of the ``wrk`` executable, or None when it is not installed."""
    return shutil.which("wrk")


def _lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def lua_script(bodies: list[str], path: str = "/retrieve") -> str:
    """The wrk Lua script posting ``bodies`` (JSON texts) in turn to ``path`` and printing a JSON summary."""
    if not bodies:
        raise ValueError("no request bodies")
    return _LUA_TEMPLATE % (",\n".join(_lua_string(b) for b in bodies), path, WRK_TAG)


def parse_wrk_output(text: str) -> dict[str, Any]:
    """The summary printed by :func:`lua_script`'s ``done`` (the last ``WRK_JSON`` line), with q/s and ms."""
    lines = [line for line in text.splitlines() if line.startswith(WRK_TAG)]
    if not lines:
        raise ValueError(f"no {WRK_TAG.strip()} line in wrk output:\n{text[-2000:]}")
    s = json.loads(lines[-1][len(WRK_TAG) :])
    if s["duration_us"] <= 0:
        raise ValueError(f"wrk reported a duration of {s['duration_us']} us")
    s["qps"] = s["requests"] / (s["duration_us"] / 1e6)
    s["p50_ms"], s["p99_ms"] = s["p50_us"] / 1000, s["p99_us"] / 1000
    return s


def run_wrk(url: str, bodies: list[str], connections: int, seconds: float, timeout_s: float = 30.0) -> dict[str, Any]:
    """A closed loop of ``connections`` connections (one wrk thread) for ``seconds``: q/s, latency, wrk's CPU.

    ``client_cpu_s``: user + system CPU of the wrk process (from the children's rusage, taken
    around this run only); ``client_cpu_share``: that over the run's wall time (1.0 = one core
    busy). Raises if wrk is missing or any request failed.
    """
    exe = wrk_path()
    if exe is None:
        raise FileNotFoundError("wrk is not installed (Debian/Ubuntu: apt-get install wrk)")
    with tempfile.TemporaryDirectory(prefix="sorl-wrk-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(lua_script(bodies))
        cmd = [exe, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", f"--timeout={timeout_s:g}s",
               "-s", str(script), url]  # fmt: skip
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + timeout_s + 30)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}: {proc.stderr[-2000:]}{proc.stdout[-2000:]}")
    s = parse_wrk_output(proc.stdout)
    if any(s["errors"].values()):
        raise RuntimeError(f"wrk saw failed requests: {s['errors']}\n{proc.stdout[-2000:]}")
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"clients": connections, "requests": s["requests"], "qps": s["qps"], "p50_ms": s["p50_ms"],
            "p99_ms": s["p99_ms"], "wall_s": s["duration_us"] / 1e6, "client_cpu_s": cpu,
            "client_cpu_share": cpu / wall, "load_generator": "wrk"}  # fmt: skip
