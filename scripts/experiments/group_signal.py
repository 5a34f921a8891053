"""How much GRPO signal the embedded default's warm-start gives at a sampling temperature.

GRPO learns only from groups whose episodes disagree: a group of G episodes of one prompt with all
rewards equal has zero advantage everywhere. For a prompt the policy solves with probability p, the
chance that a group of G is informative is ``1 - p^G - (1 - p)^G``. This script samples ``--samples``
episodes per training question at each ``--temperatures`` value with the project's own multi-turn
rollout (retrieval in the loop, as the build's evaluation does), estimates p per question and prints,
per temperature and hop count: mean success, and the expected share of informative groups of
``--group`` episodes (unbiased: the probability that G of the question's samples drawn without
replacement disagree), and the searches per episode (the decision the ``early-stop`` warm-start leaves to RL
is a second search on multi-hop questions: ``searched_again`` is the share of episodes with >= 2 searches).
``--warmstart NAME`` reads the named warm-start's root (``embedded-<name>``). Writes the numbers as JSON with ``--out``.

    python scripts/experiments/group_signal.py --per-hop 24 --samples 8 --temperatures 1.0 1.3 1.6 --group 4
    python scripts/experiments/group_signal.py --warmstart early-stop --per-hop 32 --samples 8 --temperatures 1.0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch


def informative_share(successes: int, n: int, group: int) -> float:
    """P(a group of ``group`` drawn without replacement from n samples with k successes is mixed)."""
    if n < group:
        raise ValueError(f"need at least {group} samples per question, got {n}")
    total = math.comb(n, group)
    return 1.0 - (math.comb(successes, group) + math.comb(n - successes, group)) / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-hop", type=int, default=24, help="training questions per hop count")
    ap.add_argument("--samples", type=int, default=8, help="episodes per question and temperature")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 1.3, 1.6])
    ap.add_argument("--group", type=int, default=4, help="GRPO group size (rollout.n)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    ap.add_argument("--warmstart", default="expert", help="named warm-start of the QA embedded default")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sorl_verl.agent.prompts import SEARCH_OPEN
    from sorl_verl.embedded.qa_build import default_root
    from sorl_verl.embedded.warmstart import greedy_rollouts, make_observer
    from sorl_verl.rewards.score import compute_score

    home = default_root(a.warmstart)
    if not (home / "model").is_dir():
        print(f"no embedded default under {home}: run `sorl-verl demo` or the test suite once", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(home / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(home / "model", torch_dtype=torch.float32).eval()
    observe = make_observer(home / "index")
    rows = [json.loads(line) for line in (home / "world" / f"{a.split}.jsonl").read_text().splitlines()]
    hops = sorted({q["hops"] for q in rows})
    questions = [q for k in hops for q in [q for q in rows if q["hops"] == k][: a.per_hop]]

    result: dict[str, Any] = {"warmstart": a.warmstart, "root": str(home), "per_hop": a.per_hop, "samples": a.samples, "group": a.group, "split": a.split,
                              "temperatures": {}}  # fmt: skip
    print(f"{len(questions)} {a.split} questions x {a.samples} samples; informative = group of {a.group} not all equal")
    print(
        "| T | hops | mean success | informative groups | questions never solved | always solved | searches per episode | searched again |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for temp in a.temperatures:
        torch.manual_seed(a.seed)
        t0 = time.perf_counter()
        batch = [q for q in questions for _ in range(a.samples)]
        with torch.no_grad():
            responses = greedy_rollouts(model, tok, batch, observe, temperature=temp)
        em = [compute_score(f"synthetic_{q['hops']}hop", r, {"target": q["golden_answers"]})["em"]
              for q, r in zip(batch, responses, strict=True)]  # fmt: skip
        searches = [r.count(SEARCH_OPEN) for r in responses]
        per_q = [sum(em[i * a.samples : (i + 1) * a.samples]) for i in range(len(questions))]
        stats: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1)}
        for k in [*hops, "all"]:
            idx = [i for i, q in enumerate(questions) if k == "all" or q["hops"] == k]
            succ = [per_q[i] for i in idx]
            s = {
                "mean_success": sum(succ) / (len(idx) * a.samples),
                "informative": sum(informative_share(int(c), a.samples, a.group) for c in succ) / len(idx),
                "never": sum(c == 0 for c in succ) / len(idx),
                "always": sum(c == a.samples for c in succ) / len(idx),
                "searches": sum(searches[i * a.samples + j] for i in idx for j in range(a.samples))
                / (len(idx) * a.samples),
                "searched_again": sum(searches[i * a.samples + j] >= 2 for i in idx for j in range(a.samples))
                / (len(idx) * a.samples),
            }
            stats[str(k)] = s
            print(f"| {temp} | {k} | {s['mean_success']:.3f} | {s['informative']:.3f} | {s['never']:.2f} | {s['always']:.2f} | {s['searches']:.2f} | {s['searched_again']:.3f} |",
                  flush=True)  # fmt: skip
        result["temperatures"][str(temp)] = stats
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
