"""Drill-only probe: can the tiny model learn the reverse lookup at all? python probe.py NAME LR STEPS TIE [BATCH]"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer
from sorl_verl.embedded.medical_trajectories import option_drills, drill_segments, drill_prompt, OPTION_MARKERS
from sorl_verl.embedded.medical_world import generate_medical_world, MedicalWorldConfig
from sorl_verl.embedded.warmstart import train_sft, SFTConfig, tokenize_trajectory
from sorl_verl.embedded.tiny_model import build_tiny_qwen2, TinyModelSpec
from sorl_verl.embedded.world import read_jsonl
name, lr, steps, tie = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
bs = int(sys.argv[5]) if len(sys.argv) > 5 else 16
root = Path("/work/main/.sorl_cache/embedded_medical_gold_line")
tok = AutoTokenizer.from_pretrained(root / "tokenizer")
world = generate_medical_world(MedicalWorldConfig())
train = read_jsonl(root / "world" / "train.jsonl"); val = read_jsonl(root / "world" / "val.jsonl")
import random
from sorl_verl.agent.prompts import THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE
def seg(q):
    L = q["answer_idx"]
    return [(f"{THINK_OPEN} The answer is {q['answer']}\n{L}. {q['answer']} {THINK_CLOSE}\n{ANSWER_OPEN} {L} {ANSWER_CLOSE}", True)]
def drills(qs, n, seed):
    rng = random.Random(seed)
    ds = [world.with_options(rng.choice(qs), rng, suffix=f"~d{i}") for i in range(n)]
    return [tokenize_trajectory(tok, q["question"], seg(q), prompt=drill_prompt(q)) for q in ds]
ex = drills(train, 20000, 0)
test = drills(val, 300, 1)
markers = {tok.convert_tokens_to_ids(m) for m in OPTION_MARKERS}
def acc(model):
    hits = 0
    model.eval()
    with torch.no_grad():
        for ids, mask in test:
            t = next(t for t in range(len(ids)) if mask[t] and ids[t] in markers)
            hits += int(model(torch.tensor([ids[:t]])).logits[0, -1].argmax().item() == ids[t])
    model.train()
    return hits / len(test)
model = build_tiny_qwen2(tok, TinyModelSpec(tie_word_embeddings=tie), seed=0)
out = []
t0 = time.time()
chunk = steps // 5
for k in range(5):
    # continue training in chunks with a constant-ish schedule (warm-up only in the first)
    train_sft(model, ex, tok.pad_token_id, SFTConfig(steps=chunk, batch_size=bs, lr=lr, warmup_steps=30 if k == 0 else 1, min_lr_ratio=1.0, seed=k), progress=False)
    out.append(((k + 1) * chunk, round(acc(model), 3)))
    print(name, out[-1], round(time.time() - t0), flush=True)
