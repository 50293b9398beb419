"""`rlhf-flows import-openrlhf`: every example script OpenRLHF ships that launches `openrlhf.cli.*` (at v0.11.0,
v0.10.1 and v0.9.10, and v0.9.5's kto / kd / prm / csft / iterative-DPO / rejection-sampling scripts; copies in
tests/flows/openrlhf_commands/TAG/, each citing its source path, tag and commit) imports into a stage or flow
config that validates, or is refused in one line with the true reason; every flag of every command is a
commented key or listed with its reason; OpenRLHF's defaults of the script's version are carried; bad input is
one error line; an imported SFT, DPO and PPO command, scaled down with the tiny offline models, run and commit.
Issue 43: scripts written the way research repositories write theirs (tests/flows/openrlhf_commands/research/,
this project's own text) are read as bash and OpenRLHF read them, form by form; the importer's own accounting of
every flag runs on every script here."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from flows import cli
from flows.openrlhf import importer as imp
from flows.openrlhf.shell import find_commands

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ROOT / "tests" / "flows" / "openrlhf_commands"
TAGS = {"v0.11.0": "3c3be6234e0cb353e76bb8019947db9dfe99fca7", "v0.10.1": "33f9d72fbac7ada09979fd0873c27b1cca0cc0e1",
        "v0.9.10": "6f58d4183dfa2ff2de396f856350ed4aca395645", "v0.9.5": "c0e2ee2473cd115863630599cc3d51917d4b7c3e"}
SCRIPTS = sorted(COMMANDS.glob("v*/*.sh"))
SERVE = "rlhf-flows serve-rm OpenRLHF/Llama-3-8b-rm-700k --port 5000 --max-len 8192 --batch-size 16 --host 0.0.0.0 --value-head-prefix score"
# What each script becomes: its sections (a stage chain), "flow NAME", or "refused: TEXT" (the one error line).
EXPECTED = {
    "serve_remote_rm.sh": f"refused: serves a reward model over HTTP (a server, not a stage): run `{SERVE}`",
    "train_dapo_ray_hybrid_engine.sh": ["ppo"], "train_dpo_llama.sh": ["prepare", "reference", "dpo"],
    "train_nonrl_slurm.sh": ["prepare", "reference", "dpo"], "train_ppo_ray_hybrid_engine.sh": ["ppo"],
    "train_ppo_ray_slurm.sh": ["ppo"], "train_ppo_with_reward_fn.sh": ["ppo"], "train_prorlv2_math_hybrid_engine.sh": ["ppo"],
    "train_reinforce_baseline_hybrid_engine.sh": ["ppo"], "train_reinforce_baseline_ray_agent_async.sh": ["ppo"],
    "train_rm.sh": ["train_rm"], "train_sft.sh": ["sft"],
    "train_sft_mixtral_lora.sh": ["sft"],
    "train_vlm_math_hybrid_engine.sh": "refused: is a vision-language run",
    "train_conditional.sh": ["prepare", "score", "filter", "sft"], "train_iterative_dpo.sh": "flow iterative-dpo",
    "train_knowledge_distillation.sh": ["kd"], "train_kto_llama.sh": ["kto"], "train_prm_mistral.sh": ["train_prm"],
    "train_rejection_sampling_llama.sh": "flow raft",
}


REMOVED = ("train_kto", "train_kd", "train_prm", "batch_inference")  # modules OpenRLHF dropped after v0.9.5
RESEARCH = COMMANDS / "research"  # scripts in the way research repositories write them (this project's own text)


def imported(name: str) -> tuple[str, dict]:
    path = COMMANDS / name
    text = imp.import_text(path.read_text(), name, path.parent)
    return text, yaml.safe_load(text)


def host_refused(text: str) -> set[tuple[str, str]]:
    """(section, key) the header names as refused on this host only (no CUDA device)."""
    m = re.search(r"these keys are refused.*\n((?:#   .*\n)*)", text)
    return set(re.findall(r"^#   (\w+)\.(\w+)$", m.group(1), re.M)) if m else set()


def listed(text: str) -> list[str]:
    return re.findall(r"^#   (--.*)$", text, re.M)


def test_the_copies_are_every_script_of_every_tag():
    """47 scripts (34 distinct: v0.10.1's are v0.9.10's but for its VLM one); each copy's first line names
    OpenRLHF's path, the tag and its commit, and below it the script as OpenRLHF has it."""
    per_tag = {tag: sorted(p.name for p in SCRIPTS if p.parent.name == tag) for tag in TAGS}
    assert {t: len(n) for t, n in per_tag.items()} == {"v0.11.0": 14, "v0.10.1": 14, "v0.9.10": 13, "v0.9.5": 6}
    assert set(per_tag["v0.11.0"]) - set(per_tag["v0.9.10"]) == {"train_vlm_math_hybrid_engine.sh"}
    assert len({p.read_text().split("\n", 1)[1] for p in SCRIPTS}) == 34
    for p in SCRIPTS:
        head, body = p.read_text().split("\n", 1)
        assert head == f"# OpenRLHF examples/scripts/{p.name} at {p.parent.name} (commit {TAGS[p.parent.name]}), " \
                       "verbatim below this header (OpenRLHF is Apache-2.0).", p
        assert "openrlhf.cli." in body or "source ./${training_script}" in body, p
    assert set(EXPECTED) == {p.name for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_script_imports_or_is_refused_in_one_line_and_drops_no_flag(path):
    """The outcome EXPECTED names; an imported config validates (the stage Configs, or the flow's parameters
    and every stage config it builds) and each flag of each command is a key's comment or listed with its
    reason; a refusal is one line naming the command and why."""
    name, want = f"{path.parent.name}/{path.name}", EXPECTED[path.name]
    if isinstance(want, str) and want.startswith("refused: "):
        with pytest.raises(imp.CommandError) as e:
            imported(name)
        assert want.removeprefix("refused: ") in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert str(e.value).startswith("openrlhf.cli.")
        return
    text, data = imported(name)
    if isinstance(want, list):
        assert list(data) == want
        for section in want:  # ppo as for the GPU cluster the script names (its resources checked when joined)
            gpu = {"accelerator": "gpu", "ray_address": data[section].get("ray_address", "h:6379")} if section == "ppo" else {}
            imp.config_class(section).model_validate({**data[section], **gpu})
        for cmd in find_commands(path.read_text(), path.parent):  # the version whose defaults each command got
            version = "v0.11.0" if "dotted" in cmd.dialect else "v0.9.5" if cmd.module in REMOVED else "v0.9.10"
            assert f"# openrlhf.cli.{cmd.module} ({cmd.dialect}; OpenRLHF {version}'s defaults): run `rlhf-flows stage" in text
    else:
        assert f"run `rlhf-flows run {want.split()[1]} --config THIS_FILE`" in text
    for cmd in find_commands(path.read_text(), path.parent):
        for flag, _ in [*cmd.launcher, *cmd.flags]:
            assert re.search(rf"(# |#   )--{re.escape(flag)}( |$|:)", text, re.M), f"{name}: --{flag} dropped"
    assert all(line.startswith("#") or line.startswith(" ") or line.endswith((":", "{}")) or ": " in line
               for line in text.splitlines() if line)
    assert "./hub/" not in text  # hub ids are written as given


@pytest.mark.parametrize("name", ["train_sft.sh", "train_dpo_llama.sh", "train_rm.sh", "train_ppo_ray_hybrid_engine.sh",
                                  "train_ppo_ray_slurm.sh", "train_ppo_with_reward_fn.sh", "train_nonrl_slurm.sh"])
def test_both_dialects_give_the_same_yaml_but_their_versions_defaults(name):
    """v0.9.10 (flat flags) and v0.11.0 (dotted) of one script: the same YAML, except the defaults that changed
    between the versions (train_ppo_ray's micro batches: 4 / 8 in v0.9.10, 1 / 1 in v0.11.0)."""
    (t9, a), (t11, b) = imported(f"v0.9.10/{name}"), imported(f"v0.11.0/{name}")
    changed = {"micro_train_batch_size", "micro_rollout_batch_size"}
    for d in (a, b):
        for section in d.values():
            for k in changed & set(section):
                section.pop(k)
    assert a == b
    assert "(v0.9 flat flags; OpenRLHF v0.9.10's defaults)" in t9 and "(v0.10+ dotted flags; OpenRLHF v0.11.0's defaults)" in t11
    if name == "train_ppo_ray_hybrid_engine.sh":  # neither script sets them: each version's own default
        assert "micro_rollout_batch_size: 8" in t9 and "(OpenRLHF v0.9.10's default '--micro_rollout_batch_size 8')" in t9
        assert "micro_rollout_batch_size: 1" in t11 and "micro_train_batch_size: 1" in t11
        assert "v0.10.0 and v0.10.1 (also flat flags) default micro_train_batch_size and micro_rollout_batch_size to 1" in t9


def test_keys_values_and_comments_spot_checked():
    sft9, d9 = imported("v0.9.10/train_sft.sh")
    sft11, _ = imported("v0.11.0/train_sft.sh")
    assert re.search(r"^  micro_train_batch_size: 2 +# --micro_train_batch_size 2$", sft9, re.M)
    assert re.search(r"^  micro_train_batch_size: 2 +# --train.micro_batch_size 2$", sft11, re.M)
    assert re.search(r"^  save_steps: 0 +# --save_steps -1$", sft9, re.M)  # OpenRLHF -1 = never
    s = d9["sft"]
    assert (s["policy_uri"], s["dataset_uri"], s["output_uri"]) == ("meta-llama/Meta-Llama-3-8B", "Open-Orca/OpenOrca",
                                                                     "./checkpoint/llama3-8b-sft")  # hub ids as given
    assert (s["input_key"], s["output_key"], s["learning_rate"], s["bf16"], s["packing_samples"]) == \
        ("question", "response", 5e-6, True, True)
    # the script omits --input_template (no --apply_chat_template): OpenRLHF formats with its default template
    assert s["input_template"] == "User: {}\nAssistant: " and "(OpenRLHF v0.9.10's default '--input_template" in sft9
    assert "--eval_steps -1: no --eval_dataset" in sft9

    _, rm = imported("v0.11.0/train_rm.sh")  # no --prompt_key: OpenRLHF scores chosen / rejected whole
    assert rm["train_rm"]["prompt_key"] is None

    dpo, d = imported("v0.9.10/train_dpo_llama.sh")
    assert "`rlhf-flows stage prepare --config THIS_FILE` then `rlhf-flows stage reference" in dpo
    assert d["prepare"]["kind"] == "pairs" and d["reference"]["pairs_uri"] == d["prepare"]["output_uri"]
    assert d["dpo"]["dataset_uri"] == d["reference"]["output_uri"]
    assert d["reference"]["ref_uri"] == d["dpo"]["policy_uri"] == "OpenRLHF/Llama-3-8b-sft-mixture"
    for k in ("max_len", "bf16", "zero_stage", "packing_samples"):  # the reference pass computes as dpo trains
        assert d["reference"][k] == d["dpo"][k], k

    ppo, p = imported("v0.9.10/train_ppo_ray_hybrid_engine.sh")
    q = p["ppo"]
    assert (q["rollout_backend"], q["weight_sync_backend"], q["vllm_num_engines"], q["actor_learning_rate"]) == \
        ("vllm", "collective", 4, 5e-7)  # --vllm_sync_backend nccl with TP 2 engines: vLLM's weight-transfer engine
    assert "object_store" not in ppo
    assert (q["prompt_max_len"], q["generate_max_len"]) == (1024, 1024) and "--max_len 2048 minus prompt_max_len" in ppo
    assert "prompt_max_len 1024 + generate_max_len 1024 split it (a longer prompt keeps its last 1024 tokens" in ppo
    assert "reward_clip_range" not in q and "reward_clip_range" not in ppo  # the stage's default is OpenRLHF's (-10, 10)
    assert "--ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf: checkpoints go to" in ppo
    assert host_refused(ppo) == {("ppo", "vllm_enable_sleep"), ("ppo", "deepspeed_enable_sleep"),
                                 ("ppo", "vllm_tensor_parallel_size")} or __import__("torch").cuda.is_available()


def test_shell_forms_arrays_srun_bash_c_ray_job_torchrun_after_source():
    """The commands OpenRLHF's scripts keep in bash arrays, inside `srun ... bash -c "..."` behind `ray job
    submit ... --`, and as `torchrun ... -m ${training_commands}` after `source train_dpo_llama.sh slurm` (whose
    own `if [[ ${1} != "slurm" ]]` launch is skipped) are found with their flags and launchers."""
    _, agent = imported("v0.9.10/train_reinforce_baseline_ray_agent_async.sh")  # "${ARGS[@]}" arrays, comments inside
    a = agent["ppo"]
    assert (a["policy_uri"], a["agent_func_path"], a["n_samples_per_prompt"], a["ray_address"]) == \
        ("Qwen/Qwen3-4B-Thinking-2507", "examples/python/agent_func.py", 8, "http://127.0.0.1:8265")
    _, slurm = imported("v0.11.0/train_ppo_ray_slurm.sh")  # srun ... bash -c "pip ... && ray job submit ... -- python3 -m"
    assert (slurm["ppo"]["ray_address"], slurm["ppo"]["colocate_actor_ref"], slurm["ppo"]["colocate_critic_reward"]) == \
        ("http://localhost:8265", True, True)
    text, nonrl = imported("v0.9.10/train_nonrl_slurm.sh")  # torchrun -m ${training_commands} from the sourced file
    assert [c.runner for c in find_commands((COMMANDS / "v0.9.10/train_nonrl_slurm.sh").read_text(), COMMANDS / "v0.9.10")] == ["torchrun"]
    d = nonrl["dpo"]
    assert (d["launcher"], d["num_gpus"], d["master_port"], d["master_addr"], nonrl["reference"]["launcher"]) == \
        ("torchrun", 8, 9901, "$MASTER_ADDR", "torchrun")
    assert "--nnodes $SLURM_NNODES: the script sets it when it runs: give dpo.num_nodes" in text
    assert "--node_rank $SLURM_PROCID: node 0 runs the stage" in text and "$MASTER_ADDR is not set by" in text
    script = ("X=1\nA=(\n  --pretrain ${M:-./base}  # the model\n  --dataset 'a b.jsonl'\n)\nif [[ $X == 2 ]]; then\n"
              "  deepspeed --module openrlhf.cli.train_kd --teacher_model t\nelse\n"
              "  deepspeed --module openrlhf.cli.train_sft \"${A[@]}\" --max_len 64 2>&1 | tee log.txt\nfi\n")
    (cmd,) = find_commands(script)
    assert (cmd.module, cmd.flags) == ("train_sft", [("pretrain", "./base"), ("dataset", "a b.jsonl"), ("max_len", "64")])


def test_loops_become_their_flows_with_the_scripts_filter_and_iterations():
    """v0.9.5's iterative DPO (5 iterations) and rejection-sampling (10) loops become iterative-dpo and raft
    configs: the loop's count, the first policy, the RM, the prompts, each stage's settings; the filter is the
    flow's (iter_dpo / rs, as the script's --post_processor); --iter and the paths are the flow's. csft (one
    pass over a preference set's `chosen`): prepare samples -> score -> filter csft -> sft on the filter's rows."""
    text, it = imported("v0.9.5/train_iterative_dpo.sh")
    assert (it["iterations"], it["pretrain_uri"], it["reward_uri"], it["prompt_data"], it["ref_policy"]) == \
        (5, "OpenRLHF/Llama-3-8b-sft-mixture", "OpenRLHF/Llama-3-8b-rm-mixture", "OpenRLHF/prompt-collection-v0.1", "initial")
    assert (it["root"], it["run_name"]) == ("./checkpoint", "llama-3-8b-iter-dpo")
    assert (it["generate"]["backend"], it["generate"]["best_of_n"], it["generate"]["tensor_parallel_size"],
            it["generate"]["rollout_batch_size"]) == ("vllm", 8, 4, 10240)
    assert it["prepare"] == {"input_key": "context_messages", "apply_chat_template": True}
    assert (it["dpo"]["learning_rate"], it["dpo"]["zero_stage"], it["score"]["max_len"]) == (5e-7, 3, 4096)
    assert "--post_processor iter_dpo: the iterative-dpo flow's filter (method iter_dpo)" in text
    assert "--iter 0: set by the flow each iteration (generate.iter)" in text
    text, rs = imported("v0.9.5/train_rejection_sampling_llama.sh")
    assert (rs["iterations"], rs["generate"]["temperature"], rs["generate"]["best_of_n"], rs["sft_loop"]["learning_rate"],
            rs["sft_loop"]["input_template"]) == (10, 0.9, 4, 2e-6, None)
    assert "--post_processor rs: the raft flow's filter (method rs)" in text
    _, cs = imported("v0.9.5/train_conditional.sh")
    assert (cs["prepare"]["kind"], cs["prepare"]["input_key"], cs["prepare"]["tokenizer_uri"]) == \
        ("samples", "chosen", "OpenRLHF/Llama-3-8b-rm-mixture")
    assert cs["score"]["samples_uri"] == cs["prepare"]["output_uri"] and cs["filter"]["scored_uri"] == cs["score"]["output_uri"]
    assert (cs["filter"]["method"], cs["filter"]["normalize_reward"]) == ("csft", True)
    assert cs["sft"]["dataset_uri"] == cs["filter"]["output_uri"] != cs["score"]["output_uri"]
    loop = ("N=3\ni=0\nwhile (( $i < $N )); do\n  python -m openrlhf.cli.batch_inference --eval_task generate_vllm "
            "--pretrain ./p --dataset ./q --output_path ./o/g.jsonl --iter $i\n  deepspeed --module openrlhf.cli.batch_inference "
            "--eval_task rm --pretrain ./rm --dataset ./o/g.jsonl --output_path ./o/r.jsonl --post_processor rs\n"
            "  deepspeed --module openrlhf.cli.train_dpo --pretrain ./p --dataset ./o/r.jsonl --save_path ./o/m\ndone\n")
    with pytest.raises(imp.CommandError, match=r"runs batch_inference -> batch_inference -> train_dpo with --post_processor "
                                               r"rs: no flow here does that \(iter_dpo \+ train_dpo: iterative-dpo"):
        imp.import_text(loop)
    raft = yaml.safe_load(imp.import_text(loop.replace("train_dpo", "train_sft")))
    assert (raft["iterations"], raft["root"], raft["run_name"], raft["prompt_data"]) == (3, ".", "o", "./q")


def test_the_issue_37_reasons_and_mappings():
    """Each wrong refusal or reason of issue 37, and OpenRLHF's rules between flags, as they are now."""
    base = "python3 -m openrlhf.cli.train_ppo_ray --pretrain ./p --prompt_data ./q --vllm_num_engines 1 "
    ppo = lambda flags: imp.import_text(base + flags, "ppo.sh")  # noqa: E731
    t = ppo("--reward_pretrain ./rm --enable_vllm_is_correction --vllm_is_correction_type icepop --logging_steps 1 "
            "--lr_scheduler cosine_with_min_lr --max_ckpt_num 3")
    q = yaml.safe_load(t)["ppo"]
    assert (q["use_icepop"], q["enable_vllm_is_correction"], q["max_ckpt_num"]) == (True, True, 3)
    assert (q["lr_scheduler"], q["log_steps"]) == ("cosine_with_min_lr", 1)  # was: a table error (log_steps)
    t = ppo("--reward_pretrain ./rm --vllm_is_correction_type seq-mask-tis --lr_scheduler constant --logging_steps 5")
    assert "--vllm_is_correction_type seq-mask-tis: seq-mask-tis: TIS (clamp) and ICEPOP" in t
    q = yaml.safe_load(t)["ppo"]
    assert (q["lr_scheduler"], q["log_steps"]) == ("constant", 5)  # issue 37: the ppo stage's own settings now
    # gae with a reward function: OpenRLHF's critic starts from the actor; --normalize_reward is a no-op there
    t = ppo("--remote_rm_url http://rm:5000/get_reward --normalize_reward")
    q = yaml.safe_load(t)["ppo"]
    assert (q["critic_uri"], q["remote_rm_url"]) == ("./p", "http://rm:5000/get_reward") and "normalize_reward" not in q
    assert "--normalize_reward: no reward model (remote_rm_url gives the rewards): a no-op in OpenRLHF" in t
    # async_train + colocate_all_models: accepted as OpenRLHF does (its warning: the DeepSpeed models only)
    t = ppo("--reward_pretrain ./rm --async_train --colocate_all_models --actor_num_gpus_per_node 2 --ref_num_gpus_per_node 2")
    q = yaml.safe_load(t)["ppo"]
    assert (q["async_train"], q["colocate_actor_ref"], q["colocate_critic_reward"], "colocate_all_models" in q) == (True, True, True, False)
    # long context: the prompt cap is what --max_len leaves to the prompt, not a silent 1024
    q = yaml.safe_load(ppo("--reward_pretrain ./rm --max_len 74240 --max_new_tokens 64000"))["ppo"]
    assert (q["prompt_max_len"], q["generate_max_len"], q["reward_max_len"]) == (10240, 64000, 74240)
    t = imp.import_text("deepspeed --module openrlhf.cli.train_rm --pretrain ./b --dataset ./d --value_head_prefix score")
    assert "--value_head_prefix score: the head is saved as `score`" in t.split("hold here without a key:")[1]
    t = imp.import_text("deepspeed --module openrlhf.cli.train_kto --pretrain ./b --dataset ./d --ref_offload")
    assert "--ref_offload: the reference log-probs are computed before training" in t.split("hold here without a key:")[1]
    g = yaml.safe_load(imp.import_text("deepspeed --module openrlhf.cli.batch_inference --eval_task generate_vllm --bf16 "
                                       "--pretrain ./p --dataset ./q --output_path ./o"))["generate"]
    assert (g["dtype"], g["backend"]) == ("bf16", "vllm")
    t = imp.import_text("torchrun --nproc_per_node 4 --nnodes 2 --node_rank 0 --master_addr h0 --master_port 29500 "
                        "-m openrlhf.cli.train_sft --pretrain ./b --dataset ./d --train_batch_size 64")
    s = yaml.safe_load(t)["sft"]
    assert (s["launcher"], s["num_gpus"], s["num_nodes"], s["master_addr"], s["master_port"]) == ("torchrun", 4, 2, "h0", 29500)
    assert "--node_rank 0: node 0 runs the stage; the other nodes run the torchrun command it logs" in t
    # a flag OpenRLHF's own parser refuses (v0.9.10's DAPO script) is named as such, with the flag it meant
    t, _ = imported("v0.9.10/train_dapo_ray_hybrid_engine.sh")
    assert "--vllm_enable_is_correction: not a flag of OpenRLHF's train_ppo_ray (its parser refuses the command); " \
           "--enable_vllm_is_correction?" in t
    t = imp.import_text("python -m openrlhf.cli.lora_combiner --model_path ./b --lora_path ./a --output_path ./m --is_rm")
    assert yaml.safe_load(t)["lora_combine"] == {"base_uri": "./b", "model_uri": "./a", "output_uri": "./m", "is_rm": True, "bf16": True}


def test_every_table_rule_names_a_field_of_its_stage():
    """A rule naming a key its stage has not (a table error) would list the flag instead of mapping it."""
    def rule_keys(rule) -> list[str]:
        if isinstance(rule, imp.No):  # Fixed too
            return []
        if isinstance(rule, (str, list, tuple)):
            keys = rule[0] if isinstance(rule, tuple) else rule
            return [keys] if isinstance(keys, str) else keys
        keys = []
        for probe in ("r.py", "http://h", "tis", "icepop", "generate", "generate_vllm"):  # a converter's keys
            try:
                keys += rule(probe)
            except imp.NoCounterpart:
                pass
        return keys

    for module, table in imp.FLAGS.items():
        sections = imp.STAGES.get(module) or {"score_raw": ["score", "prepare", "filter"]}.get(module, [module])
        for flag, rule in table.items():
            for key in rule_keys(rule):
                section, key = key.split(".", 1) if "." in key else (sections[0], key)
                assert key in imp.config_class(section).model_fields, f"{module} --{flag}: {section}.{key}"
    for flag, rule in imp.LAUNCHER.items():
        for key in rule_keys(rule):
            assert key in imp.config_class("sft").model_fields or key in imp.config_class("ppo").model_fields, flag


def _fails(argv, capsys, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-flows: error: ") and message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_bad_input_and_refusals_are_one_named_error_line(tmp_path, capsys):
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
    f.write_text("source ./missing.sh slurm\ntorchrun -m ${training_commands}\n")
    _fails(["import-openrlhf", str(f)], capsys, "it runs `source ./missing.sh`, which is not beside it: import that file")
    _fails(["import-openrlhf", str(tmp_path / "nope.sh")], capsys, "nope.sh")
    _fails(["import-openrlhf", str(COMMANDS / "v0.10.1" / "train_vlm_math_hybrid_engine.sh")], capsys,
           "(--image_key images, --max_images_per_prompt 1, --freeze_visual_encoder): vision-language models are not supported")


def test_serve_rm_gives_the_serve_rm_command_that_replaces_it(capsys):
    """openrlhf.cli.serve_rm is a server: the refusal gives `rlhf-flows serve-rm` with its settings (OpenRLHF's
    host, head name and raw scores where the script leaves them), which the CLI parses as written."""
    for tag in ("v0.9.10", "v0.11.0"):
        _fails(["import-openrlhf", str(COMMANDS / tag / "serve_remote_rm.sh")], capsys, f"run `{SERVE}` (")
    a = cli.parse(shlex.split(SERVE)[1:])
    assert (a.model, a.port, a.max_len, a.batch_size, a.host, a.value_head_prefix, a.normalize_reward) == \
        ("OpenRLHF/Llama-3-8b-rm-700k", 5000, 8192, 16, "0.0.0.0", "score", True)
    with pytest.raises(imp.CommandError, match="--no-normalize-reward"):
        imp.import_text("python -m openrlhf.cli.serve_rm --reward_pretrain ./rm")


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
    assert yaml.safe_load(imp.import_text(script))["ppo"]["ray_address"] == "http://127.0.0.1:8265"


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
    assert cli.main(["import-openrlhf", str(COMMANDS / "v0.11.0" / "train_sft.sh"), "-o", str(out)]) == 0
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
    """OpenRLHF's train_dpo_llama.sh (v0.9.10, flat flags) imported, then its three stages (prepare pairs ->
    reference log-probs -> dpo) run by `rlhf-flows stage NAME --config` with the tiny model and pairs in its
    dataset's shape (chosen / rejected message lists, chat template), sizes shrunk: dpo commits with the script's
    settings."""
    from rlhf_core.demo import demo_task
    from rlhf_core import store

    rows = [{k: [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[k]}]
             for k in ("chosen", "rejected")} for r in demo_task.preference_rows(16)]
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dpo.yaml"
    assert cli.main(["import-openrlhf", str(COMMANDS / "v0.9.10" / "train_dpo_llama.sh"), "-o", str(out)]) == 0
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

    text, data = imported("v0.11.0/train_ppo_ray_hybrid_engine.sh")
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
                                        "reward_num_gpus_per_node=1",
                                        "rollout_batch_size=4", "train_batch_size=8", "micro_train_batch_size=2",
                                        "micro_rollout_batch_size=2", "max_samples=4", "bf16=false", "n_samples_per_prompt=2",
                                        "generate_max_len=8", "prompt_max_len=32", "num_episodes=1"], section="ppo")
    assert (cfg.zero_stage, cfg.packing_samples, cfg.use_dynamic_batch, cfg.colocate_all_models, cfg.init_kl_coef,
            cfg.critic_learning_rate, cfg.input_key, cfg.apply_chat_template, cfg.enable_vllm_is_correction,
            cfg.reward_clip_range) == (3, True, True, True, 0.01, 9e-6, "context_messages", True, True, (-10, 10))
    from rlhf_core.demo import demo_task
    from rlhf_core import store

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"context_messages": [{"role": "user", "content": p["input"]}]}) + "\n"
                               for p in demo_task.prompts(4)))
    m = ppo.run(cfg.model_copy(update={"prompts_uri": str(prompts)}))
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] >= 1
    assert store.read_manifest(str(tmp_path / "out")).config["packing_samples"] is True


def test_the_defaults_page_lists_every_default_that_still_differs_from_openrlhfs():
    """docs/openrlhf-defaults.md's table (docs/gen_defaults.py, from the importer's data and the stage configs):
    KTO beta (OpenRLHF 0.01, here 0.1), PRM label_key, input_template, batch sizes and learning rates are rows;
    the ppo reward clip is not (the stage's default is OpenRLHF's (-10, 10) since issue 37), nor a flag whose
    default is the stage's (eps_clip 0.2)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_defaults", ROOT / "docs" / "gen_defaults.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rows = {(r["module"], r["flag"], r["key"]): r for r in gen.differences()}
    kto = rows[("train_kto", "beta", "kto.beta")]
    assert (kto["theirs"], kto["ours"]) == ({"v0.9.5": 0.01}, 0.1)
    assert rows[("train_prm", "label_key", "train_prm.label_key")]["theirs"] == {"v0.9.5": "label"}
    assert rows[("train_sft", "input_template", "sft.input_template")]["ours"] is None
    assert rows[("train_ppo_ray", "micro_train_batch_size", "ppo.micro_train_batch_size")]["theirs"] == {"v0.11.0": 1}
    assert rows[("train_rm", "learning_rate", "train_rm.learning_rate")]["theirs"]["v0.9.10"] == 9e-6
    assert not any(r["flag"] in ("reward_clip_range", "eps_clip", "init_kl_coef") for r in rows.values())
    page = gen.on_page_markdown((ROOT / "docs" / "openrlhf-defaults.md").read_text(), None, None, None)
    assert "| train_kto | `--beta` | `0.01` (v0.9.5) | `kto.beta` | `0.1` |" in page and "<!--" not in page


def test_the_shipped_prorl_v2_config_is_the_imported_script():
    """configs/prorl_v2_math_hybrid.yaml mirrors OpenRLHF's train_prorlv2_math_hybrid_engine.sh key by key: its ppo
    settings (and the prepare keys the flow reads the prompts with) are what `import-openrlhf` makes of the v0.9.10
    script, the stop-properly penalty included; only what the flow wires in (policy, prompts, reward, output) and
    the placeholders the script sets from ${WORK_DIR} differ."""
    _, d = imported("v0.9.10/train_prorlv2_math_hybrid_engine.sh")
    shipped = yaml.safe_load((ROOT / "configs" / "prorl_v2_math_hybrid.yaml").read_text())
    wired = {"policy_uri", "prompts_uri", "reward_func_path", "output_uri"}
    moved = {"input_key", "label_key", "apply_chat_template"}  # the flow's prepare section reads the prompts
    got = {k: v for k, v in d["ppo"].items() if k not in wired | moved}
    assert got == shipped["ppo"]
    assert {k: d["ppo"][k] for k in moved} == shipped["prepare"]
    assert (shipped["pretrain_uri"], shipped["prompt_data"]) == (d["ppo"]["policy_uri"], d["ppo"]["prompts_uri"])
    assert shipped["ppo"]["stop_properly_penalty_coef"] == 0.0


def test_issue_37_flags_map_to_the_new_settings():
    """The flags the importer listed as 'no counterpart' before the settings existed: ppo's --lr_scheduler,
    --use_wandb / --use_tensorboard / --wandb_project / --wandb_run_name, --tokenizer_chat_template, --logging_steps,
    --reward_num_nodes / --reward_num_gpus_per_node, --flash_attn, the length penalties; the trainers'
    --save_hf_ckpt / --max_ckpt_num / --overlap_comm / --deepcompile; and --dataset_split / --prompt_split X
    written as SOURCE@X (train holds; a source that names its own @ is listed)."""
    t = imp.import_text("python3 -m openrlhf.cli.train_ppo_ray --pretrain ./p --prompt_data org/prompts,./more.jsonl "
                        "--reward_pretrain ./rm --vllm_num_engines 1 --lr_scheduler linear --use_wandb KEY "
                        "--wandb_project proj --wandb_run_name run1 --use_tensorboard ./tb --logging_steps 2 "
                        "--tokenizer_chat_template '{{ messages }}' --reward_num_nodes 1 --reward_num_gpus_per_node 2 "
                        "--flash_attn --overlong_buffer_len 128 --overlong_penalty_factor 0.5 "
                        "--stop_properly_penalty_coef 0.0 --overlap_comm --prompt_split test", "ppo.sh")
    q = yaml.safe_load(t)["ppo"]
    assert {k: q[k] for k in ("lr_scheduler", "use_wandb", "wandb_project", "wandb_run_name", "use_tensorboard",
                              "log_steps", "tokenizer_chat_template", "reward_num_nodes", "reward_num_gpus_per_node",
                              "attn_implementation", "overlong_buffer_len", "overlong_penalty_factor",
                              "stop_properly_penalty_coef", "overlap_comm", "prompts_uri")} == dict(
        lr_scheduler="linear", use_wandb=True, wandb_project="proj", wandb_run_name="run1", use_tensorboard=True,
        log_steps=2, tokenizer_chat_template="{{ messages }}", reward_num_nodes=1, reward_num_gpus_per_node=2,
        attn_implementation="flash_attention_2", overlong_buffer_len=128.0, overlong_penalty_factor=0.5,
        stop_properly_penalty_coef=0.0, overlap_comm=True, prompts_uri="org/prompts@test,./more.jsonl@test")
    assert re.search(r"^  prompts_uri: .* # --prompt_data org/prompts,./more.jsonl --prompt_split test$", t, re.M)
    assert "no counterpart" not in t
    s = yaml.safe_load(imp.import_text("deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset org/d "
                                       "--save_steps 10 --save_hf_ckpt --max_ckpt_num 2 --overlap_comm --deepcompile "
                                       "--dataset_split validation"))["sft"]
    assert (s["save_hf_ckpt"], s["max_ckpt_num"], s["overlap_comm"], s["deepcompile"], s["dataset_uri"]) == \
        (True, 2, True, True, "org/d@validation")
    t = imp.import_text("deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset org/d --dataset_split train")
    assert yaml.safe_load(t)["sft"]["dataset_uri"] == "org/d" and "--dataset_split train: the stages read the train" in t
    t = imp.import_text("deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset org/d@sub --dataset_split dev")
    assert yaml.safe_load(t)["sft"]["dataset_uri"] == "org/d@sub" and "org/d@sub already name(s) a folder" in t
    d = yaml.safe_load(imp.import_text("deepspeed --module openrlhf.cli.train_dpo --pretrain ./b --dataset org/pairs "
                                       "--dataset_split test_prefs"))
    assert d["prepare"]["data"] == "org/pairs@test_prefs"



# ---------------------------------------------------------------------------------------------- issue 43
def accounted(text: str, script: str, folder: Path | None = None, args: list[str] | None = None) -> None:
    """The test's own check beside the importer's: each flag of each command the script runs is named in a comment
    of the output (a key's, or a listed one)."""
    cmds = find_commands(script, folder, args) if args else find_commands(script, folder)
    assert cmds
    for cmd in cmds:
        for flag, _ in [*cmd.launcher, *cmd.flags]:
            assert re.search(rf"#.*(?<![\w.-])--{re.escape(flag)}(?![\w.-])", text), f"--{flag} dropped"


def research(name: str, *args: str) -> tuple[str, dict]:
    script = (RESEARCH / name).read_text()
    text = imp.import_text(script, name, RESEARCH, list(args)) if args else imp.import_text(script, name, RESEARCH)
    accounted(text, script, RESEARCH, list(args))
    return text, yaml.safe_load(text)


def inline(script: str) -> tuple[str, dict]:
    text = imp.import_text(script, "cmd.sh")
    accounted(text, script)
    return text, yaml.safe_load(text)


RESEARCH_ARGS = {"rm_args.sh": ["8b", "2"]}  # the script's own arguments, as `-- 8b 2` passes them


@pytest.mark.parametrize("name", sorted(p.name for p in RESEARCH.glob("*.sh")))
def test_every_research_script_imports_or_is_refused_in_one_line(name):
    """Each of them: a config that validates with every flag named, or (the missing backslash) one error line."""
    if name == "ppo_missing_backslash.sh":
        with pytest.raises(imp.CommandError) as e:
            research(name)
        assert "\n" not in str(e.value)
        return
    research(name, *RESEARCH_ARGS.get(name, []))


def test_the_accounting_fails_on_a_flag_no_comment_names(monkeypatch):
    """imp.unaccounted finds a flag that neither a key's comment nor a listed line names, and import_text refuses
    to print such an output (as an importer bug) rather than drop the flag without a word."""
    script = "deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset ./d --packing_samples --bf16"
    text = imp.import_text(script)
    cmds = find_commands(script)
    assert imp.unaccounted(text, cmds) == []
    lost = "\n".join(line for line in text.splitlines() if "--bf16" not in line)
    assert imp.unaccounted(lost, cmds) == ["--bf16"]
    monkeypatch.setattr(imp, "render", lambda converted, source: lost)
    with pytest.raises(imp.CommandError, match=r"--bf16 would be dropped without a word"):
        imp.import_text(script)


def test_arrays_appends_and_defaults_without_colon():
    """`A+=(...)` (one line and several, inside an `else`), `VAR+=" --flag"`, `${VAR-x}` and `${VAR:-x}`: every
    flag appended reaches the command, as bash builds it."""
    text, d = research("grpo_arrays.sh")
    p = d["ppo"]
    assert (p["apply_chat_template"], p["generate_max_len"], p["temperature"], p["seed"], p["log_steps"]) == \
        (True, 1024, 1.0, 7, 5)
    assert (p["prompts_uri"], p["output_uri"], p["policy_uri"]) == \
        ("data/math_train.jsonl", "./runs/grpo_math", "Qwen/Qwen2.5-Math-1.5B")
    assert "8192" not in text  # the `if` not taken: LONG is unset, so ${LONG:-0} is 0


def test_a_backslash_ending_the_file_is_dropped_as_bash_drops_it():
    script = (RESEARCH / "sft_eof_backslash.sh").read_text()
    assert script.endswith("\\")
    _, d = research("sft_eof_backslash.sh")
    assert (d["sft"]["output_uri"], d["sft"]["num_gpus"], d["sft"]["output_key"]) == ("ckpt/llama-1b-sft", 2, "completion")


def test_the_quick_starts_sft_command_has_its_real_newline_and_bf16_named():
    """OpenRLHF's quick start writes the template as an ANSI-C string, $'User: {}\\nAssistant: ' (a real newline),
    with --bf16 and --flash_attn (flags of OpenRLHF before v0.9.2 / v0.8)."""
    text, d = inline("deepspeed --module openrlhf.cli.train_sft \\\n   --max_len 4096 \\\n   --dataset Open-Orca/OpenOrca \\\n"
                     "   --input_key question \\\n   --output_key response \\\n"
                     "   --input_template $'User: {}\\nAssistant: ' \\\n   --train_batch_size 256 \\\n"
                     "   --micro_train_batch_size 2 \\\n   --pretrain meta-llama/Meta-Llama-3-8B \\\n"
                     "   --save_path ./checkpoint/llama3-8b-sft \\\n   --zero_stage 2 \\\n   --max_epochs 1 \\\n"
                     "   --packing_samples \\\n   --bf16 \\\n   --flash_attn \\\n   --learning_rate 5e-6\n")
    s = d["sft"]
    assert s["input_template"] == "User: {}\nAssistant: " and (s["bf16"], s["attn_implementation"]) == (True, "flash_attention_2")
    assert re.search(r"^  bf16: true +# --bf16$", text, re.M) and "$User" not in text
    assert re.search(r"^  input_template: .* # --input_template \$'User: \{\}\\nAssistant: '$", text, re.M)


def test_script_arguments_after_a_double_dash(tmp_path, capsys):
    """`import-openrlhf SCRIPT -- 8b 2`: $1 and $2 as bash gives them to the script (its `case` on the size, the
    GPU count, an ANSI-C template in a variable); without them the script's ${1:?usage} exits, named."""
    out = tmp_path / "rm.yaml"
    assert cli.main(["import-openrlhf", str(RESEARCH / "rm_args.sh"), "-o", str(out), "--", "8b", "2"]) == 0
    r = yaml.safe_load(out.read_text())["train_rm"]
    assert (r["base_uri"], r["num_gpus"], r["micro_train_batch_size"], r["output_uri"], r["input_template"]) == \
        ("org/base-8b", 2, 1, "ckpt/rm-8b", "Human: {}\nAssistant: ")
    _, d = research("rm_args.sh", "1b")
    assert (d["train_rm"]["base_uri"], d["train_rm"]["num_gpus"]) == ("org/base-1b", 4)  # ${2:-4}
    capsys.readouterr()
    _fails(["import-openrlhf", str(RESEARCH / "rm_args.sh")], capsys,
           "line 3 exits before one (no script arguments given: pass them after `--`)")


def test_a_reward_server_started_beside_the_trainer_is_named_as_its_step():
    """OpenRLHF's serve_rm in the background, then the trainer on its URL: the trainer imports and the header
    gives the serve-rm command that replaces the server; a repository's own server is named as the line to keep
    running. --reward_num_nodes 0 beside a remote reward holds (OpenRLHF starts no reward model)."""
    text, d = research("ppo_with_rm_server.sh")
    assert d["ppo"]["remote_rm_url"] == "http://localhost:5000/get_reward" and "reward_num_nodes" not in d["ppo"]
    step = text.split("# The script also starts (keep it running beside the stage):\n")[1].split("\n")[0]
    assert step.startswith("#   line 6: `python -m openrlhf.cli.serve_rm --reward_pretrain org/rm-8b --port 5000")
    assert "here run `rlhf-flows serve-rm org/rm-8b --port 5000 --max-len 4096 --batch-size 8" in step
    assert "--reward_num_nodes 0: remote_rm_url gives the rewards: OpenRLHF starts no reward model" in text
    text, d = research("reinforce_fork_server.sh")
    assert "#   line 3: `python -m verifier.remote_rm --host 0.0.0.0 --port 6000 --workers 16` (the script's own " \
           "reward server, not OpenRLHF's)" in text
    with pytest.raises(imp.CommandError, match="--reward_num_nodes 0: OpenRLHF would start no rank for the reward"):
        imp.import_text("python3 -m openrlhf.cli.train_ppo_ray --pretrain ./p --prompt_data ./q --reward_pretrain ./rm "
                        "--reward_num_nodes 0")


def test_kl_0_with_reference_gpus_and_two_reward_urls():
    """OpenRLHF starts no reference at init_kl_coef 0 (its --ref_* placement holds); two comma-separated reward
    URLs are servers it shares each batch out among: the first is used, the note names the other."""
    text, d = research("reinforce_fork_server.sh")
    p = d["ppo"]
    assert (p["init_kl_coef"], p["remote_rm_url"]) == (0.0, "http://127.0.0.1:6000/get_reward")
    assert "ref_num_gpus_per_node" not in p and "ref_num_nodes" not in p
    assert "--ref_num_gpus_per_node 2: init_kl_coef 0: OpenRLHF starts no reference model" in text
    assert "every query goes to http://127.0.0.1:6000/get_reward (the stage takes one URL): put " \
           "http://127.0.0.1:6001/get_reward behind it" in text


def test_ring_attention_and_autotp_without_a_gpu_count_take_every_gpu_of_the_node():
    """`deepspeed` without --num_gpus (or with --include localhost) runs on every GPU of the node: num_gpus all,
    which the stage counts at launch (so ring_attn_size / ds_tensor_parallel_size validate at import); train_ppo_ray's
    roles get OpenRLHF's 8 GPUs per node (the README's 4 engines x TP 2 on colocated models, no placement flag given)."""
    text, d = research("sft_ring_attention.sh")
    assert (d["sft"]["num_gpus"], d["sft"]["ring_attn_size"]) == ("all", 4)
    assert re.search(r"^  num_gpus: all +# \(deepspeed without --num_gpus: every GPU of the node, counted at launch\)$",
                     text, re.M)
    _, d = inline("deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset ./d --ds.tensor_parallel_size 2 "
                  "--train_batch_size 16")
    assert d["sft"]["num_gpus"] == "all"
    _, d = inline("deepspeed --include localhost --module openrlhf.cli.train_sft --pretrain ./b --dataset ./d")
    assert d["sft"]["num_gpus"] == "all"
    _, d = inline("deepspeed --module openrlhf.cli.train_dpo --pretrain ./p --dataset ./pairs")
    assert d["dpo"]["num_gpus"] == d["reference"]["num_gpus"] == "all"
    _, d = inline("python3 -m openrlhf.cli.train_ppo_ray --vllm_num_engines 4 --vllm_tensor_parallel_size 2 "
                  "--colocate_all_models --pretrain ./p --reward_pretrain ./rm --prompt_data ./q")
    p = d["ppo"]
    assert [p[f"{r}_num_gpus_per_node"] for r in ("actor", "critic", "ref", "reward")] == [8, 8, 8, 8]


def test_process_substitution_redirects_stay_out_of_the_flags():
    _, d = research("sft_ring_attention.sh")  # ... --save_path ckpt/sft-longctx > >(tee -a logs/sft.log) 2> >(...)
    assert d["sft"]["output_uri"] == "ckpt/sft-longctx"


def test_a_trainer_launched_by_its_file_with_cuda_visible_devices():
    """`deepspeed openrlhf/cli/train_dpo.py` after `export CUDA_VISIBLE_DEVICES=0,1`: train_dpo on 2 ranks;
    --flash_attn reaches the reference pass too (dpo refuses a reference pass of another kernel); `json@DIR` is
    the folder; --optim adam holds (AdamW)."""
    text, d = research("dpo_by_path.sh")
    assert list(d) == ["prepare", "reference", "dpo"]
    assert d["dpo"]["num_gpus"] == d["reference"]["num_gpus"] == 2
    assert d["dpo"]["attn_implementation"] == d["reference"]["attn_implementation"] == "flash_attention_2"
    assert d["prepare"]["data"] == "data/pairs,org/more-pairs"
    assert "--optim adam: AdamW" in text.split("hold here without a key:")[1]
    _, d = inline("deepspeed --module openrlhf.cli.train_dpo --pretrain ./p --dataset ./pairs --flash_attn")
    assert d["reference"]["attn_implementation"] == "flash_attention_2"
    _, d = inline("python3 /src/OpenRLHF/openrlhf/cli/train_sft.py --pretrain ./b --dataset ./d")
    assert d["sft"]["policy_uri"] == "./b"


def test_a_missing_backslash_mid_command_is_named_with_its_lines(capsys):
    _fails(["import-openrlhf", str(RESEARCH / "ppo_missing_backslash.sh")], capsys,
           "ppo_missing_backslash.sh lines 8-10: `--vllm_sync_backend nccl --vllm_enable_sleep --deepspeed_enable_sleep` "
           "is a command of its own: line 7 ends openrlhf.cli.train_ppo_ray (line 3) without a backslash")


def test_a_comment_inside_a_command_and_flags_only_the_running_script_knows():
    """A commented-out flag line inside a continued command ends the command there (its backslash is part of the
    comment): refused naming the comment. A whole word the script sets only when it runs ($LORA, set in an `if` on
    the environment) is named, not taken as the previous flag's value."""
    with pytest.raises(imp.CommandError, match=r"cmd.sh line 4: `--dataset ./d` is a command of its own: line 3 is a "
                                               r"comment inside the command"):
        inline("deepspeed --module openrlhf.cli.train_sft \\\n  --pretrain ./b \\\n  # --packing_samples \\\n"
               "  --dataset ./d\n")
    text, d = inline('if [ "$USE_LORA" = "1" ]; then\n  LORA="--lora_rank 64"\nfi\n'
                     "deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset ./d --save_path out $LORA\n")
    assert d["sft"]["output_uri"] == "out" and "lora_rank" not in d["sft"]
    assert "$LORA (line 4) is set only when the script runs: the flags it may hold are not read here" in text
    assert 'line 1: `[ "$USE_LORA" = "1" ]` is decided when the script runs' in text


def test_a_docs_fragment_ending_in_dots_is_read_with_a_note():
    text, d = inline("python3 -m openrlhf.cli.train_ppo_ray \\\n   --pretrain ./p \\\n   --prompt_data ./q \\\n"
                     "   --agent_func_path ./agent.py \\\n   ... # other training args\n")
    assert d["ppo"]["agent_func_path"] == "./agent.py"
    assert "`...` (line 5): the command is a fragment" in text


def test_a_wandb_key_goes_to_the_credentials_never_the_yaml():
    text, d = inline("deepspeed --module openrlhf.cli.train_sft --pretrain ./b --dataset ./d --use_wandb 0123abcdkey "
                     "--use_tensorboard ./tb/run1")
    assert "0123abcdkey" not in text and d["sft"]["use_wandb"] is True and d["sft"]["use_tensorboard"] is True
    assert "--use_wandb KEY: the W&B key is not written here: give it to the run as WANDB_API_KEY" in text
    assert "credentials_block" in text
    assert "--use_tensorboard ./tb/run1: the event files go to the artifact's tensorboard/ folder" in text


def test_argparse_prefixes_old_flags_and_launcher_placement():
    """--max_epoch (an unambiguous prefix of --max_epochs), --pretrain_split (train_ppo_ray's until v0.8),
    --include localhost:0,1,2,3 (4 ranks), --optim adam (AdamW); an ambiguous prefix is named as OpenRLHF's
    parser refuses it; --include beside --num_gpus is refused as deepspeed refuses it."""
    text, d = inline("deepspeed --include localhost:0,1,2,3 --module openrlhf.cli.train_sft --pretrain ./b "
                     "--dataset ./d --max_epoch 3 --optim adam --train_batch_size 64")
    assert (d["sft"]["max_epochs"], d["sft"]["num_gpus"]) == (3, 4)
    assert "--max_epoch: OpenRLHF's argparse reads it as --max_epochs" in text and "no counterpart" not in text
    text, d = inline("python3 -m openrlhf.cli.train_ppo_ray --pretrain ./p --prompt_data ./q --reward_pretrain ./rm "
                     "--pretrain_data ./sft --pretrain_split validation")
    assert d["ppo"]["pretrain_data"] == "./sft@validation" and "refuses" not in text
    text, _ = inline("python3 -m openrlhf.cli.train_ppo_ray --pretrain ./p --prompt_data ./q --reward_pretrain ./rm "
                     "--micro_ 4")
    assert "--micro_ 4: an ambiguous prefix of --micro_rollout_batch_size, --micro_train_batch_size" in text
    with pytest.raises(imp.CommandError, match="deepspeed refuses --include / --exclude beside --num_gpus"):
        imp.import_text("deepspeed --include localhost:0,1 --num_gpus 2 --module openrlhf.cli.train_sft "
                        "--pretrain ./b --dataset ./d")


def test_batch_inference_normalize_reward_without_post_processor():
    """OpenRLHF reads --normalize_reward of batch_inference in its post-processor only: without one, a no-op."""
    text, d = inline("deepspeed --module openrlhf.cli.batch_inference --eval_task rm --pretrain ./rm --dataset ./d "
                     "--output_path ./scores.jsonl --normalize_reward\n")
    assert list(d) == ["prepare", "score"] and "filter" not in d
    assert "--normalize_reward: read by --post_processor only, and there is none" in text


def test_an_openrlhf_agent_file_loads_unchanged(tmp_path):
    """An agent file as OpenRLHF's guide writes it (`from openrlhf.utils.agent import ...`) loads as it is; the
    module name is there for the file only (no `openrlhf` left in sys.modules to shadow a real install)."""
    import sys

    from rlhf_core.rollout import agent

    f = tmp_path / "agent_func.py"
    f.write_text("from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n\n"
                 "class AgentInstance(AgentInstanceBase):\n    async def step(self, states, **kwargs):\n"
                 "        return {'rewards': 1.0, 'scores': 1.0, 'environment_feedback': '', 'done': True}\n\n\n"
                 "class AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n"
                 "        super().__init__(AgentInstance)\n")
    before = {m for m in sys.modules if m.split(".")[0] == "openrlhf"}
    cls = agent.load_agent(str(f))
    assert cls.__name__ == "AgentInstance" and issubclass(cls, agent.AgentInstanceBase)
    assert {m for m in sys.modules if m.split(".")[0] == "openrlhf"} == before


def test_the_gpu_image_installs_the_tracking_extra():
    """W&B / TensorBoard (use_wandb / use_tensorboard of imported commands) run in the GPU image."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'pip install --no-build-isolation -c requirements/gpu-constraints.txt "\.\[gpu\]" "\.\[tracking\]"', text)


def test_the_shell_reader_spot_checks():
    """Functions run where they are called (their own $1), `$(cat <<EOF ...)`, a quoted here-document (no
    expansion), `case` on a known value, "$@" of no argument is no word, only an exported CUDA_VISIBLE_DEVICES
    reaches deepspeed, `[[ ... ]] && A+=(...)` on a value the script sets."""
    (c,) = find_commands('train() {\n  local m=$1; shift\n  deepspeed --module openrlhf.cli.train_sft --pretrain "$m" "$@"\n}\n'
                         "train ./b --dataset './my data' --max_len 64\n")
    assert c.flags == [("pretrain", "./b"), ("dataset", "./my data"), ("max_len", "64")]
    (c,) = find_commands("CMD=$(cat <<EOF\nopenrlhf.cli.train_rm --pretrain $HOME_M\n  --dataset ./d\nEOF\n)\n"
                         "HOME_M=unused\ndeepspeed --module $CMD\n")
    assert (c.module, c.flags, c.unresolved) == ("train_rm", [("pretrain", "$HOME_M"), ("dataset", "./d")], ["$HOME_M"])
    (c,) = find_commands("read -r -d '' CMD <<'EOF'\nopenrlhf.cli.train_sft --pretrain $M\nEOF\nM=x\n"
                         "python -m $CMD \"$@\"\n")
    assert c.flags == [("pretrain", "$M")]  # quoted delimiter: the text as written, "$@" of nothing adds no word
    (c,) = find_commands('MODE=dpo\ncase $MODE in\n  sft) M=train_sft ;;\n  dpo|kto) M=train_$MODE ;;\nesac\n'
                         "A=(--pretrain ./b)\n[[ $MODE == d* ]] && A+=(--beta 0.2)\n"
                         "CUDA_VISIBLE_DEVICES=0,1\ndeepspeed --module openrlhf.cli.$M \"${A[@]}\"\n")
    assert (c.module, c.flags, c.env) == ("train_dpo", [("pretrain", "./b"), ("beta", "0.2")], {})
    (c,) = find_commands("export CUDA_VISIBLE_DEVICES=0,1\nsrun bash -c \"deepspeed --module openrlhf.cli.train_sft "
                         "--pretrain ./b\"\n")
    assert (c.module, c.env) == ("train_sft", {"CUDA_VISIBLE_DEVICES": "0,1"})
