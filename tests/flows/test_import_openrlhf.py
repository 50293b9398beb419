"""`rlhf-flows import-openrlhf`: OpenRLHF's own documented commands (tests/flows/openrlhf_commands/, each file
citing its source and commit) become stage YAML that validates against the stage Configs, every flag of the
command is either a commented key or listed with its reason, both dialects give the same YAML, bad input is
one error line, and an imported SFT, DPO and PPO command, scaled down with the tiny offline models, run
and commit."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from flows import cli, openrlhf_import as imp

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ROOT / "tests" / "flows" / "openrlhf_commands"
FILES = sorted(COMMANDS.glob("*.sh"))


def imported(name: str) -> tuple[str, dict]:
    text = imp.import_text((COMMANDS / name).read_text(), name)
    return text, yaml.safe_load(text)


def host_refused(text: str) -> set[tuple[str, str]]:
    """(section, key) the header names as refused on this host only (no CUDA device)."""
    block = text.split("these keys are refused", 1)[1].split("\n# openrlhf", 1)[0] if "keys are refused" in text else ""
    return {tuple(m.split(".")) for m in re.findall(r"^#   (\w+\.\w+):", block, re.M)}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_each_documented_command_converts_validates_and_drops_no_flag(path):
    text, data = imported(path.name)
    refused = host_refused(text)
    commands = imp.find_commands(path.read_text())
    assert commands, path.name
    for cmd in commands:
        for section in imp.convert(cmd).sections:
            keys = {k: v for k, v in data[section].items() if (section, k) not in refused}
            imp.config_class(section).model_validate(keys)  # the printed YAML loads as the stage's config
        for flag, _ in [*cmd.launcher, *cmd.flags]:  # each flag: a key's comment or a listed reason
            assert re.search(rf"(# |#   )--{re.escape(flag)}( |$|:)", text, re.M), f"{path.name}: --{flag} dropped"
    assert all(line.startswith("#") or line.startswith(" ") or line.endswith(":") for line in text.splitlines() if line)


@pytest.mark.parametrize("flat,dotted", [("train_sft_v0.9.10.sh", "train_sft_v0.11.0.sh"),
                                         ("train_dpo_v0.9.10.sh", "train_dpo_v0.11.0.sh"),
                                         ("train_rm_v0.9.10.sh", "train_rm_v0.11.0.sh"),
                                         ("train_ppo_ray_v0.9.10.sh", "train_ppo_ray_v0.11.0.sh"),
                                         ("readme_ppo_v0.9.10.sh", "readme_ppo_v0.11.0.sh")])
def test_both_dialects_give_the_same_yaml(flat, dotted):
    (t9, a), (t11, b) = imported(flat), imported(dotted)
    assert a == b
    assert "(v0.9 flat flags)" in t9 and "(v0.10+ dotted flags)" in t11


def test_keys_values_and_comments_spot_checked():
    sft9, d9 = imported("train_sft_v0.9.10.sh")
    sft11, _ = imported("train_sft_v0.11.0.sh")
    assert re.search(r"^  micro_train_batch_size: 2 +# --micro_train_batch_size 2$", sft9, re.M)
    assert re.search(r"^  micro_train_batch_size: 2 +# --train.micro_batch_size 2$", sft11, re.M)
    assert re.search(r"^  save_steps: 0 +# --save_steps -1$", sft9, re.M)  # OpenRLHF -1 = never
    s = d9["sft"]
    assert (s["policy_uri"], s["dataset_uri"], s["output_uri"]) == ("./hub/meta-llama/Meta-Llama-3-8B", "./hub/Open-Orca/OpenOrca",
                                                                     "./checkpoint/llama3-8b-sft")
    assert "meta-llama/Meta-Llama-3-8B is a hub id; this project never downloads: download it to ./hub/meta-llama/Meta-Llama-3-8B" in sft9
    assert (s["input_key"], s["output_key"], s["learning_rate"], s["bf16"], s["packing_samples"]) == \
        ("question", "response", 5e-6, True, True)
    # the script omits --input_template (no --apply_chat_template): OpenRLHF formats with its default template
    assert s["input_template"] == "User: {}\nAssistant: " and "(OpenRLHF's default '--input_template" in sft9
    assert "--eval_steps -1: no --eval_dataset" in sft9

    dpo, d = imported("train_dpo_v0.9.10.sh")
    assert list(d) == ["prepare", "reference", "dpo"]  # the order they run in, as the header says
    assert "`rlhf-flows stage prepare --config THIS_FILE` then `rlhf-flows stage reference" in dpo
    assert d["prepare"]["kind"] == "pairs" and d["reference"]["pairs_uri"] == d["prepare"]["output_uri"]
    assert d["dpo"]["dataset_uri"] == d["reference"]["output_uri"]
    assert d["reference"]["ref_uri"] == d["dpo"]["policy_uri"] == "./hub/OpenRLHF/Llama-3-8b-sft-mixture"
    for k in ("max_len", "bf16", "zero_stage", "packing_samples"):  # the reference pass computes as dpo trains
        assert d["reference"][k] == d["dpo"][k], k

    ppo, p = imported("train_ppo_ray_v0.9.10.sh")
    q = p["ppo"]
    assert (q["rollout_backend"], q["weight_sync_backend"], q["vllm_num_engines"], q["actor_learning_rate"]) == \
        ("vllm", "object_store", 4, 5e-7)  # --vllm_sync_backend nccl with TP 2 engines: the stage's TP path
    assert "--vllm_sync_backend nccl (TP > 1 engines: object_store here)" in ppo
    assert q["generate_max_len"] == 2048 - 1024 and "(--max_len 2048 minus prompt_max_len)" in ppo
    assert "--ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf: checkpoints go to" in ppo

    rs, r = imported("rejection_sampling_v0.9.5.sh")  # three commands, variables set earlier in the script
    assert list(r) == ["generate", "score", "sft"]
    assert r["generate"]["iter"] == 0 and r["generate"]["rollout_batch_size"] == 10240
    assert r["score"]["samples_uri"] == r["generate"]["output_uri"] == "./checkpoint/llama-3-8b-rejection/generate.jsonl"
    assert "--post_processor rs: a separate stage: filter" in rs and r["sft"]["input_template"] is None  # --input_template ""


def _fails(argv, capsys, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-flows: error: ") and message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_bad_input_is_one_named_error_line(tmp_path, capsys):
    f = tmp_path / "cmd.sh"
    f.write_text("deepspeed --module openrlhf.cli.train_foo --pretrain x\n")
    _fails(["import-openrlhf", str(f)], capsys, "openrlhf.cli.train_foo (line 1) is not an OpenRLHF module this imports")
    f.write_text("deepspeed --module openrlhf.cli.train_sft \\\n  --pretrain x --micro_train_batch_size two\n")
    _fails(["import-openrlhf", str(f)], capsys, "--micro_train_batch_size 'two': Input should be a valid integer")
    f.write_text("python -m openrlhf.cli.train_ppo_ray --pretrain x --prompt_data p --zero_stage 4\n")
    _fails(["import-openrlhf", str(f)], capsys, "--zero_stage '4'")
    f.write_text("deepspeed --module openrlhf.cli.train_sft --pretrain x --train_batch_size 3 --micro_train_batch_size 2 --dataset d\n")
    _fails(["import-openrlhf", str(f)], capsys, "train_batch_size 3 is not divisible")
    f.write_text("deepspeed --num_gpus 2 --module openrlhf.cli.train_sft --pretrain x\n")
    _fails(["import-openrlhf", str(f)], capsys, "sft.dataset_uri: Field required (the command gives no --dataset)")
    f.write_text("deepspeed --module openrlhf.cli.batch_inference --eval_task ppl --pretrain x\n")
    _fails(["import-openrlhf", str(f)], capsys, "--eval_task ppl: no counterpart (generate, generate_vllm, rm)")
    f.write_text("# a comment naming openrlhf.cli.train_sft\necho deepspeed\n")
    _fails(["import-openrlhf", str(f)], capsys, "no OpenRLHF command")
    _fails(["import-openrlhf", str(tmp_path / "nope.sh")], capsys, "nope.sh")


def test_the_readme_command_works_as_written(monkeypatch, capsys):
    lines = re.findall(r"rlhf-flows (import-openrlhf [^`\n]*)", (ROOT / "docs" / "how-to" / "import-openrlhf.md").read_text())
    assert lines
    monkeypatch.chdir(ROOT)
    for line in lines:
        assert cli.main(line.split()) == 0, line  # as written, from the repo root, to stdout
        out = capsys.readouterr().out
        assert out.startswith("# Imported from") and yaml.safe_load(out)


def test_stdin_in_file_out(tmp_path, monkeypatch):
    import io

    script = (COMMANDS / "readme_ppo_v0.11.0.sh").read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert cli.main(["import-openrlhf", "-", "-o", str(tmp_path / "ppo.yaml")]) == 0
    assert (tmp_path / "ppo.yaml").read_text() == imp.import_text(script, "stdin")


def test_imported_sft_command_runs_scaled_down(tiny, tmp_path, capsys):
    """OpenRLHF's train_sft.sh (v0.11.0, dotted) imported through the CLI, then run by `rlhf-flows stage sft
    --config` with the hub ids replaced by the tiny model and a jsonl of OpenOrca's keys (question /
    response), sizes shrunk by overrides: it commits with the script's packing, keys and template."""
    from rlhf_core.demo import demo_task
    from rlhf_core import store

    rows = [{"question": r["input"], "response": r["output"]} for r in demo_task.sft_rows(16)]
    src = tmp_path / "openorca.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sft.yaml"
    assert cli.main(["import-openrlhf", str(COMMANDS / "train_sft_v0.11.0.sh"), "-o", str(out)]) == 0
    target = tmp_path / "sft"
    over = [f"sft.policy_uri={tiny.policy_uri}", f"sft.dataset_uri={src}", f"sft.output_uri={target}",
            "sft.max_len=48", "sft.max_samples=16", "sft.train_batch_size=8", "sft.micro_train_batch_size=4",
            "sft.attn_implementation=sdpa", "sft.bf16=false"]  # flash_attention_2 and bf16: CUDA's
    assert cli.main(["stage", "sft", "--config", str(out), *[o.split(".", 1)[1] for o in over]]) == 0
    m = store.read_manifest(str(target))
    assert m.stage == "sft" and m.metrics["steps_done"] == m.metrics["planned_steps"] == 2
    assert (m.config["packing_samples"], m.config["gradient_checkpointing"], m.config["input_key"],
            m.config["output_key"], m.config["learning_rate"]) == (True, True, "question", "response", 5e-6)
    assert "committed at" in capsys.readouterr().out


def test_imported_dpo_command_runs_scaled_down(tiny, tmp_path):
    """OpenRLHF's train_dpo.sh (v0.9.10, flat flags) imported, then its three stages (prepare pairs -> reference
    log-probs -> dpo) run by `rlhf-flows stage NAME --config` with the tiny model and pairs in its dataset's shape
    (chosen / rejected message lists, chat template), sizes shrunk: dpo commits with the script's settings."""
    from rlhf_core.demo import demo_task
    from rlhf_core import store

    rows = [{k: [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[k]}]
             for k in ("chosen", "rejected")} for r in demo_task.preference_rows(16)]
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dpo.yaml"
    assert cli.main(["import-openrlhf", str(COMMANDS / "train_dpo_v0.9.10.sh"), "-o", str(out)]) == 0
    pairs, ref, dpo = (tmp_path / name for name in ("pairs", "ref", "dpo"))
    cpu = ["max_len=64", "bf16=false", "attn_implementation=sdpa"]  # flash_attention_2 and bf16: CUDA's
    assert cli.main(["stage", "prepare", "--config", str(out), f"data={src}", f"tokenizer_uri={tiny.policy_uri}",
                     f"output_uri={pairs}"]) == 0
    assert cli.main(["stage", "reference", "--config", str(out), f"pairs_uri={pairs}", f"ref_uri={tiny.policy_uri}",
                     f"output_uri={ref}", *cpu]) == 0
    assert cli.main(["stage", "dpo", "--config", str(out), f"dataset_uri={ref}", f"policy_uri={tiny.policy_uri}",
                     f"output_uri={dpo}", "train_batch_size=8", *cpu]) == 0
    m = store.read_manifest(str(dpo))
    assert m.stage == "dpo" and m.metrics["steps_done"] == m.metrics["planned_steps"] == 2
    assert (m.config["beta"], m.config["learning_rate"], m.config["zero_stage"], m.config["packing_samples"],
            m.config["micro_train_batch_size"]) == (0.1, 5e-7, 3, True, 1)


def test_imported_ppo_command_runs_scaled_down(tiny, tmp_path):
    """OpenRLHF's train_ppo_ray_hybrid_engine.sh (v0.11.0) imported, scaled down to the tiny models and CPU
    placement, loads as `rlhf-flows stage ppo --config` loads it and runs one step with the script's own
    settings (ZeRO-3, packing, dynamic batches, every role colocated, GAE critic, IS correction). Unchanged, the
    file is refused on a host without CUDA naming the keys its header lists."""
    import torch

    from stages import ppo
    from stages.common import ConfigError, load_config

    text, data = imported("train_ppo_ray_v0.11.0.sh")
    raw = tmp_path / "ppo_raw.yaml"
    raw.write_text(text)
    refused = host_refused(text)
    if not torch.cuda.is_available():
        assert {k for _, k in refused} == {"vllm_enable_sleep", "vllm_tensor_parallel_size", "deepspeed_enable_sleep"}
        with pytest.raises(ConfigError, match="vllm_enable_sleep"):
            load_config(ppo.Config, raw, section="ppo")
    scaled = {k: v for k, v in data["ppo"].items() if ("ppo", k) not in refused}
    scaled = {k: v for k, v in scaled.items() if k not in ("enforce_eager", "vllm_gpu_memory_utilization", "vllm_num_engines")}
    out = tmp_path / "ppo.yaml"
    out.write_text(yaml.safe_dump({"ppo": scaled}))
    cfg = load_config(ppo.Config, out, [f"policy_uri={tiny.policy_uri}", f"reward_model_uri={tiny.reward_uri}",
                                        "prompts_uri=prompts.jsonl", f"output_uri={tmp_path / 'out'}", "rollout_backend=hf",
                                        "actor_num_gpus_per_node=1", "critic_num_gpus_per_node=1", "ref_num_gpus_per_node=1",
                                        "rollout_batch_size=4", "train_batch_size=8", "micro_train_batch_size=2",
                                        "micro_rollout_batch_size=2", "max_samples=4", "bf16=false", "n_samples_per_prompt=2",
                                        "generate_max_len=8", "prompt_max_len=32", "num_episodes=1"], section="ppo")
    assert (cfg.zero_stage, cfg.packing_samples, cfg.use_dynamic_batch, cfg.colocate_all_models, cfg.init_kl_coef,
            cfg.critic_learning_rate, cfg.input_key, cfg.apply_chat_template, cfg.enable_vllm_is_correction) == \
        (3, True, True, True, 0.01, 9e-6, "context_messages", True, True)
    from rlhf_core.demo import demo_task
    from rlhf_core import store

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"context_messages": [{"role": "user", "content": p["input"]}]}) + "\n"
                               for p in demo_task.prompts(4)))
    m = ppo.run(cfg.model_copy(update={"prompts_uri": str(prompts)}))
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] >= 1
    assert store.read_manifest(str(tmp_path / "out")).config["packing_samples"] is True


def test_the_flags_issue_27_added_map_to_their_keys():
    """--pretrain_data / --ptx_coef, --reward_pretrain a,b, --value_head_prefix, --save_hf_ckpt (with --save_steps;
    without it OpenRLHF writes no checkpoint, so the flag is listed as doing nothing) and batch_inference's
    --max_num_seqs land on their keys, in both dialects."""
    flat = ("python3 -m openrlhf.cli.train_ppo_ray --pretrain ./p --reward_pretrain ./a,./b --prompt_data ./q.jsonl "
            "--pretrain_data ./sft.jsonl --ptx_coef 0.1 --value_head_prefix value_head --save_hf_ckpt --save_steps 5 "
            "--vllm_num_engines 0 --save_path ./out")
    d = yaml.safe_load(imp.import_text(flat, "ppo.sh"))["ppo"]
    assert (d["pretrain_data"], d["ptx_coef"], d["reward_model_uri"], d["value_head_prefix"], d["save_hf_ckpt"],
            d["vllm_num_engines"]) == ("./sft.jsonl", 0.1, "./a,./b", "value_head", True, 0)
    dotted = yaml.safe_load(imp.import_text(flat.replace("--value_head_prefix", "--ds.value_head_prefix")
                                            .replace("--save_hf_ckpt", "--ckpt.save_hf"), "ppo.sh"))["ppo"]
    assert (dotted["value_head_prefix"], dotted["save_hf_ckpt"]) == ("value_head", True)
    text = imp.import_text(flat.replace(" --save_steps 5", ""), "ppo.sh")
    assert "save_hf_ckpt" not in yaml.safe_load(text)["ppo"] and "--save_hf_ckpt: no --save_steps" in text
    gen = yaml.safe_load(imp.import_text("deepspeed --module openrlhf.cli.batch_inference --eval_task generate_vllm "
                                         "--pretrain ./p --dataset ./q.jsonl --output_path ./o.jsonl --max_num_seqs 64",
                                         "gen.sh"))["generate"]
    assert gen["max_num_seqs"] == 64
    _, readme = imported("readme_ppo_v0.11.0.sh")  # `ray job submit --address=http://...`: submitted there as a Ray Job
    assert readme["ppo"]["ray_address"] == "http://127.0.0.1:8265"
