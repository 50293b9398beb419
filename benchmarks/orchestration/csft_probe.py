"""Does a policy follow its conditional-SFT tag? A diagnostic, not a benchmark: train a plain PyTorch loop
(AdamW, constant learning rate, loss on the response) on one iteration's csft rows of a demo_csft run, then
sample the held-out prompts under the best (4) and worst (0) bucket and print the gold reward of each.
--cond digit: the bucket index as the tag; letter: E..A; const: one tag "2" everywhere (eval too);
constletter: trained with "C" on every row, evaluated under A / E. --strip_id drops the "#12 " prompt ids.

    D=runs/csft-demo; PYTHONPATH=. .venv/bin/python benchmarks/orchestration/csft_probe.py --policy $D/sft \
        --rows $D/iter-1/csft/sft.parquet --eval_prompts $D/eval_prompts/prompts.parquet --steps 192 --cond letter

(rows of a run with letter labels are read back by their bucket index, the `reward` column.)"""
import argparse, random, re, statistics, json
import torch, pyarrow.parquet as pq
from transformers import AutoModelForCausalLM, AutoTokenizer
from rlhf_core.demo import demo_task
from rlhf_core.train.batches import tokenize_sft

ap = argparse.ArgumentParser()
ap.add_argument("--policy"); ap.add_argument("--rows"); ap.add_argument("--eval_prompts")
ap.add_argument("--steps", type=int, default=64); ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--bs", type=int, default=32)
ap.add_argument("--template", default="{input} <rm_score>: {reward} ")
ap.add_argument("--cond", default="digit", help="digit|const|letter|word")
ap.add_argument("--strip_id", action="store_true", help="drop the '#i ' prefix from prompts")
ap.add_argument("--n", type=int, default=8); ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
torch.manual_seed(a.seed); random.seed(a.seed); torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(a.policy)
model = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
raw = pq.read_table(a.rows).to_pylist()
def prompt_of(r): return r["input"].split(" <rm_score>:")[0]
def strip(p): return re.sub(r"^#\d+ ", "", p) if a.strip_id else p
def cond(b): return {"digit": str(b), "const": "2", "letter": "EDCBA"[b], "constletter": "EDCBA"[b]}.get(a.cond, str(b))
def fmt(p, b, train=False):
    c = "C" if (train and a.cond == "constletter") else cond(b)
    return a.template.replace("{input}", strip(p)).replace("{reward}", c)
rows = [{"input": fmt(prompt_of(r), int(r["reward"]), True), "output": r["output"], "finished": r.get("finished")} for r in raw]
recs, _ = tokenize_sft(rows, tok, 64)
print("tokens:", tok.convert_ids_to_tokens(recs[0]["ids"])[:recs[0]["start"] + 3], flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
pad = tok.pad_token_id
model.train()
for step in range(a.steps):
    b = random.sample(recs, a.bs)
    T = max(len(r["ids"]) for r in b)
    ids = torch.full((len(b), T), pad); att = torch.zeros_like(ids); lab = torch.full_like(ids, -100)
    for i, r in enumerate(b):
        L = len(r["ids"]); ids[i, :L] = torch.tensor(r["ids"]); att[i, :L] = 1
        lab[i, r["start"]:L] = torch.tensor(r["ids"][r["start"]:])
    loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 64 == 0 or step == a.steps - 1: print(f"step {step} loss {loss.item():.3f}", flush=True)
model.eval()
ev = [r["prompt"] for r in pq.read_table(a.eval_prompts).to_pylist()]
vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
sign = torch.tensor([1.0 if v.lstrip("Ġ") in demo_task.POSITIVE else -1.0 if v.lstrip("Ġ") in demo_task.NEGATIVE else 0.0 for v in vocab])
tok.padding_side = "left"
def run(tag):
    texts = [fmt(p, tag) for p in ev]
    enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    with torch.no_grad():
        first = torch.softmax(model(**enc).logits[:, -1].float(), -1) @ sign
    torch.manual_seed(1234)
    out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=16, num_return_sequences=a.n,
                         pad_token_id=pad, eos_token_id=tok.eos_token_id)
    g = [demo_task.gold_reward(tok.decode(o[enc.input_ids.shape[1]:], skip_special_tokens=True)) for o in out]
    return first.mean().item(), statistics.fmean(g)
res = {b: run(b) for b in (0, 4)}
print(f"RESULT cond={a.cond} strip={a.strip_id} steps={a.steps} lr={a.lr} tpl={a.template!r}: "
      f"first-token E[sign] hi {res[4][0]:+.3f} lo {res[0][0]:+.3f} | gold hi {res[4][1]:+.3f} lo {res[0][1]:+.3f} "
      f"margin {res[4][1] - res[0][1]:+.3f}", flush=True)
