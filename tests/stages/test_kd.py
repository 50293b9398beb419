"""kd: distillation lowers the KL from student to teacher on held-out text (teacher = the tiny student after
an SFT, a plain HF folder); a teacher with another tokenizer or vocabulary size is refused naming both URIs."""
import json

import pytest
import torch

from rlhf_core.demo import demo_task
from rlhf_core.rl import losses
from rlhf_core import store
from rlhf_core.train.batches import collate, tokenize_sft
from rlhf_core.train.entry import target_logits
from stages import kd
from stages.common import ConfigError


def sft_file(path, n, seed):
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_task.sft_rows(n, seed)))
    return str(path)


def records(tok, n, seed):
    rows = [{"input": demo_task.INPUT_TEMPLATE.format(r["input"]), "output": r["output"]} for r in demo_task.sft_rows(n, seed)]
    return tokenize_sft(rows, tok, 48)[0]


def load(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def kl_to_teacher(student, teacher, recs, pad_id) -> float:
    """Mean KL(teacher || student) per response token of `recs`."""
    b = collate([r["ids"] for r in recs], [r["start"] for r in recs], pad_id)
    with torch.no_grad():
        _, kl = losses.distill_loss(target_logits(student, b), target_logits(teacher, b))
    return kl.mean().item()


@pytest.fixture(scope="module")
def teacher(tiny, tmp_path_factory):
    """The tiny policy after 24 SFT steps (plain AdamW, in process) on demo reviews: a plain HF folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    model = load(tiny.policy_dir).train()
    recs = records(tok, 192, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for k in range(24):
        mb = recs[(k * 8) % len(recs):][:8]
        b = collate([r["ids"] for r in mb], [r["start"] for r in mb], tok.pad_token_id)
        lp = losses.gathered_logprobs(target_logits(model, b), b.targets()[2])
        (-lp.mean()).backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.mark.slow
def test_kd_lowers_the_kl_to_the_teacher_on_held_out_text(tiny, teacher, tmp_path):
    """kd_coef 1 (pure distillation, so the drop is the teacher's doing; the mix is tested in
    tests/rlhf_core/train/test_methods.py), 8 steps over 64 rows, teacher_offload on: the held-out KL(teacher || student)
    per response token falls by more than half."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    held_out = records(tok, 32, seed=9)
    t = load(teacher)
    before = kl_to_teacher(load(tiny.policy_dir), t, held_out, tok.pad_token_id)
    m = kd.run(kd.Config(policy_uri=tiny.policy_uri, teacher_uri=str(teacher), dataset_uri=sft_file(tmp_path / "d.jsonl", 64, 1),
                         output_uri=str(tmp_path / "kd"), input_template=demo_task.INPUT_TEMPLATE, kd_coef=1.0,
                         teacher_offload=True, learning_rate=2e-3, train_batch_size=8, micro_train_batch_size=8, max_len=48,
                         max_epochs=1, lr_warmup_ratio=0.0, launcher="python"))
    after = kl_to_teacher(load(tmp_path / "kd"), t, held_out, tok.pad_token_id)
    assert m.stage == "kd" and m.metrics["steps_done"] == 8 and {i["name"] for i in m.inputs} >= {"policy", "teacher"}
    print(f"held-out KL(teacher || student) per token: {before:.4f} -> {after:.4f}")
    assert after < 0.5 * before, (before, after)
    assert m.metrics["last_kl"] < 0.5 * m.metrics["first_kl"] and m.metrics["final_kl"] < m.metrics["first_kl"]


def test_kd_refuses_a_teacher_with_another_tokenizer_or_vocabulary(tiny, teacher, tmp_path):
    from rlhf_core.demo import tiny as tiny_mod

    other_tok = tiny_mod.build_tokenizer(tmp_path / "tok", ["a b c d e f g", "other words here"], vocab_size=300)
    other = tiny_mod.build_model(tmp_path / "other", other_tok, seed=3, hidden=64, heads=1, intermediate=64, layers=1)
    wide = tmp_path / "wide"
    m = load(teacher)
    m.resize_token_embeddings(m.config.vocab_size + 8)
    m.save_pretrained(str(wide))
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(teacher)).save_pretrained(str(wide))  # the student's tokenizer, a wider embedding
    cfg = dict(policy_uri=tiny.policy_uri, dataset_uri=sft_file(tmp_path / "d.jsonl", 8, 1), output_uri=str(tmp_path / "o"),
               train_batch_size=8, micro_train_batch_size=8)
    with pytest.raises(ConfigError, match=f"student {tiny.policy_uri} and teacher {other} use different tokenizers"):
        kd.run(kd.Config(**cfg, teacher_uri=str(other)))
    with pytest.raises(ConfigError, match=rf"student {tiny.policy_uri} has vocab_size \d+ but teacher {wide} has \d+"):
        kd.run(kd.Config(**cfg, teacher_uri=str(wide)))
    assert not store.committed_any(str(tmp_path / "o"))
