"""Reward sources: reward model (seq-cls and OpenRLHF value head), reward_func files, a real HTTP server."""
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf_core.demo import demo_task
from rlhf_core.rollout.rewards import RewardError, RewardSpec, compute_rewards
from rlhf_core.rollout.reward_model import RMEngine

PROMPTS = ["Review of the movie:", "Review of the food: and a much longer prompt here", "Review of the tea:"]
RESPONSES = [" great good .", " bad", " the service was really awful and boring ."]


def direct_reward(rm_dir, text):
    """The HF model's own pooled logit for one unpadded sequence (+ EOS)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, 0].item()


def test_rm_scores_match_unpadded_forward_in_any_batch(tiny):
    """Left padding + mask-derived positions: a row's reward does not depend on its batch mates."""
    batched = compute_rewards(RewardSpec(model=str(tiny.reward_dir), batch_size=3), PROMPTS, RESPONSES).rewards
    single = compute_rewards(RewardSpec(model=str(tiny.reward_dir), batch_size=1), PROMPTS, RESPONSES).rewards
    expect = [direct_reward(tiny.reward_dir, p + r) for p, r in zip(PROMPTS, RESPONSES)]
    assert batched == pytest.approx(expect, abs=1e-4)
    assert single == pytest.approx(expect, abs=1e-4)
    assert len(set(round(x, 6) for x in batched)) == 3


def test_value_head_layout_and_config_normalisation(tiny, tmp_path):
    """An OpenRLHF-layout RM (backbone `model.*` + `value_head.weight`) with reward_mean 0.5, reward_std 2
    gives (r - 0.5) / 2 of the seq-cls rewards."""
    from safetensors.torch import load_file, save_file

    vh = tmp_path / "vh"
    shutil.copytree(tiny.reward_dir, vh)
    sd = load_file(str(vh / "model.safetensors"))
    sd["value_head.weight"] = sd.pop("score.weight")
    save_file(sd, str(vh / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((vh / "config.json").read_text())
    cfg.update(architectures=["LlamaModel"], reward_mean=0.5, reward_std=2.0)
    (vh / "config.json").write_text(json.dumps(cfg))
    base = compute_rewards(RewardSpec(model=str(tiny.reward_dir)), PROMPTS, RESPONSES).rewards
    got = compute_rewards(RewardSpec(model=str(vh)), PROMPTS, RESPONSES).rewards
    assert got == pytest.approx([(b - 0.5) / 2 for b in base], abs=1e-4)
    raw = compute_rewards(RewardSpec(model=str(vh), normalize=False), PROMPTS, RESPONSES).rewards
    assert raw == pytest.approx(base, abs=1e-4)


def test_policy_dir_is_not_a_reward_model(tiny):
    with pytest.raises(RewardError, match="is not a reward model"):
        RMEngine(str(tiny.policy_dir), RewardSpec(model=str(tiny.policy_dir)))


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(body)
    return str(p)


def test_reward_func_contract_dict_with_scores_logs_and_labels(tmp_path):
    path = write(tmp_path, "rf.py", """
import torch
from rlhf_core.demo.demo_task import gold_reward
def reward_func(queries, prompts, labels):
    r = torch.tensor([gold_reward(q[len(p):]) for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r * 2, "extra_logs": {"n_labels": torch.tensor([float(l == "x") for l in labels])}}
""")
    out = compute_rewards(RewardSpec(func_path=path, batch_size=2), PROMPTS, RESPONSES, ["x", "y", "x"])
    expect = [demo_task.gold_reward(r) for r in RESPONSES]
    assert out.rewards == pytest.approx(expect)
    assert out.scores == pytest.approx([2 * e for e in expect])
    assert out.extra_logs["n_labels"] == pytest.approx(2 / 3)  # rows x, y | x: batch means 0.5, 1.0 weighted 2:1


@pytest.mark.parametrize("body, match", [
    (None, "does not exist"),
    ("def other(q, p, l):\n    return q\n", "defines no reward_func"),
    ("def reward_func(q, p, l):\n    raise KeyError('boom')\n", "raised KeyError"),
    ("def reward_func(q, p, l):\n    return [1.0] * (len(q) - 1)\n", "returned 2 rewards for 3 queries"),
    ("def reward_func(q, p, l):\n    return [1.0, float('nan'), float('inf')]\n", r"non-finite.*rows \[1, 2\]"),
])
def test_reward_func_bad_files(tmp_path, body, match):
    path = str(tmp_path / "missing.py") if body is None else write(tmp_path, "rf.py", body)
    with pytest.raises(RewardError, match=match):
        compute_rewards(RewardSpec(func_path=path), PROMPTS, RESPONSES)


@pytest.fixture
def reward_server():
    """A real HTTP reward server on 127.0.0.1 (OpenRLHF serve_rm shape) answering gold rewards."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            rewards = [demo_task.gold_reward(q[len(p):]) for q, p in zip(body["query"], body["prompts"])]
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/get_reward", seen
    srv.shutdown()
    srv.server_close()


def test_remote_server_batches_and_labels(reward_server):
    url, seen = reward_server
    out = compute_rewards(RewardSpec(remote_url=url, batch_size=2), PROMPTS, RESPONSES, ["a", "b", "c"])
    assert out.rewards == pytest.approx([demo_task.gold_reward(r) for r in RESPONSES])
    assert [len(b["query"]) for b in seen] == [2, 1]
    assert seen[1]["labels"] == ["c"] and seen[0]["query"][0] == PROMPTS[0] + RESPONSES[0]


def test_remote_server_unreachable_names_url_after_retries():
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}/get_reward"
    with pytest.raises(RewardError, match=rf"{url} unreachable after 2 attempts"):
        compute_rewards(RewardSpec(remote_url=url, retries=2, timeout_s=2), PROMPTS, RESPONSES)


def test_exactly_one_source():
    with pytest.raises(RewardError, match="exactly one"):
        compute_rewards(RewardSpec(model="a", func_path="b"), PROMPTS, RESPONSES)


# ---------------------------------------------------------------------------------------------- issue 37: RM ranks
def _rm_rank(rank: int, world: int, port: int, models: list, pairs: list, out: str) -> None:
    """One ZeRO-3 reward rank in a spawned process: its shard of the pairs, scored by every model."""
    from rlhf_core.rollout.reward_model import RMEnsemble, shard_pairs

    torch.set_num_threads(1)
    rm = RMEnsemble(models, RewardSpec(model=models[0], batch_size=2), rank=rank, world=world, sharded=True)
    rm.setup("127.0.0.1", port)
    idx = shard_pairs(len(pairs), world)[rank]
    torch.save({"idx": idx, "scores": rm.score_each([pairs[i] for i in idx]), "elements": rm.param_elements()},
               f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_two_zero3_reward_ranks_score_as_one_each_holding_half(tiny, tmp_path):
    """ppo's reward_num_gpus_per_node 2 under zero_stage 3: two reward ranks (spawned processes, a gloo group), each
    holding its ZeRO-3 partition of a seq-cls RM and of an OpenRLHF value_head RM, score 5 pairs split 3 / 3 (the
    second shard repeats its last pair so both ranks forward 2 micro-batches of 2): every score equals the unsharded
    RMEngine's (atol 1e-5, fp32) and each rank holds about half the elements."""
    import torch.multiprocessing as mp

    from rlhf_core.rollout.reward_model import RMEnsemble
    from rlhf_core.runtime.jobs import free_port
    from tests.rlhf_core.ppo.test_ppo_roles import openrlhf_rm

    models = [str(tiny.reward_dir), str(openrlhf_rm(tiny.reward_dir, tmp_path / "vh"))]
    pairs = [(f"Review {i}: ", "good fine " * (i + 1)) for i in range(5)]
    whole = RMEnsemble(models, RewardSpec(model=models[0], batch_size=2))
    expected, total = whole.score_each(pairs), whole.param_elements()
    mp.spawn(_rm_rank, args=(2, free_port(), models, pairs, str(tmp_path)), nprocs=2)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [p["idx"] for p in parts] == [[0, 1, 2], [3, 4, 4]]
    for m in range(2):
        got = {i: s for p in parts for i, s in zip(p["idx"], p["scores"][m])}
        assert [got[i] for i in range(5)] == pytest.approx(expected[m], abs=1e-5)
    assert all(abs(p["elements"] - total / 2) < 0.02 * total for p in parts), ([p["elements"] for p in parts], total)
