"""The command line as a user meets it: every `rlhf-flows ...` line the README, the configs and the module
docstrings show parses and validates (docs are tests), `--config` goes before or after the overrides, and
every expected failure is one `rlhf-flows: error:` line with exit 2 (`--debug` re-raises)."""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

import flows.iterative_dpo  # noqa: F401  (Prefect binds its console log to sys.stderr here: outside capsys)
from flows import cli
from tests.test_packaging import cuda_only_refused_here

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "stages").glob("*.py")),
        *sorted((ROOT / "flows").glob("*.py")), ROOT / "deployments" / "prefect.yaml", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"rlhf-flows ((?:demo|run|stage|show|serve-rm|gc)\b[^`#\n]*)")
PLACEHOLDER = re.compile(r"^[A-Z_]+$")  # FILE, FLOW, STAGE, URI, MODEL, NAME, DIR


HOW_TO = sorted((ROOT / "docs" / "how-to").glob("*.md"))
PREFECT_PAGES = ("deployments.md", "triggers.md", "slurm.md")  # the how-to pages with `prefect` commands, in the order
                                                               # tests/flows/test_deployment.py runs them
PREFECT_LINE = re.compile(r"(?:^|\s)(prefect (?:--no-prompt )?[a-z][\w-]*\b.*)$")


def prefect_documented(page: Path) -> list[str]:
    """Every `prefect ...` command of a how-to page, in page order: a line of a code block (a shell line
    continued with a backslash is one line, a trailing `# comment` is cut; under a wrapper such as `sbatch ...
    prefect worker start ...`, the prefect command it runs) and inline code that starts with `prefect `.
    tests/flows/test_deployment.py runs each as written against the session's `prefect server`."""
    out, block = [], False
    for line in re.sub(r"\s*\\\n\s*", " ", page.read_text()).splitlines():
        if line.strip().startswith("```"):
            block = not block
        elif block:
            code = re.sub(r"\s+#\s.*$", "", line).strip()
            if not code.startswith("#") and (m := PREFECT_LINE.search(code)):
                out.append(m.group(1).strip())
        else:
            out += [span.strip() for span in re.findall(r"`([^`]+)`", line) if span.startswith("prefect ")]
    return out


def documented() -> list[tuple[str, list[str]]]:
    """(where, argv) for every documented command line; `a | b` alternatives expanded, `[...]` dropped,
    text after two spaces (a description column) cut."""
    out = []
    for f in DOCS:
        text = re.sub(r"\s*\\\n\s*(#\s*)?", " ", f.read_text())  # a shell line continued with a backslash is one command
        for m in COMMAND.finditer(text):
            line = re.split(r"\s{2,}", re.sub(r"\[[^\]]*\]", "", m.group(1)).strip())[0]
            groups: list[list[str]] = []
            toks = line.split()
            i = 0
            while i < len(toks):
                if toks[i] == "|":
                    groups[-1].append(toks[i + 1])
                    i += 2
                else:
                    groups.append([toks[i]])
                    i += 1
            groups = [["1"] if g == ["N"] else g for g in groups if g != ["..."]]  # N: a number; ...: elided
            out += [(f"{f.relative_to(ROOT)}: {line}", list(argv)) for argv in itertools.product(*groups)]
    return out


def test_docs_show_the_commands_a_user_needs():
    lines = {" ".join(a) for _, a in documented()}
    assert len(lines) > 20
    for needed in ("demo", "run iterative-dpo --config configs/demo.yaml", "stage dpo", "stage prepare", "show",
                   "serve-rm", "run raft --config configs/demo_raft.yaml", "run ppo --config configs/demo_ppo.yaml"):
        assert any(line.startswith(needed) for line in lines), needed


@pytest.mark.parametrize("where,argv", documented(), ids=lambda x: x if isinstance(x, str) else None)
def test_every_documented_command_parses_and_its_config_validates(where, argv):
    """Parses (SystemExit = argparse refused it), names a real flow / stage, and, where the line is concrete,
    its config file exists and the file + overrides validate against the flow's / stage's config."""
    from stages.common import load_config

    a = cli.parse(argv)
    if a.cmd not in ("run", "stage") or PLACEHOLDER.match(a.name):
        return
    config = None if a.config is None or PLACEHOLDER.match(a.config) else ROOT / a.config
    assert config is None or config.exists(), f"{where}: {a.config} does not exist"
    overrides = [o for o in a.overrides if not PLACEHOLDER.match(o.split("=")[0]) and o != "key=value"]
    if a.config and not config:  # FILE: the user's own
        return
    if a.cmd == "run":
        from flows import common

        mod = cli._flow_module(a.name)
        flow = mod.__name__.split(".")[-1]
        params = cuda_only_refused_here(mod, flow, load_config(mod.Params, config, overrides))
        common.validate(params, flow, mod.checks(params))
    else:
        mod = cli._stage_module(a.name)
        load_config(mod.Config, config, overrides, section=a.name)


@pytest.mark.parametrize("argv", [
    ["run", "iterative-dpo", "--config", "c.yaml", "iterations=1", "dpo.beta=0.2"],
    ["run", "iterative-dpo", "iterations=1", "--config", "c.yaml", "dpo.beta=0.2"],
    ["run", "iterative-dpo", "iterations=1", "dpo.beta=0.2", "--config", "c.yaml"],
    ["run", "--config", "c.yaml", "iterative-dpo", "iterations=1", "dpo.beta=0.2"],
])
def test_config_goes_before_or_after_the_overrides(argv):
    a = cli.parse(argv)
    assert (a.cmd, a.name, a.config, a.overrides) == ("run", "iterative-dpo", "c.yaml", ["iterations=1", "dpo.beta=0.2"])
    s = cli.parse(["stage", "generate", "--config", "c.yaml", "backend=hf", "--debug", "iter=2"])
    assert (s.name, s.config, s.overrides, s.debug) == ("generate", "c.yaml", ["backend=hf", "iter=2"], True)


def test_a_stray_argument_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(["run", "raft", "--config", "c.yaml", "oops"])
    assert e.value.code == 2 and "unrecognized arguments: oops" in capsys.readouterr().err


def _fails(argv, capsys, message: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-flows: error: ") and message in err and "Traceback" not in err, err


def test_config_errors_are_one_line_and_debug_reraises(tmp_path, capsys):
    from stages.common import ConfigError

    _fails(["run", "iterative-dpo", "--config", str(tmp_path / "nope.yaml")], capsys, "nope.yaml does not exist")
    _fails(["run", "iterative-dp", "iterations=1"], capsys, "unknown flow 'iterative-dp'; choose from iterative-dpo")
    _fails(["stage", "dpoo", "beta=1"], capsys, "unknown stage 'dpoo'; choose from")
    _fails(["stage", "dpo", "--config", str(ROOT / "configs" / "demo.yaml"), "beta=-1"], capsys,
           "beta: Input should be greater than 0")
    with pytest.raises(ConfigError):
        cli.main(["stage", "dpoo", "--debug"])


def test_data_errors_name_the_row_and_degenerate_pairs_are_refused(tmp_path, capsys):
    src = tmp_path / "prefs.jsonl"
    src.write_text('{"prompt": "p", "chosen": "good", "rejected": "bad"}\n{"prompt": "q", "chosen": "same", "rejected": "same"}\n')
    out = tmp_path / "store" / "pairs"
    _fails(["stage", "prepare", "kind=pairs", f"data={src}", "prompt_key=prompt", f"output_uri={out}"], capsys,
           "prefs.jsonl row 1: 'chosen' and 'rejected' are identical ('same')")
    assert not out.exists() or not any(out.rglob("_MANIFEST.json"))


def test_artifact_errors_show_refuses_a_missing_or_uncommitted_prefix(tmp_path, capsys):
    _fails(["show", str(tmp_path / "missing")], capsys, "missing does not exist")
    partial = tmp_path / "iter-1" / "generate"
    partial.mkdir(parents=True)
    (partial / "samples.parquet").write_bytes(b"partial")
    _fails(["show", str(partial)], capsys, f"{partial} is not a committed artifact (no _MANIFEST.json)")
    _fails(["stage", "filter", f"scored_uri={partial}", "method=rs", f"output_uri={tmp_path / 'f'}"], capsys,
           f"{partial} is not a committed artifact")


def test_reward_and_generation_errors_are_one_line(tmp_path, capsys, tiny):
    from rlhf_core.inputs import data
    from rlhf_core import store

    w = store.ArtifactWriter(str(tmp_path / "samples"), "generate", {"t": 1})
    w.begin()
    w.write_table("samples.parquet", data.to_table([{"prompt": "p", "response": " r", "sample_index": 0}], "samples"))
    samples = w.commit().uri
    rf = tmp_path / "rf.py"
    rf.write_text("def reward_func(queries, prompts, labels):\n    raise KeyError('gold')\n")
    _fails(["stage", "score", f"samples_uri={samples}", f"reward_func_path={rf}", f"output_uri={tmp_path / 's'}"],
           capsys, f"reward_func in {rf} raised KeyError")
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"input": "word " * 50}) + "\n")
    _fails(["stage", "generate", f"policy_uri={tiny.policy_uri}", f"prompts_uri={p}", "prompt_max_len=8",
            "prompt_overflow=reject", "num_engines=0", f"output_uri={tmp_path / 'g'}"], capsys, "prompt_max_len")


def test_cheap_documented_commands_run_end_to_end(demo_run, capsys):
    """`stage prepare`, `stage filter` and `show` as the docs write them, on the demo run's artifacts."""
    run = demo_run.run
    values = {"data": f"{demo_run.inputs}/prompts.jsonl", "scored_uri": f"{run}/iter-1/score",
              "output_uri": f"{run}-docs-check"}  # beside the run: its own artifacts stay as the demo made them
    ran = 0
    for where, argv in documented():
        if argv[:2] in (["stage", "prepare"], ["stage", "filter"]) and "--config" not in argv:
            values["data"] = f"{demo_run.inputs}/{'preferences' if 'kind=samples' in argv else 'prompts'}.jsonl"
            argv = [a if a.split("=")[0] not in values else f"{a.split('=')[0]}={values[a.split('=')[0]]}" for a in argv]
            argv = [*argv[:-1], argv[-1]] + [f"output_uri={run}-docs-check/{argv[1]}-{ran}"]
        elif argv[0] == "show" and argv[1].startswith("s3://bucket/rlhf/run-name"):
            argv = ["show", argv[1].replace("s3://bucket/rlhf/run-name", run)]
        else:
            continue
        assert cli.main(argv) == 0, (where, capsys.readouterr().err)
        out = capsys.readouterr().out
        assert ("committed at" in out) if argv[0] == "stage" else ("lineage:" in out or "artifacts:" in out), where
        ran += 1
    assert ran >= 4


def test_the_ui_names_the_flow_run_after_the_run_and_each_task_run_by_its_place(demo_run):
    """In Prefect's API (what the UI shows; read right after the demo's flow run by tests/flows/conftest.py): the flow
    run is named after run_name; a task run is named by its place in the run (iter-2/dpo, not a third `dpo`) and
    tagged run:, stage:, iter:."""
    assert demo_run.prefect["flow_run_name"] == demo_run.params.run_name == "dpo"
    by_name = {t["name"]: set(t["tags"]) for t in demo_run.prefect["task_runs"]}
    assert {"prompts", "sft", "reward_model", "iter-0/eval", "iter-1/generate", "iter-1/dpo", "iter-2/dpo",
            "iter-2/eval"} <= set(by_name), sorted(by_name)
    assert by_name["iter-2/dpo"] >= {"run:dpo", "stage:dpo", "iter:2"} and "iter:2" not in by_name["iter-1/dpo"]
    assert by_name["prompts"] >= {"run:dpo", "stage:prepare"}


def test_a_failed_stage_inside_a_flow_is_one_line_naming_stage_and_uri(prefect_harness, tiny, tmp_path, capsys):
    from rlhf_core.demo import demo_task

    argv = ["run", "raft", f"root={tmp_path}", f"pretrain_uri={tiny.policy_uri}", f"reward_func_file={demo_task.__file__}",
            f"prompt_data={tmp_path / 'nope.jsonl'}", "iterations=1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err  # Prefect's console log lines, then ours; no traceback anywhere
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"rlhf-flows: error: stage 'prepare' failed writing {tmp_path}/demo/prompts: "
                                            f"FileNotFoundError: input {tmp_path / 'nope.jsonl'} does not exist")


def test_printed_report_puts_rewards_kl_and_length_first_and_timings_last():
    rows = [{"iteration": 0, "gold_reward": 0.0, "rm_reward": 0.2, "kl": 0.0, "response_length": 9.5, "eval_s": 1.0},
            {"iteration": 1, "samples": 8, "dpo_loss": 0.6, "gold_reward": 0.1, "rm_reward": 0.4, "kl": 0.02,
             "response_length": 10.0, "generate_s": 2.0, "eval_s": 1.1, "dpo_steps": 4}]
    text = cli.format_report({"flow": "iterative-dpo", "run": "r", "stop_reason": "done", "wall_s": 1, "iterations": rows})
    assert text.splitlines()[1].split() == ["iteration", "gold_reward", "rm_reward", "kl", "response_length", "samples",
                                            "dpo_loss", "eval_s", "generate_s"]


def test_the_flow_table_names_every_flow_and_its_stages(monkeypatch):
    """flows/table.py is what the CLI lists, what validation checks and what the progress bar counts: each
    entry's module holds the flow of that name; each stage it names exists and is validated; a stage the
    table names but the flow's checks() leave out is refused before any work."""
    from flows import common, table
    from stages.common import ConfigError

    assert cli.FLOWS == {name: spec.module for name, spec in table.FLOWS.items()}
    for name, spec in table.FLOWS.items():
        mod = cli._flow_module(name)
        assert mod.FLOW.name == name and all(s in cli.STAGES for s in spec.iteration), name
        params = mod.Params(demo=True)
        common.validate(params, name, mod.checks(params))
    csft = cli._flow_module("conditional-sft")
    assert table.calls_per_iteration("conditional-sft", csft.Params(demo=True)) == 5
    assert table.calls_per_iteration("conditional-sft", csft.Params(demo=True, low_target_reward=0.0)) == 6
    monkeypatch.setitem(table.FLOWS, "raft", table.FlowSpec("flows.raft", ("generate", "score", "filter", "dpo", "eval")))
    raft = cli._flow_module("raft")
    with pytest.raises(ConfigError, match=r"raft: stages \['dpo'\] of flows/table.py are not in the flow's checks"):
        common.validate(raft.Params(demo=True), "raft", raft.checks(raft.Params(demo=True)))


def test_loop_settings_that_a_given_reward_or_missing_sft_data_leave_unused_are_refused():
    """With a reward source given no reward model is trained: train_rm, preference_data and reward_base_uri
    would be ignored, so they are refused; so are sft settings without sft_data (outside the demo)."""
    from flows import common
    from stages.common import ConfigError

    raft = cli._flow_module("raft")
    base = {"root": "/tmp/x", "pretrain_uri": "p", "prompt_data": "d"}
    # a section counts as set where it differs from the stage's defaults (train_rm's max_epochs is 1), as the
    # Prefect run form sends every default
    assert common.settings(raft.Params(**base, reward_uri="rm", train_rm={"max_epochs": 1}).train_rm) == {}
    for extra, unused in (({"reward_uri": "rm", "train_rm": {"max_epochs": 2}}, "train_rm"),
                          ({"reward_url": "http://127.0.0.1:9/", "preference_data": "pairs.jsonl"}, "preference_data"),
                          ({"reward_func_file": "r.py", "reward_base_uri": "b", "train_rm": {"max_len": 8}},
                           "train_rm, reward_base_uri")):
        p = raft.Params(**base, **extra)
        with pytest.raises(ConfigError, match=rf"raft: {next(iter(extra))} is the reward, .* {unused} would be ignored"):
            common.validate(p, "raft", raft.checks(p))
    p = raft.Params(**base, reward_uri="rm", sft={"max_epochs": 2})
    with pytest.raises(ConfigError, match=r"raft: sft settings apply to the SFT warm-up on sft_data, which is not set"):
        common.validate(p, "raft", raft.checks(p))
    p = raft.Params(**base, reward_uri="rm", sft_data="sft.jsonl", sft={"max_epochs": 1})  # both: the warm-up runs
    common.validate(p, "raft", raft.checks(p))
    p = raft.Params(**base, preference_data="pairs.jsonl", train_rm={"max_epochs": 1})  # trains its reward model
    common.validate(p, "raft", raft.checks(p))


def test_a_config_files_section_is_dropped_on_the_command_line_with_null(tmp_path):
    """A config file that trains its reward model, run with a given reward_uri instead: `train_rm=null
    preference_data=null` drops what would go unused, and the run validates; without them it is refused."""
    from flows import common
    from flows.calls import settings
    from stages.common import ConfigError, load_config

    raft = cli._flow_module("raft")
    cfg = tmp_path / "raft.yaml"
    cfg.write_text("root: /tmp/x\npretrain_uri: p\nprompt_data: d\npreference_data: pairs.jsonl\n"
                   "train_rm: {max_epochs: 2}\nsft_loop: {max_epochs: 2}\n")
    p = load_config(raft.Params, cfg, ["reward_uri=rm"])
    with pytest.raises(ConfigError, match=r"train_rm, preference_data would be ignored: remove them \(on the "
                                          r"command line: train_rm=null preference_data=null\)"):
        common.validate(p, "raft", raft.checks(p))
    p = load_config(raft.Params, cfg, ["reward_uri=rm", "train_rm=null", "preference_data=null"])
    assert settings(p.train_rm) == {} and p.preference_data is None and settings(p.sft_loop) == {"max_epochs": 2}
    common.validate(p, "raft", raft.checks(p))


def test_raft_with_trainer_kd_is_checked_before_any_work():
    """raft trainer=kd: the iteration's trainer is the kd stage (table count 5), its settings are validated
    against stages/kd.py up front; no teacher_uri, the other trainer's settings or a bad kd_coef are refused."""
    from flows import common, table
    from stages.common import ConfigError, load_config

    raft = cli._flow_module("raft")
    p = raft.Params(demo=True, trainer="kd", kd={"teacher_uri": "/models/teacher", "kd_coef": 0.5})
    common.validate(p, "raft", raft.checks(p))
    assert table.iteration("raft", p) == ("generate", "score", "filter", "kd", "eval")
    assert table.calls_per_iteration("raft", p) == 5 and "sft" in table.iteration("raft", raft.Params(demo=True))
    with pytest.raises(ConfigError, match=r"raft: trainer=kd needs kd.teacher_uri"):
        raft.checks(raft.Params(demo=True, trainer="kd", kd={"kd_coef": 0.5}))
    with pytest.raises(ConfigError, match=r"raft: trainer=kd does not read sft_loop settings"):
        raft.checks(raft.Params(demo=True, trainer="kd", kd={"teacher_uri": "t"}, sft_loop={"learning_rate": 1e-4}))
    with pytest.raises(ConfigError, match=r"raft: trainer=sft does not read kd settings"):
        raft.checks(raft.Params(demo=True, kd={"teacher_uri": "t"}))
    with pytest.raises(ConfigError, match=r"kd.kd_coef: Input should be less than or equal to 1"):
        load_config(raft.Params, None, {"demo": True, "trainer": "kd", "kd": {"teacher_uri": "t", "kd_coef": 1.5}})


def test_how_to_pages_prefect_commands_are_complete_and_the_deployment_test_runs_their_pages():
    """Each `prefect` command of a how-to page is a whole command line (a deployment named, every argument
    given: only the placeholder SCHEDULE_ID, which the test fills in); the pages holding them are the ones
    tests/flows/test_deployment.py runs."""
    import shlex

    found = {p.name: prefect_documented(p) for p in HOW_TO}
    assert {name for name, cmds in found.items() if cmds} == set(PREFECT_PAGES)
    cmds = [c for cs in found.values() for c in cs]
    assert "prefect deployment run 'iterative-dpo/demo' --watch" in cmds and len(cmds) >= 15
    for c in cmds:
        argv = shlex.split(c.rstrip("& "))
        assert argv[0] == "prefect" and not [a for a in argv if PLACEHOLDER.match(a) and a != "SCHEDULE_ID"], c
        if argv[1:3] == ["deployment", "run"] or argv[1:3] == ["deployment", "schedule"]:
            assert re.fullmatch(r"[\w-]+/[\w-]+", argv[3] if argv[2] == "run" else argv[4]), c


def test_a_deployment_run_s_params_are_validated_after_the_merge_naming_the_field():
    """flows.common.run_params: a loop's `params` as Prefect passes them (a dict: the flows take them
    unvalidated) become the flow's model; a bad value or a typo is refused naming `params.section.field`;
    a model (a local call, `rlhf-flows run`) is taken as it is."""
    from flows import common
    from stages.common import ConfigError

    raft = cli._flow_module("raft")
    p = common.run_params({"demo": True, "sft_loop": {"learning_rate": 1e-4}}, raft.Params)
    assert isinstance(p, raft.Params) and p.sft_loop.learning_rate == 1e-4 and p.iterations == 3
    assert common.run_params(p, raft.Params) is p
    with pytest.raises(ConfigError) as e:
        common.run_params({"iterations": 0, "sft_loop": {"learning_rate": -1, "lr": 2}}, raft.Params)
    assert str(e.value).splitlines() == ["invalid flow parameters:",
                                         "  params.iterations: Input should be greater than or equal to 1",
                                         "  params.sft_loop.learning_rate: Input should be greater than 0",
                                         "  params.sft_loop.lr: unknown field (typo?)"]
