"""sft multiturn=true: the loss covers every assistant turn of a conversation (chat template applied), and
every turn's NLL falls; multiturn=false trains the last turn only. Bad input: rows that are not message
lists, a tokenizer without a chat template, settings multiturn does not read."""
import json
import random
import shutil

import pytest
import torch

from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.inputs.data import DataError
from rlhf_core.train.batches import tokenize_multiturn
from stages import sft
from stages.common import ConfigError


def conversation(rng: random.Random) -> list[dict]:
    """Three assistant turns with different word distributions: a positive review, a negative one, the thing."""
    thing = rng.choice(demo_task.THINGS)
    return [{"role": "user", "content": demo_task.prompt_for(thing)},
            {"role": "assistant", "content": demo_task.random_review(rng, p_pos=0.8, p_neg=0.0)},
            {"role": "user", "content": "And a bad one?"},
            {"role": "assistant", "content": demo_task.random_review(rng, p_pos=0.0, p_neg=0.8)},
            {"role": "user", "content": "What was it?"},
            {"role": "assistant", "content": f"the {thing} ."}]


def turn_nll(model_dir, recs) -> torch.Tensor:
    """Mean NLL of each assistant turn # (conversations, turns)."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.rl import losses

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in recs:
            ids = torch.tensor([r["ids"]])
            lp = losses.token_logprobs(model(input_ids=ids).logits, ids)[0]  # (T-1,): lp[t - 1] predicts token t
            out.append([-lp[a - 1:b - 1].mean().item() for a, b in r["start"]])
    return torch.tensor(out)


@pytest.mark.slow
def test_multiturn_sft_lowers_every_turn_and_single_turn_only_the_last(tiny, tmp_path):
    """32 three-turn conversations, 8 steps each way. multiturn=true: every turn's mean NLL falls by more
    than 20% (measured: 27-31%). multiturn=false (the last assistant message is the response): the last
    turn falls, while the earlier turns move less than a third as much as under multiturn=true (measured:
    under 5%)."""
    from rlhf_core.inputs import models

    rng = random.Random(0)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(32)))
    tok = models.load_tokenizer(tiny.policy_dir)
    recs, _ = tokenize_multiturn([json.loads(line) for line in data.read_text().splitlines()], tok, 128)
    assert all(len(r["start"]) == 3 for r in recs)
    fast = dict(policy_uri=tiny.policy_uri, dataset_uri=str(data), input_key="messages", learning_rate=2e-3, max_len=128,
                train_batch_size=8, micro_train_batch_size=8, max_epochs=2, lr_warmup_ratio=0.0, launcher="python")
    before = turn_nll(tiny.policy_dir, recs).mean(0)
    multi = sft.run(sft.Config(**fast, multiturn=True, output_uri=str(tmp_path / "multi")))
    single = sft.run(sft.Config(**fast, output_key=None, output_uri=str(tmp_path / "single")))
    assert multi.metrics["steps_done"] == single.metrics["steps_done"] == 8
    drop_multi = before - turn_nll(tmp_path / "multi", recs).mean(0)
    drop_single = before - turn_nll(tmp_path / "single", recs).mean(0)
    print(f"per-turn NLL before {before.tolist()}, drop multiturn {drop_multi.tolist()}, drop last-turn only {drop_single.tolist()}")
    assert (drop_multi > 0.2 * before).all(), (before, drop_multi)
    assert drop_single[2] > 0.2 * before[2], (before, drop_single)
    assert (drop_single[:2].abs() < drop_multi[:2] / 3).all(), (drop_multi, drop_single)


def test_multiturn_bad_input_is_refused_by_name(tiny, tmp_path):
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"messages": conversation(random.Random(1))}) + "\n" + json.dumps({"messages": "hi"}) + "\n")
    cfg = dict(policy_uri=tiny.policy_uri, output_uri=str(tmp_path / "o"), input_key="messages", multiturn=True,
               train_batch_size=2, micro_train_batch_size=2)
    with pytest.raises(DataError, match=r"flat.jsonl row 1: multiturn needs key 'messages' to be a list of \{role, content\} "
                                        r"messages, got str"):
        sft.run(sft.Config(**cfg, dataset_uri=str(flat)))
    no_bot = tmp_path / "no_assistant.jsonl"
    no_bot.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"no_assistant.jsonl row 0: key 'messages' has no assistant message"):
        sft.run(sft.Config(**cfg, dataset_uri=str(no_bot)))
    plain = tmp_path / "no_template"
    shutil.copytree(tiny.policy_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ConfigError, match=f"multiturn: the tokenizer of {plain} has no chat template"):
        sft.run(sft.Config(**{**cfg, "policy_uri": str(plain)}, dataset_uri=str(flat)))
    for bad in ({"pretrain_mode": True}, {"output_key": "answer"}, {"input_template": "User: {}"}):
        with pytest.raises(ValueError, match=f"multiturn reads whole conversations .* does not use {next(iter(bad))}"):
            sft.Config(**cfg, dataset_uri=str(flat), **bad)
    assert not store.committed_any(str(tmp_path / "o"))


def test_multiturn_spans_are_the_assistant_turns_padded_or_packed(tiny):
    """Each span decodes to exactly its turn as the template renders it (content + end-of-turn markup), the
    final turn with the EOS; padded and packed batches mark the same target tokens; a cut keeps what fits."""
    from rlhf_core.inputs import models
    from rlhf_core.train.batches import collate

    tok = models.load_tokenizer(tiny.policy_dir)
    conv = conversation(random.Random(3))
    (r,), cut = tokenize_multiturn([{"messages": conv}], tok, 128)
    assert cut == 0 and [tok.decode(r["ids"][a:b]) for a, b in r["start"]] == [
        conv[1]["content"] + "\n", conv[3]["content"] + "\n", conv[5]["content"] + "\n</s>"]
    other, _ = tokenize_multiturn([{"messages": conversation(random.Random(4))}], tok, 128)
    seqs, starts = [r["ids"], other[0]["ids"]], [r["start"], other[0]["start"]]
    padded, packed = collate(seqs, starts, tok.pad_token_id), collate(seqs, starts, tok.pad_token_id, packed=True)
    assert torch.equal(padded.targets()[2], packed.targets()[2]) and torch.equal(padded.targets()[3], packed.targets()[3])
    assert len(padded.targets()[2]) == sum(b - a for s in starts for a, b in s)
    (short,), cut = tokenize_multiturn([{"messages": conv}], tok, r["start"][1][0] + 2)
    assert cut == 1 and short["start"] == [r["start"][0], [r["start"][1][0], r["start"][1][0] + 2]]
    with pytest.raises(DataError, match="row 0: no assistant token within max_len 5"):
        tokenize_multiturn([{"messages": conv}], tok, 5)
