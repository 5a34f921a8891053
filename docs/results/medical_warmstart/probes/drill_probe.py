"""Drill-only probe: can the tiny model learn the reverse option lookup at all?

    python drill_probe.py NAME LR STEPS TIE [--form dot|nodot|dense] [--batch 16]

A fresh tiny model (``TinyModelSpec``, tied embeddings when TIE is 1) trained on 20,000 drills of
the train questions, each ``Find X among the options.`` + the option block, and the response

- ``dot`` (the ``gold_line`` drill): ``The answer is X.\\nL. X``;
- ``nodot``: ``The answer is X\\nL. X`` (the marker predicted on the name's own position);
- ``dense``: one ``Y.\\nK. Y`` line per option in a shuffled order, the gold one last,

then ``<answer> L </answer>``. Every STEPS/5 steps it prints the greedy accuracy of the first marker
of the response (one decision per drill) on 300 drills of val questions. Uses the tokenizer and
world of a ``letter_tokens`` build (``$SORL_HOME/embedded_medical_gold_line``).
"""

import argparse
import os
import random
import time
from pathlib import Path

import torch

from sorl_verl.agent.prompts import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN
from sorl_verl.embedded.medical_trajectories import OPTION_MARKERS, drill_prompt
from sorl_verl.embedded.medical_world import MedicalWorldConfig, generate_medical_world
from sorl_verl.embedded.tiny_model import TinyModelSpec, build_tiny_qwen2
from sorl_verl.embedded.warmstart import SFTConfig, tokenize_trajectory, train_sft
from sorl_verl.embedded.world import read_jsonl


def response(q: dict, form: str) -> str:
    gold, ans = q["answer_idx"], q["answer"]
    if form == "dense":
        keys = [k for k in q["options"] if k != gold]
        random.Random(q["id"]).shuffle(keys)
        lines = "".join(f"{q['options'][k]}.\n{k}. {q['options'][k]}\n" for k in keys)
        body = f"{lines}The answer is {ans}.\n{gold}. {ans}"
    else:
        body = f"The answer is {ans}{'.' if form == 'dot' else ''}\n{gold}. {ans}"
    return f"{THINK_OPEN} {body} {THINK_CLOSE}\n{ANSWER_OPEN} {gold} {ANSWER_CLOSE}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("lr", type=float)
    p.add_argument("steps", type=int)
    p.add_argument("tie", choices=("0", "1"))
    p.add_argument("--form", choices=("dot", "nodot", "dense"), default="dot")
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    root = Path(os.environ.get("SORL_HOME", ".sorl_cache")) / "embedded_medical_gold_line"
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    world = generate_medical_world(MedicalWorldConfig())

    def drills(questions: list, n: int, seed: int) -> list:
        rng = random.Random(seed)
        qs = [world.with_options(rng.choice(questions), rng, suffix=f"~d{i}") for i in range(n)]
        return [tokenize_trajectory(tok, q["question"], [(response(q, a.form), True)], drill_prompt(q)) for q in qs]

    train = drills(read_jsonl(root / "world" / "train.jsonl"), 20000, 0)
    test = drills(read_jsonl(root / "world" / "val.jsonl"), 300, 1)
    markers = {tok.convert_tokens_to_ids(m) for m in OPTION_MARKERS}
    model = build_tiny_qwen2(tok, TinyModelSpec(tie_word_embeddings=a.tie == "1"), seed=0)
    t0, chunk = time.time(), a.steps // 5
    for k in range(5):  # warm-up in the first chunk only, then a constant lr
        cfg = SFTConfig(steps=chunk, batch_size=a.batch, lr=a.lr, warmup_steps=30 if k == 0 else 1, min_lr_ratio=1.0, seed=k)
        train_sft(model, train, tok.pad_token_id, cfg, progress=False)
        model.eval()
        with torch.no_grad():
            hits = 0
            for ids, mask in test:
                t = next(t for t in range(len(ids)) if mask[t] and ids[t] in markers)
                hits += int(model(torch.tensor([ids[:t]])).logits[0, -1].argmax().item() == ids[t])
        model.train()
        print(a.name, ((k + 1) * chunk, round(hits / len(test), 3)), round(time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
