"""Where our numbers and TRL's differ on the same batch, each convention named, settable and checked by hand
(issue 44 item 4): IPO's log-ratios summed (OpenRLHF) or per token (TRL, length_normalize); sft's token mean per
micro-batch (OpenRLHF) or over the accumulation window (TRL, loss_token_mean=window); kto's per-step class rewards as
class means (TRL's rewards/chosen, rewards/rejected), not class sums over the batch size."""
from __future__ import annotations

import json
import os

import pytest
import torch

from rlhf_core.rl import losses
from rlhf_core.train import entry, methods
from rlhf_core.train.batches import BatchPlan


# ---------------------------------------------------------------------------------------------- IPO
def test_ipo_summed_and_per_token_against_hand_values_and_gradients():
    """pc = -1, pr = -3, rc = -2, rr = -2, beta 0.5 (1 / (2 beta) = 1), |y_c| = 2, |y_r| = 4.
    summed:    h = (-1 + 3) - (-2 + 2) = 2;                 loss (2 - 1)^2 = 1;
               dL/dpc = 2 (h - 1) = 2, dL/dpr = -2.
    per token: h = (-1 + 2) / 2 - (-3 + 2) / 4 = 0.75;      loss (0.75 - 1)^2 = 0.0625;
               dL/dpc = 2 (0.75 - 1) / 2 = -0.25, dL/dpr = 2 (0.75 - 1) x (-1 / 4) = 0.125.
    The implied rewards stay summed: 0.5 (-1 + 2) = 0.5 and 0.5 (-3 + 2) = -0.5 both ways."""
    for lengths, loss, g_c, g_r in ((None, 1.0, 2.0, -2.0), ((torch.tensor([2]), torch.tensor([4])), 0.0625, -0.25, 0.125)):
        pc, pr = torch.tensor([-1.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
        o = losses.dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), 0.5, "ipo", lengths=lengths)
        o.losses.sum().backward()
        assert o.losses.item() == pytest.approx(loss)
        assert (pc.grad.item(), pr.grad.item()) == pytest.approx((g_c, g_r))
        assert (o.metrics["chosen_reward"].item(), o.metrics["rejected_reward"].item()) == pytest.approx((0.5, -0.5))
    with pytest.raises(ValueError, match="length-normalized log-ratios apply to the ipo loss only, not 'sigmoid'"):
        losses.dpo_loss(pc, pr, pc, pr, 0.5, "sigmoid", lengths=(torch.tensor([2]), torch.tensor([4])))


def test_dpo_stage_offers_length_normalize_for_ipo_only():
    from stages import dpo

    base = dict(policy_uri="p", dataset_uri="d", output_uri="o")
    assert dpo.Config(**base, loss_type="ipo", length_normalize=True).length_normalize
    assert dpo.Config(**base).length_normalize is False  # OpenRLHF's summed log-probs by default
    with pytest.raises(ValueError, match="length_normalize applies to loss_type ipo only, not 'sigmoid'"):
        dpo.Config(**base, length_normalize=True)


def test_dpo_step_divides_each_response_by_its_own_targets(tiny):
    """dpo.step on the tiny policy with length_normalize: its loss is (h - 1 / (2 beta))^2 with h from the forward's
    summed log-probs and target counts as the hand formula above (and differs from the summed form)."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.demo import demo_task
    from rlhf_core.inputs import models
    from rlhf_core.train.batches import tokenize_pairs

    tok = models.load_tokenizer(tiny.policy_dir)
    recs, _ = tokenize_pairs(demo_task.preference_rows(4, seed=2), tok, 64, model_dir=tiny.policy_dir)
    for i, r in enumerate(recs):
        r["ref_chosen_logp"], r["ref_rejected_logp"] = -20.0 - i, -25.0 + i
    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval()
    pad, beta = models.pad_id(tok, tiny.policy_dir), 0.1
    spec = {"packing_samples": False, "beta": beta, "loss_type": "ipo", "label_smoothing": 0.0, "nll_loss_coef": 0.0}
    with torch.no_grad():
        norm = methods.get("dpo").step(model, {**spec, "length_normalize": True}, recs, pad)[0].item()
        summed = methods.get("dpo").step(model, spec, recs, pad)[0].item()
        lp_c, n_c, _ = entry.forward(model, spec, [r["chosen_ids"] for r in recs], [r["chosen_start"] for r in recs], pad)
        lp_r, n_r, _ = entry.forward(model, spec, [r["rejected_ids"] for r in recs], [r["rejected_start"] for r in recs], pad)
    ref_c = torch.tensor([r["ref_chosen_logp"] for r in recs])
    ref_r = torch.tensor([r["ref_rejected_logp"] for r in recs])
    assert (n_c != n_r).any()  # responses of different lengths: the two forms differ
    h = (lp_c - ref_c) / n_c - (lp_r - ref_r) / n_r
    assert norm == pytest.approx(float(((h - 1 / (2 * beta)) ** 2).mean()), rel=1e-5)
    hs = (lp_c - lp_r) - (ref_c - ref_r)
    assert summed == pytest.approx(float(((hs - 1 / (2 * beta)) ** 2).mean()), rel=1e-5)
    assert abs(norm - summed) > 1e-3 * abs(summed)


# ---------------------------------------------------------------------------------------------- sft
def test_sft_token_mean_per_micro_batch_or_over_the_window_by_hand():
    """Two micro-batches: 8 NLL over 4 targets (sums [-6, -2] over [3, 1]) and 3 NLL over 6 targets.
    micro_batch (OpenRLHF): (8 / 4 + 3 / 6) / 2 = (2.0 + 0.5) / 2 = 1.25.
    window (TRL): 11 / 10 = 1.1; per micro-batch the sums over N_window / M = 10 / 2 = 5: 8 / 5 = 1.6 and 3 / 5 = 0.6,
    whose mean (DeepSpeed's accumulation) is 1.1. Each example's nll is its own mean either way: [2.0, 2.0] and [0.5]."""
    mbs = [(torch.tensor([-6.0, -2.0]), torch.tensor([3, 1])), (torch.tensor([-3.0]), torch.tensor([6]))]
    micro = [losses.sft_loss(s, n) for s, n in mbs]
    assert [o.losses.sum().item() for o in micro] == pytest.approx([2.0, 0.5])
    assert sum(o.losses.sum().item() for o in micro) / 2 == pytest.approx(1.25)
    window = [losses.sft_loss(s, n, per_token=5.0) for s, n in mbs]
    assert window[0].losses.tolist() == pytest.approx([1.2, 0.4])
    assert [o.losses.sum().item() for o in window] == pytest.approx([1.6, 0.6])
    assert sum(o.losses.sum().item() for o in window) / 2 == pytest.approx(1.1)
    assert [o.metrics["nll"].tolist() for o in window] == [[2.0, 2.0], [0.5]]


def test_window_per_token_counts_every_micro_batch_of_the_step():
    """Records with 3, 1, 6 and 2 loss targets (ids of length L, targets from `start`; token 0 is never a target:
    start 0 counts L - 1): one step of 4 in micro-batches of 2 -> N_window 12, M 2 -> 6.0; micro-batches of 1 ->
    12 / 4 = 3.0 (world size 2: the same, both ranks' micro-batches count). Multi-turn spans count their tokens:
    [[1, 3], [5, 7]] over 8 tokens -> 4."""
    recs = [{"ids": [1] * 5, "start": 2}, {"ids": [1] * 2, "start": 0}, {"ids": [1] * 9, "start": 3},
            {"ids": [1] * 8, "start": [[1, 2], [6, 7]]}]
    lengths = [len(r["ids"]) for r in recs]
    assert entry.window_per_token(BatchPlan(lengths, 4, 2, 1, 0, 1, False), recs, 0) == 6.0
    assert entry.window_per_token(BatchPlan(lengths, 4, 1, 1, 0, 1, False), recs, 0) == 3.0
    assert entry.window_per_token(BatchPlan(lengths, 4, 1, 2, 0, 1, False), recs, 0) == 3.0
    spans = [{"ids": [1] * 8, "start": [[1, 3], [5, 7]]}]
    assert entry.window_per_token(BatchPlan([8], 1, 1, 1, 0, 1, False), spans, 0) == 4.0


@pytest.fixture(scope="module")
def dist_env():
    """A one-rank gloo group (DeepSpeed keeps it); the environment restored after."""
    import deepspeed

    from rlhf_core.runtime.jobs import free_port

    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.ops.__dict__["__compatible_ops__"] = {}
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("mode", ["micro_batch", "window"])
def test_sft_accumulated_gradient_through_deepspeed_is_the_conventions_mean(tiny, dist_env, mode):
    """The entry's loop on a real DeepSpeed engine (ZeRO-0, 2 accumulation steps of 2 samples, fp32): after both
    micro-batches' backward, the accumulated gradient is that of the mean of the micro-batch token means
    (micro_batch) or of one token mean over the 4 samples (window), each computed on the same model without
    DeepSpeed; the two differ (micro-batches of unequal target counts)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from rlhf_core.demo import demo_task
    from rlhf_core.inputs import models
    from rlhf_core.train import adamw
    from rlhf_core.train.batches import seq_len, tokenize_sft

    tok = models.load_tokenizer(tiny.policy_dir)
    recs, _ = tokenize_sft(demo_task.sft_rows(4, 3), tok, 48)
    plan = BatchPlan([seq_len(r) for r in recs], 4, 2, 1, 0, 1, False)
    mbs = plan.micro_batches(0, 0)
    pad = models.pad_id(tok, tiny.policy_dir)
    load = lambda: AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32)  # noqa: E731
    spec = {"packing_samples": False, "loss_token_mean": mode}

    sums = []
    plain = load()
    for mb in mbs:
        lp, n, _ = entry.forward(plain, spec, [recs[i]["ids"] for i in mb], [recs[i]["start"] for i in mb], pad)
        sums.append((lp.sum(), n.sum()))
    assert sums[0][1].item() != sums[1][1].item()
    want = (sum(-s / n for s, n in sums) / 2 if mode == "micro_batch"
            else -sum(s for s, _ in sums) / sum(n for _, n in sums))
    want.backward()

    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9}
    model = load()
    engine = deepspeed.initialize(model=model, optimizer=adamw(model.parameters(), 1e-3, (0.9, 0.95), 0.0), config=ds)[0]
    assert engine.gradient_accumulation_steps() == 2
    step_spec = {**spec, "window_per_token": entry.window_per_token(plan, recs, 0)} if mode == "window" else spec
    logged = []
    for k, mb in enumerate(mbs):
        loss, met, _ = methods.get("sft").step(engine, step_spec, [recs[i] for i in mb], pad)
        engine.backward(loss)
        logged.append(met)
        if k == 0:
            engine.step()  # not a boundary: no update, as in the entry's loop
    assert entry.step_figures(logged, {})["loss"] == pytest.approx(want.item(), rel=1e-5)  # the logged step loss
    for (name, a), b in zip(plain.named_parameters(), engine.module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_sft_stage_trains_on_the_window_token_mean(tiny, tmp_path):
    """The sft stage with loss_token_mean=window, end to end (a DeepSpeed job): its first logged loss is the token
    mean over step 1's whole batch under the initial model (the batch taken from the job's own plan), not the mean of
    its micro-batches' token means."""
    from transformers import AutoModelForCausalLM

    from rlhf_core import store
    from rlhf_core.demo import demo_task
    from rlhf_core.inputs import data, models
    from rlhf_core.train.batches import seq_len, tokenize_sft
    from rlhf_core.train.launch import load_rows
    from stages import sft

    uri = str(tmp_path / "data")
    w = store.ArtifactWriter(uri, "data", {"n": 16})
    w.begin()
    w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(16, 4), "sft"))
    w.commit()
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=str(tmp_path / "sft"), max_len=48,
                     input_template=demo_task.INPUT_TEMPLATE, train_batch_size=8, micro_train_batch_size=2,
                     learning_rate=1e-3, lr_warmup_ratio=0.0, loss_token_mean="window", zero_stage=0)
    sft.run(cfg)
    first = json.loads((tmp_path / "sft" / "training_log.json").read_text())[0]

    tok = models.load_tokenizer(tiny.policy_dir)
    fmt = data.Format(input_key="input", output_key="output", input_template=cfg.input_template)
    recs, _ = tokenize_sft(load_rows(cfg, "sft", fmt, tok), tok, cfg.max_len, model_dir=tiny.policy_dir)  # as the stage
    plan = BatchPlan([seq_len(r) for r in recs], 8, 2, 1, cfg.seed, 1, cfg.length_bucketing)
    assert sorted(plan.batch(0)) == sorted(first["samples"])
    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32)
    pad = models.pad_id(tok, tiny.policy_dir)
    parts = []
    with torch.no_grad():
        for mb in plan.micro_batches(0, 0):
            lp, n, _ = entry.forward(model, {"packing_samples": False}, [recs[i]["ids"] for i in mb],
                                     [recs[i]["start"] for i in mb], pad)
            parts.append((-lp.sum().item(), n.sum().item()))
    window = sum(s for s, _ in parts) / sum(n for _, n in parts)
    micro = sum(s / n for s, n in parts) / len(parts)
    assert abs(first["loss"] - window) < abs(window - micro) / 10  # far nearer the window's mean than the other
    assert first["loss"] == pytest.approx(window, rel=1e-5)


# ---------------------------------------------------------------------------------------------- kto
def kto_metrics(rewards: list[float], desirable: list[int]) -> dict[str, torch.Tensor]:
    """The per-example metrics kto.step returns, for given implied rewards and classes."""
    r, d = torch.tensor(rewards), torch.tensor(desirable, dtype=torch.float32)
    return {"loss": torch.zeros_like(r), "reward": r, "desirable": d, "undesirable": 1 - d,
            "desirable_reward": r * d, "undesirable_reward": r * (1 - d), "kl": torch.zeros_like(r)}


def test_kto_step_figures_are_class_means():
    """One step of micro-batches [0.1 (D), 0.3 (U)] and [-0.2 (D), 0.5 (D)]:
    desirable_reward = (0.1 - 0.2 + 0.5) / 3 = 0.13333 (the old figure, the class sum over the batch size: 0.4 / 4 =
    0.1); undesirable_reward = 0.3 / 1 = 0.3 (old: 0.3 / 4 = 0.075); reward = mean of all = 0.7 / 4 = 0.175;
    desirable = 3 / 4. A step without undesirable examples logs undesirable_reward 0."""
    kto = methods.get("kto")
    got = entry.step_figures([kto_metrics([0.1, 0.3], [1, 0]), kto_metrics([-0.2, 0.5], [1, 1])], kto.CLASS_MEANS)
    assert got["desirable_reward"] == pytest.approx(0.4 / 3)
    assert got["undesirable_reward"] == pytest.approx(0.3)
    assert got["reward"] == pytest.approx(0.175) and got["desirable"] == pytest.approx(0.75)
    assert got["undesirable"] == pytest.approx(0.25)
    none = entry.step_figures([kto_metrics([0.2, 0.4], [1, 1])], kto.CLASS_MEANS)
    assert none["undesirable_reward"] == 0.0 and none["desirable_reward"] == pytest.approx(0.3)


def test_kto_final_class_means_from_the_logged_steps():
    """Two steps of 4: step 1 as above (desirable 0.1, -0.2, 0.5; undesirable 0.3), step 2 desirable 0.2,
    undesirable -0.1, -0.3, 0.0. Final class means over the epoch: desirable (0.4 + 0.2) / 4 = 0.15, undesirable
    (0.3 - 0.4) / 4 = -0.025, gap 0.175; reward (0.7 - 0.2) / 8 = 0.0625."""
    kto = methods.get("kto")
    steps = [[kto_metrics([0.1, 0.3], [1, 0]), kto_metrics([-0.2, 0.5], [1, 1])],
             [kto_metrics([0.2, -0.1], [1, 0]), kto_metrics([-0.3, 0.0], [0, 0])]]
    history = [{"step": k + 1, "samples": [], "lr": 0.0, **entry.step_figures(p, kto.CLASS_MEANS)} for k, p in enumerate(steps)]
    final = entry.last_epoch(history, kto, 2, 4)
    assert final["final_desirable_reward"] == pytest.approx(0.15)
    assert final["final_undesirable_reward"] == pytest.approx(-0.025)
    assert final["final_reward_gap"] == pytest.approx(0.175)
    assert final["final_reward"] == pytest.approx(0.0625)


def test_kto_step_reports_both_classes_for_its_class_means(tiny):
    """kto.step on the tiny policy: its per-example metrics carry desirable and undesirable (1 - desirable), and the
    step's class means are the means of `reward` over each class."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.inputs import data, models

    tok = models.load_tokenizer(tiny.policy_dir)
    rows = data.pairs_to_kto([{"prompt": f"A note on the {t}:", "chosen": f"good {t} .", "rejected": f"poor {t} , sadly ."}
                              for t in ("tea", "book", "song")])
    kto = methods.get("kto")
    recs, _ = kto.tokenize(rows, tok, 64, seed=1)
    for i, r in enumerate(recs):
        r["ref_logp"], r["ref_kl_logp"] = -30.0 + i, -31.0
    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval()
    spec = {"packing_samples": False, "beta": 0.1, "desirable_loss_weight": 1.0, "undesirable_loss_weight": 1.0}
    with torch.no_grad():
        _, met, _ = kto.step(model, spec, recs, models.pad_id(tok, tiny.policy_dir))
    d = torch.tensor([r["desirable"] for r in recs])
    assert met["undesirable"].tolist() == (~d).float().tolist()
    got = entry.step_figures([met], kto.CLASS_MEANS)
    assert got["desirable_reward"] == pytest.approx(met["reward"][d].mean().item(), rel=1e-6)
    assert got["undesirable_reward"] == pytest.approx(met["reward"][~d].mean().item(), rel=1e-6)
