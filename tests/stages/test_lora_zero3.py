"""LoRA under ZeRO-3 (issue 45 item 4; OpenRLHF's train_sft_mixtral_lora.sh runs it): real DeepSpeed jobs on CPU
(gloo). The base loads straight into ZeRO-3 partitions, peft's adapters go on top, and DeepSpeed partitions them
too; the save gathers only the adapter. Each test checks that the adapter trained, that every base weight is
bit-for-bit the base model's (read back from a ZeRO-3 checkpoint with DeepSpeed's zero_to_fp32: the engine's own
partitions, frozen base included), and, for sft, dpo and the MoE, that the saved adapter loaded with peft onto
the base gives the log-probs the trained engine gave on the eval batch (the job's eval figures after its last
step). rm and kto: the same but for the log-probs; the merged model at the root is peft's merge."""
import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core import store
from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core.inputs import models
from rlhf_core.runtime import faults
from rlhf_core.runtime.jobs import JobFailed
from rlhf_core.train import batches, checkpoints, entry
from stages import dpo, kto, reference, sft, train_rm
from tests.conftest import kill_training_jobs
from tests.stages.test_dpo import pairs_data
from tests.stages.test_sft import sft_data, weights

pytestmark = pytest.mark.slow  # whole trainings: 505 s for the file with -n0 on the 2 shared cores (load average ~30)


@pytest.fixture(scope="module", autouse=True)
def partitioned():
    """Every tensor partitioned over the ranks, the adapter's too (DeepSpeed keeps a tiny model's whole otherwise)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(entry.ZERO3_PERSISTENCE_ENV, "0")
        yield


LORA = dict(zero_stage=3, lora_rank=4, lora_alpha=8, learning_rate=1e-2, lr_warmup_ratio=0.0, max_len=48,
            train_batch_size=8, micro_train_batch_size=4)  # target_modules: every linear layer (OpenRLHF's default)
SCALE = LORA["lora_alpha"] / LORA["lora_rank"]


def adapter(out) -> dict[str, torch.Tensor]:
    return load_file(str(Path(out) / "adapter" / "adapter_model.safetensors"))


def assert_adapter_trained(lora: dict, base: dict, adapted: int) -> None:
    """`adapted` A / B pairs, each B moved off peft's zero start; a linear layer's whole (A (r, in), B (out, r)),
    not ZeRO-3 shards. (A fused MoE experts tensor's pair, peft's ParamWrapper, has r x experts rows.)"""
    a_keys = [k for k in lora if ".lora_A." in k]
    assert len(a_keys) == adapted, sorted(lora)
    for a in a_keys:
        b = lora[a.replace("lora_A", "lora_B")]
        assert b.abs().max() > 0, f"{a}: lora_B still zero (the adapter did not train)"
        w = base.get(a.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight"))
        if w is not None:
            assert lora[a].shape == (LORA["lora_rank"], w.shape[1]) and b.shape == (w.shape[0], LORA["lora_rank"]), a


def base_key(name: str) -> str | None:
    """The base model's name of a PEFT model's parameter (None: an adapter's own, LoRA or a trained head copy)."""
    if ".lora_" in name or ".modules_to_save." in name:
        return None
    return re.sub(r"(\.base_layer|\.original_module)+\.", ".", name.removeprefix("base_model.model."))


def checkpoint_state(out) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, every parameter of the PEFT model as the engine held it) from the newest committed checkpoint under
    {out}/checkpoints: DeepSpeed's zero_to_fp32 joins each rank's ZeRO-3 partitions (the frozen ones are saved as
    fragments beside the optimizer's)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = Path(out) / "checkpoints"
    steps = sorted(int(p.parent.name.split("-")[1]) for p in root.glob(f"step-*/{checkpoints.MARKER}"))
    assert steps, f"no committed checkpoint under {root}"
    return steps[-1], get_fp32_state_dict_from_zero_checkpoint(str(root), tag=f"step-{steps[-1]}")


def assert_base_frozen(state: dict, base: dict) -> None:
    seen = set()
    for name, v in state.items():
        if (k := base_key(name)) is not None:
            assert torch.equal(v, base[k]), f"{k}: the base weight moved in training"
            seen.add(k)
    assert seen == set(base), set(base) ^ seen
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in state.items())  # the adapter had trained by then


def loaded(model_dir, auto=None) -> dict[str, torch.Tensor]:
    """A model's parameters by module name, as transformers loads it (a Mixtral's saved per-expert tensors become
    the fused experts tensors its modules hold)."""
    from transformers import AutoModelForCausalLM

    model = (auto or AutoModelForCausalLM).from_pretrained(str(model_dir), dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def keep_checkpoints(monkeypatch):
    """The stage removes its checkpoints once the model is committed: kept here to read the engine's state."""
    monkeypatch.setattr(checkpoints, "remove_all", lambda *a, **k: None)


def response_logps(model, ids: list[int], start) -> torch.Tensor:
    """log p of each loss target of one sample (every token from `start`), # (n,): a plain HF forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[batches.loss_targets(start, len(ids))[1:]]


def peft_on_base(base_dir, out, auto=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = (auto or AutoModelForCausalLM).from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(Path(out) / "adapter")).eval()


# ---------------------------------------------------------------------------------------------- sft
SFT = dict(**LORA, num_gpus=2)  # two ranks: each holds half of every partitioned tensor


@pytest.fixture(scope="module")
def sft_z3(tiny, tmp_path_factory):
    """4 sft steps on 2 ranks; 4 eval samples, one micro-batch: rank 1 has none of its own to evaluate."""
    root = tmp_path_factory.mktemp("sft-z3")
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=sft_data(root, 32), eval_dataset=sft_data(root, 4, seed=1),
                     output_uri=str(root / "sft"), **SFT)
    return cfg, sft.run(cfg)


def test_sft_zero3_lora_trains_the_adapter_saves_it_whole_and_it_reproduces_the_engine(tiny, sft_z3):
    cfg, m = sft_z3
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 4
    assert [r["param_numel_local"] < r["param_numel"] for r in m.metrics["load_memory"]] == [True, True]  # sharded at load
    out, base = Path(cfg.output_uri), weights(tiny.policy_dir)
    lora = adapter(out)
    assert_adapter_trained(lora, base, adapted=2 * 7)  # q k v o gate up down in each of 2 layers
    merged = weights(out)  # lora_merge (the default): base + (alpha / r) B A at the root, as under ZeRO-2
    assert merged.keys() == base.keys()
    for k, w in base.items():
        a = "base_model.model." + k.replace(".weight", ".lora_A.weight")
        if a in lora:
            torch.testing.assert_close(merged[k], w + SCALE * lora[a.replace("lora_A", "lora_B")] @ lora[a], rtol=0, atol=1e-6)
        else:
            assert torch.equal(merged[k], w), k
    # the saved adapter on the base gives the trained engine's eval figure: each eval sample's mean NLL of its response
    tok = models.load_tokenizer(tiny.policy_dir)
    records, _ = batches.tokenize_sft(store.read_table(cfg.eval_dataset).to_pylist(), tok, cfg.max_len, model_dir=tiny.policy_dir)
    nll = lambda model: sum(-response_logps(model, r["ids"], r["start"]).mean().item() for r in records) / len(records)  # noqa: E731
    assert nll(peft_on_base(tiny.policy_dir, out)) == pytest.approx(m.metrics["eval_nll"], abs=1e-5)
    from transformers import AutoModelForCausalLM

    untrained = nll(AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval())
    assert abs(untrained - m.metrics["eval_nll"]) > 1e-2  # the comparison can tell the adapter apart


def test_sft_zero3_lora_resumed_after_a_kill_ends_with_the_uninterrupted_adapter(tiny, sft_z3, tmp_path, monkeypatch):
    """The same job with save_steps=1 and save_hf_ckpt, its launcher and both ranks SIGKILLed once a checkpoint is
    committed: the checkpoint holds the base bit-for-bit (frozen) and a trained adapter; the rerun resumes from it
    and ends with the adapter the uninterrupted run (the fixture's) saved. The HF folder written with each
    checkpoint (adapter and merged model) leaves the training model as it was."""
    cfg, straight = sft_z3
    out = tmp_path / "resumed"
    cfg = cfg.model_copy(update={"output_uri": str(out), "save_steps": 1, "save_hf_ckpt": True})
    killed = []

    def killer():
        deadline = time.time() + 600
        while time.time() < deadline and not list(out.glob(f"checkpoints/*/{checkpoints.MARKER}")):
            time.sleep(0.2)
        killed.extend(kill_training_jobs())

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    monkeypatch.setenv(faults.STEP_SLEEP, "1.5")  # slow steps: the kill lands before the last one
    with pytest.raises(JobFailed, match="killed by signal 9"):
        sft.run(cfg)
    monkeypatch.delenv(faults.STEP_SLEEP)
    th.join()
    assert killed and not store.committed_any(str(out))
    step, state = checkpoint_state(out)
    assert 1 <= step < 4
    assert_base_frozen(state, weights(tiny.policy_dir))
    m = sft.run(cfg)
    assert m.metrics["resumed_from_step"] == step and m.metrics["steps_done"] == 4
    hf = out / "hf_checkpoints" / "step-3"
    assert (hf / "adapter" / "adapter_model.safetensors").is_file() and weights(hf).keys() == weights(out).keys()
    resumed, uninterrupted = adapter(out), adapter(straight.uri)
    assert resumed.keys() == uninterrupted.keys()
    for k in resumed:
        torch.testing.assert_close(resumed[k], uninterrupted[k], rtol=1e-5, atol=1e-6, msg=k)
    assert m.metrics["eval_nll"] == pytest.approx(straight.metrics["eval_nll"], abs=1e-5)


# ---------------------------------------------------------------------------------------------- dpo, rm, kto
def test_dpo_zero3_lora_on_every_gpu_of_the_host(tiny, tmp_path, monkeypatch):
    """dpo with num_gpus all (one process on a host without GPUs): the adapter trains, the base stays as it was,
    and peft's base + adapter gives the engine's eval rewards beta (log pi - log ref) of chosen and rejected."""
    keep_checkpoints(monkeypatch)
    refs = [reference.run(reference.Config(pairs_uri=pairs_data(tmp_path, n, seed), ref_uri=tiny.policy_uri,
                                           output_uri=str(tmp_path / f"ref-{n}"), max_len=48))
            for n, seed in ((16, 0), (8, 1))]
    cfg = dpo.Config(policy_uri=tiny.policy_uri, dataset_uri=refs[0].uri, eval_dataset=refs[1].uri, beta=0.1,
                     output_uri=str(tmp_path / "dpo"), save_steps=1, num_gpus="all", **LORA)
    m = dpo.run(cfg)
    assert len(m.metrics["load_memory"]) == max(1, torch.cuda.device_count())  # ranks: this host's GPUs, or one
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 2
    base = weights(tiny.policy_dir)
    assert_adapter_trained(adapter(cfg.output_uri), base, adapted=2 * 7)
    step, state = checkpoint_state(cfg.output_uri)
    assert step == 1
    assert_base_frozen(state, base)
    tok = models.load_tokenizer(tiny.policy_dir)
    rows = store.read_table(refs[1].uri).to_pylist()
    records, _ = batches.tokenize_pairs(rows, tok, cfg.max_len, extra=("ref_chosen_logp", "ref_rejected_logp"),
                                        model_dir=tiny.policy_dir)
    model = peft_on_base(tiny.policy_dir, cfg.output_uri)
    for side in ("chosen", "rejected"):
        reward = sum(cfg.beta * (response_logps(model, r[f"{side}_ids"], r[f"{side}_start"]).sum().item()
                                 - r[f"ref_{side}_logp"]) for r in records) / len(records)
        assert reward == pytest.approx(m.metrics[f"eval_{side}_reward"], abs=1e-6), side
    assert abs(m.metrics["eval_reward_margin"]) > 1e-3  # the policy moved away from the reference


@pytest.mark.parametrize("method", ["rm", "kto"])
def test_reward_model_and_kto_zero3_lora(tiny, tmp_path, monkeypatch, method):
    """train_rm (a sequence-classification base: peft keeps a trained copy of the score head beside the frozen
    one) and kto under ZeRO-3 with LoRA: the adapter trains, the base stays bit-for-bit, and the saved adapter
    merged by peft onto the base is the model the stage saved at the root (rm: with its reward statistics)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    keep_checkpoints(monkeypatch)
    out = tmp_path / method
    common = dict(dataset_uri=pairs_data(tmp_path, 16), output_uri=str(out), save_steps=1, **LORA)
    if method == "rm":
        m = train_rm.run(train_rm.Config(base_uri=tiny.reward_uri, **common))
        base_dir, auto = tiny.reward_dir, AutoModelForSequenceClassification
    else:
        m = kto.run(kto.Config(policy_uri=tiny.policy_uri, **{**common, "train_batch_size": 16, "micro_train_batch_size": 8}))
        base_dir, auto = tiny.policy_dir, AutoModelForCausalLM
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] >= 2
    base = weights(base_dir)
    lora = adapter(out)
    assert_adapter_trained(lora, base, adapted=2 * 7)
    if method == "rm":  # the trained head copy is saved with the adapter, and moved; the merged config has the stats
        head = [k for k in lora if ".score." in k]
        assert head and not torch.equal(lora[head[0]], base["score.weight"]), head
        conf = json.loads((out / "config.json").read_text())
        assert (conf["reward_mean"], conf["reward_std"]) == (m.metrics["reward_mean"], m.metrics["reward_std"])
    _, state = checkpoint_state(out)
    assert_base_frozen(state, base)
    merged = peft_on_base(base_dir, out, auto).merge_and_unload().state_dict()
    saved = weights(out)
    assert saved.keys() <= merged.keys()
    for k, v in saved.items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6, msg=k)


# ---------------------------------------------------------------------------------------------- MoE
def test_mixtral_zero3_lora_as_openrlhfs_script_runs_it(tmp_path, monkeypatch):
    """The zoo's tiny Mixtral (4 experts, top 2) the way train_sft_mixtral_lora.sh trains Mixtral-8x7B: ZeRO-3 over
    2 ranks (transformers' per-expert checkpoint tensors fused as they load into partitions), LoRA on every linear
    layer, packed samples, the router's load-balancing loss (aux_loss_coef 0.001). The adapter
    trains, the base (experts and router included) stays bit-for-bit, and peft's base + adapter reproduces the
    engine's eval NLL."""
    keep_checkpoints(monkeypatch)
    policy = tiny_mod.build_zoo_model(tmp_path / "mixtral", "mixtral", demo_task.corpus(0))
    cfg = sft.Config(policy_uri=str(policy), dataset_uri=sft_data(tmp_path, 16), eval_dataset=sft_data(tmp_path, 8, seed=1),
                     output_uri=str(tmp_path / "sft"), packing_samples=True, aux_loss_coef=0.001, save_steps=1, **SFT)
    m = sft.run(cfg)
    assert m.metrics["steps_done"] == 2 and m.metrics["last_aux_loss"] > 0
    base = loaded(policy)
    lora = adapter(cfg.output_uri)
    assert_adapter_trained(lora, base, adapted=2 * 7)  # q k v o, the router, the experts' two fused tensors (per layer)
    assert any(".experts." in k for k in lora)
    _, state = checkpoint_state(cfg.output_uri)
    assert_base_frozen(state, base)
    tok = models.load_tokenizer(policy)
    records, _ = batches.tokenize_sft(store.read_table(cfg.eval_dataset).to_pylist(), tok, cfg.max_len, model_dir=policy)
    model = peft_on_base(policy, cfg.output_uri)
    nll = sum(-response_logps(model, r["ids"], r["start"]).mean().item() for r in records) / len(records)
    assert nll == pytest.approx(m.metrics["eval_nll"], abs=1e-5)
