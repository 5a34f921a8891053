"""Letter-weighted SFT experiment (tag style): python wexp.py ROOT OUT WEIGHT STEPS LR [INIT]"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer, AutoModelForCausalLM
from sorl_verl.embedded.medical_build import eval_questions, evaluate_mcq, twin_world_examples, TWIN_SEED_OFFSET
from sorl_verl.embedded.medical_trajectories import build_medical_sft_examples, sft_questions
from sorl_verl.embedded.medical_world import generate_medical_world, MedicalWorldConfig
from sorl_verl.embedded.warmstart import make_observer, train_sft, SFTConfig
from sorl_verl.embedded.tiny_model import build_tiny_qwen2, TinyModelSpec, save_model
from sorl_verl.embedded.world import read_jsonl
root, out, W, steps, lr = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
init = sys.argv[6] if len(sys.argv) > 6 else None
tok = AutoTokenizer.from_pretrained(root / "tokenizer")
observe = make_observer(root / "index")
world = generate_medical_world(MedicalWorldConfig())
train = read_jsonl(root / "world" / "train.jsonl")
t0 = time.time()
ex = build_medical_sft_examples(tok, sft_questions(world, train, 100, seed=0), observe, False, "tag")
for i in range(3):
    ex += twin_world_examples(tok, world, world.config.seed + TWIN_SEED_OFFSET + i, 3, False, "tag")
paren = tok.convert_tokens_to_ids("(")
ans = tok.convert_tokens_to_ids("<answer>")
def weigh(ids, mask):
    m = list(mask)
    for t in range(1, len(ids)):
        if m[t] and (ids[t - 1] == paren or (t >= 2 and ans in ids[max(0, t - 2):t] and tok.decode([ids[t]]).strip() in "ABCDE" and tok.decode([ids[t]]).strip())):
            m[t] = W
    return ids, m
ex = [weigh(i, m) for i, m in ex]
nw = sum(sum(1 for v in m if v == W) for _, m in ex)
print("examples", len(ex), "weighted tokens", nw, "data s", round(time.time() - t0, 1), flush=True)
model = AutoModelForCausalLM.from_pretrained(init) if init else build_tiny_qwen2(tok, TinyModelSpec(), seed=0)
t0 = time.time()
losses = train_sft(model, ex, tok.pad_token_id, SFTConfig(steps=steps, lr=lr, warmup_steps=10 if init else 30), progress=True)
ts = time.time() - t0
val = read_jsonl(root / "world" / "val.jsonl")
ev = {f"T{t:g}": evaluate_mcq(model, tok, eval_questions(val, 25), observe, t, 4) for t in (0.0, 1.0)}
out.mkdir(parents=True, exist_ok=True)
save_model(model, tok, out / "model")
rep = {"root": str(root), "weight": W, "steps": steps, "lr": lr, "init": init, "sft_seconds": round(ts, 1),
       "loss_first10": sum(losses[:10]) / 10, "loss_last10": sum(losses[-10:]) / 10, "eval": ev}
(out / "report.json").write_text(json.dumps(rep, indent=1))
print("RESULT", json.dumps({k: v for k, v in rep.items() if k != "eval"}), {k: round(v["success"], 3) for k, v in ev.items()}, flush=True)
