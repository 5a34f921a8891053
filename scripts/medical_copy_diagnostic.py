"""Teacher-forced accuracy of a medical warm-start at each step of its option lookup.

Usage: ``python scripts/medical_copy_diagnostic.py BUILD_ROOT [--n 60] [--drills] [--checks STYLE]`` (a
build made with ``MedicalEmbeddedConfig(checks="block", letter_tokens=True)``, or with
``checks="tag"`` / ``"gold_line"`` and the same ``--checks``). For the first ``n`` train and
val questions it feeds the expert trajectory (with ``--drills`` also the option drill of the same
question and options, ``medical_trajectories.drill_segments``, in the ``gold_line`` form for ``--checks gold_line``) and counts the greedy next-token
hits, per position kind:

- ``first_after_marker``: the first token of an option text after its marker ``\\nL.`` (the lookup
  through the marker into the prompt);
- ``rest_of_text``: the option text's other tokens;
- ``marker_or_stop``: the token after an option text (the next marker, or `` yes`` at the gold line);
- ``answer_letter``: the letter inside ``<answer>``;
- ``before_block``: every other policy token before the block (searches, facts; in a drill, its
  ``The answer is X.`` line).

With ``--checks tag`` or ``--checks gold_line`` the kinds are ``decision`` (the letter in ``(L)`` after
the answer's name, or the marker ``\\nL.`` of the answer's line: the reverse lookup), ``answer_letter``
and ``before_decision`` (every other policy token up to the answer letter).

Prints one line per split (and kind of example) as JSON, then one line ``embeddings``: the mean
pairwise cosine of the input embeddings of the bare letters ``A``..``E``, of `` A``..`` E`` and of the
markers ``\\nA.``..``\\nE.`` where each is one token (near 1: the model cannot tell them apart).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def copy_accuracy(model, tok, examples, questions) -> dict[str, list[int]]:
    """``{kind: [hits, count]}`` over the examples' policy tokens (module docstring)."""
    import torch

    from sorl_verl.embedded.medical_trajectories import OPTION_MARKERS

    markers = {tok.convert_tokens_to_ids(m) for m in OPTION_MARKERS}
    yes = tok(" yes.", add_special_tokens=False)["input_ids"]
    stats = {k: [0, 0] for k in ("first_after_marker", "rest_of_text", "marker_or_stop", "answer_letter", "before_block")}
    for q, (ids, mask) in zip(questions, examples, strict=True):
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        hit = [int(pred[t - 1] == ids[t]) for t in range(1, len(ids))]
        start = min(t for t in range(len(ids)) if ids[t] in markers and mask[t])  # the block's first marker
        stop = max(t for t in range(len(ids)) if ids[t : t + len(yes)] == yes)  # " yes." at the gold line
        letter = next(t for t in range(stop, len(ids)) if mask[t] and tok.decode([ids[t]]).strip() == q["answer_idx"])
        for t in range(1, len(ids)):
            if not mask[t]:
                continue
            if t < start:
                kind = "before_block"
            elif t == letter:
                kind = "answer_letter"
            elif start < t <= stop and ids[t - 1] in markers:
                kind = "first_after_marker"
            elif start < t < stop and (ids[t] in markers or t == stop):
                kind = "marker_or_stop"
            elif start < t < stop:
                kind = "rest_of_text"
            elif t == stop:
                kind = "marker_or_stop"
            else:
                continue
            stats[kind][0] += hit[t - 1]
            stats[kind][1] += 1
    return stats


def decision_accuracy(model, tok, examples, questions, checks: str) -> dict[str, list[int]]:
    """``{kind: [hits, count]}`` for ``checks="tag"`` or ``"gold_line"`` trajectories (module docstring)."""
    import torch

    from sorl_verl.embedded.medical_trajectories import OPTION_MARKERS

    markers = {tok.convert_tokens_to_ids(m) for m in OPTION_MARKERS}
    stats = {k: [0, 0] for k in ("decision", "answer_letter", "before_decision")}
    for q, (ids, mask) in zip(questions, examples, strict=True):
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        text = [tok.decode([i]) for i in ids]
        letters = [t for t in range(1, len(ids)) if mask[t] and text[t].strip() == q["answer_idx"]]
        if checks == "tag":
            decision = next(t for t in letters if text[t - 1].endswith("("))
        else:
            decision = next(t for t in range(len(ids)) if mask[t] and ids[t] in markers)
        for t in range(1, letters[-1] + 1):
            if mask[t]:
                kind = "decision" if t == decision else "answer_letter" if t == letters[-1] else "before_decision"
                stats[kind][0] += int(pred[t - 1] == ids[t])
                stats[kind][1] += 1
    return stats


def letter_cosines(model, tok) -> dict[str, float | None]:
    """Mean off-diagonal cosine of the input embeddings of each group of five letter tokens (module docstring)."""
    import torch

    weights = model.get_input_embeddings().weight.detach()
    out: dict[str, float | None] = {}
    for name, texts in (("letters", "ABCDE"), ("space_letters", [f" {c}" for c in "ABCDE"]),
                        ("markers", [f"\n{c}." for c in "ABCDE"])):  # fmt: skip
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        ids = [i[0] for i in ids if len(i) == 1]
        if len(ids) < 2:
            out[name] = None
            continue
        v = torch.nn.functional.normalize(weights[ids], dim=-1)
        out[name] = round(((v @ v.T).sum().item() - len(ids)) / (len(ids) ** 2 - len(ids)), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="a medical build (its model, tokenizer, index and world)")
    p.add_argument("--n", type=int, default=60, help="questions per split (the first n)")
    p.add_argument("--drills", action="store_true", help="also score the option drills of the same questions")
    p.add_argument("--checks", choices=("block", "tag", "gold_line"), default="block", help="the build's check style")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sorl_verl.embedded.medical_trajectories import (
        build_medical_sft_examples,
        drill_prompt,
        drill_segments,
        drill_style,
    )
    from sorl_verl.embedded.warmstart import make_observer, tokenize_trajectory

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.root / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(a.root / "model").eval()
    observe = make_observer(a.root / "index")
    for split in ("train", "val"):
        lines = (a.root / "world" / f"{split}.jsonl").read_text().splitlines()[: a.n]
        qs = [json.loads(line) for line in lines]
        kinds = {"agent": (a.checks, build_medical_sft_examples(tok, qs, observe, False, a.checks))}
        if a.drills:
            style = drill_style(a.checks)
            drills = [tokenize_trajectory(tok, q["question"], drill_segments(q, style), drill_prompt(q)) for q in qs]
            kinds["drill"] = (style, drills)
        for kind, (style, examples) in kinds.items():
            if style == "block":
                stats = copy_accuracy(model, tok, examples, qs)
            else:
                stats = decision_accuracy(model, tok, examples, qs, style)
            rates = {k: round(h / c, 3) if c else None for k, (h, c) in stats.items()}
            row = {"build": a.root.name, "split": split, "examples": kind, "n": len(qs), "accuracy": rates}
            print(json.dumps({**row, "counts": stats}))
    print(json.dumps({"build": a.root.name, "embeddings": letter_cosines(model, tok)}))


if __name__ == "__main__":
    main()
