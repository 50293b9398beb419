"""Evaluation during training (eval_dataset / eval_holdout / eval_steps), lr_scheduler and disable_dropout
(issue 24, part B): real jobs through the dpo and sft stages on the tiny model, pure checks beside them."""
import json
import math
import shutil
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from rlhf_core.inputs import data, models
from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.runtime import faults
from rlhf_core.runtime.jobs import JobFailed
from rlhf_core.train import batches, checkpoints, entry, launch, schedule
from stages import dpo, reference, sft
from tests.conftest import kill_training_jobs, tb_scalars


def committed_rows(uri, kind, rows):
    w = store.ArtifactWriter(uri, "data", {"n": len(rows), "kind": kind})
    if not w.existing():
        w.begin()
        w.write_table("rows.parquet", data.to_table(rows, kind))
        w.commit()
    return uri


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """32 reference pairs of the tiny policy, and that policy with attention dropout 0.5 in its config."""
    root = tmp_path_factory.mktemp("train-eval")
    pairs = committed_rows(str(root / "pairs"), "pairs", demo_task.preference_rows(32, 0))
    ref = reference.run(reference.Config(pairs_uri=pairs, ref_uri=tiny.policy_uri, output_uri=str(root / "ref"), max_len=64))
    drop = root / "policy-dropout"
    shutil.copytree(tiny.policy_dir, drop)
    cfg = json.loads((drop / "config.json").read_text())
    (drop / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.5}))
    return root, pairs, ref.uri, drop


def hf_lrs(name, lr, warm, total, min_ratio):
    """transformers.get_scheduler's learning rate at each of `total` optimizer steps."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    kw = {"min_lr_rate": min_ratio} if "min_lr" in name else {}  # as OpenRLHF's DeepSpeed strategy passes it
    sched = get_scheduler(name, opt, num_warmup_steps=warm, num_training_steps=total, scheduler_specific_kwargs=kw)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", schedule.NAMES)
def test_lr_schedule_equals_transformers(name):
    for total, ratio in ((10, 0.3), (7, 0.0), (5, 0.03), (8, 0.03), (64, 0.03)):
        warm = schedule.warmup_steps(ratio, total)
        ours = [2e-3 * schedule.lr_factor(name, s, warm, total, 0.1) for s in range(total)]
        assert ours == pytest.approx(hf_lrs(name, 2e-3, warm, total, 0.1), rel=1e-12, abs=1e-15), (total, ratio)


def test_first_step_of_a_warm_up():
    """OpenRLHF's default warm-up (ratio 0.03) over an 8-step run is 1 step: transformers' cosine_with_min_lr
    (OpenRLHF's default) runs that step at lr 0, cosine_warmup_with_min_lr at the peak; both end at min_lr_ratio's
    side of the cosine, the latter exactly on the last step."""
    warm = schedule.warmup_steps(0.03, 8)
    default = [schedule.lr_factor("cosine_with_min_lr", s, warm, 8, 0.1) for s in range(8)]
    no_waste = [schedule.lr_factor("cosine_warmup_with_min_lr", s, warm, 8, 0.1) for s in range(8)]
    assert warm == 1 and default[:2] == [0.0, 1.0] and no_waste[0] == 1.0
    assert no_waste[-1] == pytest.approx(0.1) and no_waste[1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 7)))


@pytest.mark.slow
def test_dpo_evaluates_on_eval_data_every_eval_steps_with_dropout_off(tiny, setup, tmp_path, caplog):
    """eval_dataset = a copy of the training data: its figures at the last step are the trained model's,
    recomputed here from its log-probs (the reference pass run with it); the final_* figures are the training
    steps' means. The policy's config has attention dropout 0.5; dpo's default disable_dropout switches it off,
    so policy == reference at step 1 (margin 0) and the saved config says 0. linear lr schedule in the history."""
    root, _, ref_uri, drop = setup
    out = tmp_path / "dpo"
    cfg = dpo.Config(policy_uri=str(drop), dataset_uri=ref_uri, eval_dataset=ref_uri, output_uri=str(out), max_len=64,
                     learning_rate=2e-3, train_batch_size=8, micro_train_batch_size=4, eval_steps=2, lr_scheduler="linear",
                     lr_warmup_ratio=0.25, use_tensorboard=True)
    with caplog.at_level("INFO", logger="rlhf_flows"):
        m = dpo.run(cfg)
    met = m.metrics
    assert met["steps_done"] == 4 and met["eval_rows"] == 32
    assert abs(met["first_reward_margin"]) < 1e-5  # dropout off: the policy's forward is the reference's
    trained = reference.run(reference.Config(pairs_uri=ref_uri, ref_uri=str(out), output_uri=str(tmp_path / "again"),
                                             max_len=64)).uri
    ref, now = store.read_table(ref_uri).to_pylist(), store.read_table(trained).to_pylist()
    c = [0.1 * (n["ref_chosen_logp"] - r["ref_chosen_logp"]) for r, n in zip(ref, now)]  # beta 0.1: implied rewards
    j = [0.1 * (n["ref_rejected_logp"] - r["ref_rejected_logp"]) for r, n in zip(ref, now)]
    expect = {"chosen_reward": sum(c) / 32, "rejected_reward": sum(j) / 32, "reward_margin": (sum(c) - sum(j)) / 32,
              "reward_accuracy": sum(a > b for a, b in zip(c, j)) / 32,
              "loss": sum(math.log1p(math.exp(-(a - b))) for a, b in zip(c, j)) / 32}
    for k, v in expect.items():
        assert met[f"eval_{k}"] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    assert met["eval_reward_margin"] > met["first_reward_margin"]
    log = json.loads((out / "training_log.json").read_text())
    # no pass over the training set after training: final_* are the (one) epoch's step means
    for k in ("loss", "reward_margin", "reward_accuracy"):
        assert met[f"final_{k}"] == pytest.approx(sum(h[k] for h in log) / len(log), rel=1e-9), k
    assert [h["step"] for h in log if "eval_loss" in h] == [2, 4]
    assert log[-1]["eval_reward_accuracy"] == met["eval_reward_accuracy"]
    assert "first_eval_loss" not in met
    assert [h["lr"] for h in log] == pytest.approx(hf_lrs("linear", 2e-3, 1, 4, 0.1), rel=1e-9)  # 0, 2e-3, 1.33e-3, 6.7e-4
    tb = tb_scalars(out / "tensorboard")
    assert tb["dpo/eval_reward_accuracy"] == [(h["step"], pytest.approx(h["eval_reward_accuracy"])) for h in log if "eval_loss" in h]
    assert [s for s, _ in tb["dpo/loss"]] == [1, 2, 3, 4]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval step")]
    assert [x.split(":")[0] for x in lines] == ["eval step 2", "eval step 4"] and "eval_reward_accuracy=" in lines[0]
    assert json.loads((out / "config.json").read_text())["attention_dropout"] == 0.0

    # disable_dropout=false: the same policy trains with its dropout, so its forward differs from the reference's
    on = dpo.run(cfg.model_copy(update={"disable_dropout": False, "eval_dataset": None, "eval_steps": None,
                                        "use_tensorboard": False, "train_batch_size": 32, "micro_train_batch_size": 16,
                                        "output_uri": str(tmp_path / "dpo-dropout"), "launcher": "python"}))
    assert abs(on.metrics["first_reward_margin"]) > 1e-3
    assert json.loads((tmp_path / "dpo-dropout" / "config.json").read_text())["attention_dropout"] == 0.5


def test_disable_dropout_in_process(tiny):
    """Two train-mode forwards of a model with dropout differ; after disable_dropout they are equal. LoRA's own
    dropout (lora_dropout) is left as set."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.policy_dir, attention_dropout=0.3)
    model = get_peft_model(model, LoraConfig(r=4, lora_dropout=0.2, target_modules=["q_proj"]))
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    lora = next(m for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    lora.p = 0.0  # only the model's own dropout acts in the first comparison
    torch.manual_seed(0)
    assert not torch.equal(model(ids).logits, model(ids).logits)
    assert entry.disable_dropout(model) > 0
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert model.get_base_model().config.attention_dropout == 0.0
    lora.p = 0.2
    entry.disable_dropout(model)
    assert lora.p == 0.2


@pytest.mark.slow
def test_sft_holdout_evaluates_each_epoch_and_a_resume_keeps_eval_history(tiny, s3_root, tmp_path, monkeypatch):
    """eval_holdout 0.2 of 40 rows: 8 rows never trained on, evaluated at each epoch's end (eval_steps unset,
    OpenRLHF's -1). The job is killed after its step-4 checkpoint (after epoch 1's eval); the rerun resumes and
    the history holds each evaluation once. eval_nll equals the saved model's NLL on the held-out rows."""

    uri = committed_rows(f"{s3_root}/sft-data", "sft", demo_task.sft_rows(40, 0))
    out = f"{s3_root}/sft-eval"
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=out, eval_holdout=0.2, max_epochs=2,
                     input_template=demo_task.INPUT_TEMPLATE, learning_rate=1e-3, train_batch_size=8,
                     micro_train_batch_size=4, max_len=48, lr_warmup_ratio=0.0, save_steps=4, use_tensorboard=True)
    killed = []

    def killer():
        deadline = time.time() + 240
        while time.time() < deadline:
            ck = [c for c in store.filesystem(out)[0].glob(f"{out.split('://')[1]}/checkpoints/*/{checkpoints.MARKER}")]
            if ck:
                break
            time.sleep(0.2)
        killed.extend(kill_training_jobs())

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    monkeypatch.setenv(faults.STEP_SLEEP, "0.3")  # slow steps: the kill lands mid-run
    with pytest.raises(JobFailed, match="killed by signal 9"):
        sft.run(cfg)
    monkeypatch.delenv(faults.STEP_SLEEP)
    th.join()
    assert killed and not store.committed_any(out)
    m = sft.run(cfg)
    met = m.metrics
    assert met["resumed_from_step"] == 4 and met["steps_done"] == 8
    assert met["eval_rows"] == 8 and met["samples_seen"] == 64 and met["rows"] == 32
    fs, path = store.filesystem(out)
    log = json.loads(fs.cat_file(f"{path}/training_log.json"))
    assert [h["step"] for h in log if "eval_nll" in h] == [4, 8]
    fs.get(f"{path}/tensorboard", str(tmp_path / "tb"), recursive=True)
    assert [s for s, _ in tb_scalars(tmp_path / "tb")["sft/eval_nll"]] == [4, 8]  # restored history replayed once

    # the held-out rows (the stage's own draw) under the committed model: the mean of each row's mean NLL
    from transformers import AutoModelForCausalLM

    from rlhf_core.inputs import model_inputs

    model_dir = model_inputs.fetch_model(out)
    tok = models.load_tokenizer(model_dir)
    fmt = data.Format(input_key="input", output_key="output", input_template=demo_task.INPUT_TEMPLATE)
    _, held = launch.split_eval(cfg, lambda ev: launch.load_rows(cfg, "sft", fmt, tok, eval=ev))
    recs, _ = batches.tokenize_sft(held, tok, 48)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    spec = {"packing_samples": False}
    with torch.no_grad():
        lp, n, _ = entry.forward(model, spec, [r["ids"] for r in recs], [r["start"] for r in recs], models.pad_id(tok, model_dir))
    assert met["eval_nll"] == pytest.approx(float((-lp / n).mean()), rel=1e-4)
    assert math.isfinite(met["eval_loss"])


def test_bad_eval_input_refused_before_work(tiny, setup, tmp_path):
    root, pairs, ref_uri, _ = setup
    base = dict(policy_uri=tiny.policy_uri, dataset_uri=pairs, output_uri=str(tmp_path / "o"), max_len=48,
                input_template=demo_task.INPUT_TEMPLATE)
    sft_base = {**base, "dataset_uri": committed_rows(str(root / "sft"), "sft", demo_task.sft_rows(16, 0))}
    with pytest.raises(ValidationError, match="eval_steps set but there is no eval data"):
        sft.Config(**sft_base, eval_steps=2)
    with pytest.raises(ValidationError, match="max_eval_samples set but there is no eval data"):
        sft.Config(**sft_base, max_eval_samples=2)
    with pytest.raises(ValidationError, match="eval_dataset or eval_holdout, not both"):
        sft.Config(**sft_base, eval_dataset=pairs, eval_holdout=0.1)
    with pytest.raises(ValidationError, match="eval_steps must be >= 1"):
        sft.Config(**sft_base, eval_holdout=0.1, eval_steps=0)
    with pytest.raises(ValidationError, match="lr_scheduler\n.*'cosine_with_min_lr', 'cosine_warmup_with_min_lr', 'constant', 'constant_with_warmup' or 'linear'"):
        sft.Config(**sft_base, lr_scheduler="cosine")
    # eval data of another schema: a raw file whose row lacks the output key; a committed artifact of pairs
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"input": "a", "response": "b"}) + "\n")
    with pytest.raises(data.DataError, match=r"eval.jsonl row 0: missing key 'output'"):
        sft.run(sft.Config(**sft_base, eval_dataset=str(bad)))
    with pytest.raises(data.DataError, match=r"pairs: sft data lacks column\(s\) \['input', 'output'\]"):
        sft.run(sft.Config(**sft_base, eval_dataset=pairs))
    # dpo: eval pairs without reference log-probs, or not an artifact at all
    d = dict(policy_uri=tiny.policy_uri, dataset_uri=ref_uri, output_uri=str(tmp_path / "o"), max_len=64)
    with pytest.raises(data.DataError, match=r"eval_dataset .*pairs: pairs lack \['ref_chosen_logp', 'ref_rejected_logp'\]"):
        dpo.run(dpo.Config(**d, eval_dataset=pairs))
    with pytest.raises(data.DataError, match=r"eval.jsonl: dpo evaluates on pairs with reference log-probs"):
        dpo.run(dpo.Config(**d, eval_dataset=str(bad)))
    with pytest.raises(data.DataError, match="eval_holdout 0.99 of 32 rows leaves none to train on"):
        dpo.run(dpo.Config(**d, eval_holdout=0.99))
    assert not store.committed_any(str(tmp_path / "o"))


def test_report_columns_carry_eval_figures():
    from flows.report import training_columns

    cols = training_columns("dpo", {"final_loss": 0.6, "final_reward_accuracy": 0.7, "eval_loss": 0.65,
                                    "eval_reward_accuracy": 0.55, "eval_rows": 32, "steps_done": 4})
    assert cols == {"dpo_loss": 0.6, "dpo_reward_accuracy": 0.7, "dpo_eval_loss": 0.65, "dpo_eval_reward_accuracy": 0.55,
                    "dpo_steps": 4}
