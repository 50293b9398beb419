"""What the loop flows share: their parameters, up-front validation, the inputs before iteration 1 (demo
inputs, prompt sets, SFT warm-up, reward model), the rollout (generate + score), evaluation and the
iteration loop with its stop conditions. How a stage is called: flows/calls.py; the run lock: flows/lock.py;
the report: flows/report.py.

Resume does not depend on Prefect's database: every stage writes a committed manifest under
`{root}/{run_name}/...`, and a rerun with the same run_name skips each stage whose manifest matches its
fingerprint (any machine, fresh Prefect database). Prefect's cache is a second layer (flows.tasks.run_stage).
"""
from __future__ import annotations

import copy
import functools
import json
import time
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from flows import calls, lock, promotion, table
from flows.calls import call, settings, stage, stage_config
from flows.credentials import use_credentials
from flows.report import Report, training_columns
from rlhf_core import store
from stages.common import ConfigError, merge


# ---------------------------------------------------------------------------------------------- demo inputs
def demo_inputs(root: str, run_name: str, seed: int = 0, storage_options: dict | None = None) -> dict[str, str]:
    """The demo's inputs under `{root}/{run_name}/inputs/`, built offline and idempotently: a tiny policy and
    a tiny reward-model base (committed artifacts sharing one tokenizer) and OpenRLHF-format JSONL files
    (prompts, SFT warm-up rows, gold-labelled preference pairs, held-out eval prompts)."""
    import tempfile

    from rlhf_core.demo import demo_task, tiny

    base = store.join(root, run_name, "inputs")
    uris = {"policy": store.join(base, "policy"), "reward_base": store.join(base, "reward_base")}
    writers = {k: store.ArtifactWriter(u, "tiny-model", {"kind": k, "seed": seed}, storage_options=storage_options)
               for k, u in uris.items()}
    if not all(w.existing() for w in writers.values()):
        with tempfile.TemporaryDirectory() as tmp:
            policy, reward = tiny.build_tiny_pair(tmp, demo_task.corpus(seed), seed=seed)
            for (k, w), local in zip(writers.items(), (policy, reward)):
                w.begin()
                w.upload_dir(local)
                w.commit(metrics={"seed": seed})
    files = {"prompts": demo_task.prompts(256, seed), "sft": demo_task.sft_rows(1024, seed),
             "preferences": demo_task.preference_rows(1024, seed), "eval_prompts": demo_task.prompts(48, seed, held_out=True)}
    fs, path = store.filesystem(base, storage_options)
    for name, rows in files.items():
        uris[name] = store.join(base, f"{name}.jsonl")
        target = store.join(path, f"{name}.jsonl")
        if not fs.exists(target):  # deterministic content; rewriting would only change the mtime-based lineage
            store.check_fence()
            with fs.open(target + ".tmp", "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
            fs.mv(target + ".tmp", target)
    return uris


# ---------------------------------------------------------------------------------------------- stage sections
# Fields a flow sets itself, beyond output_uri, storage_options and the input URIs it wires in.
FLOW_SET = {"prepare": ("kind", "data", "split", "tokenizer_uri"), "filter": ("method",), "generate": ("iter",)}
# Inputs that stay the user's in a section (every other *_uri / *_path / *_url / *_file field is wired by the flow).
USER_INPUTS = {"kd": ("teacher_uri",), "ppo": ("critic_uri", "agent_func_path", "eval_prompts_uri", "teacher_uri")}


def _flow_sets(name: str, field: str) -> bool:
    if field in ("output_uri", "storage_options") or field in FLOW_SET.get(name, ()):
        return True
    return field.endswith(("_uri", "_path", "_url", "_file")) and field not in USER_INPUTS.get(name, ())


@functools.cache
def section(name: str) -> type[BaseModel]:
    """The typed settings of stage `name` in a flow's parameters: the stage Config's fields with their types,
    defaults, descriptions and per-field checks, less the fields the flow sets. The Prefect run form shows one
    input per setting with its default, the server refuses an unknown key or a wrong type, and a key the flow
    sets is refused by name. The stage's cross-field checks run in `validate`, before any work."""
    config = stage(name).Config
    fields, wired = {}, []
    for key, info in config.model_fields.items():
        if _flow_sets(name, key):
            wired.append(key)
            continue
        info = copy.copy(info)
        if info.is_required():  # a user input the stage requires (kd's teacher_uri): optional here, checked later
            fields[key] = (Optional[info.annotation], Field(None, description=info.description))
        else:
            fields[key] = (info.annotation, info)

    def refuse_wired(cls, data):
        if data is None:  # `sft=null` on the command line: no settings
            return {}
        if isinstance(data, dict) and (given := [k for k in wired if k in data]):
            raise ValueError(f"{', '.join(f'{name}.{k}' for k in given)} is set by the flow (from its own parameters: "
                             f"pretrain_uri, prompt_data, the reward source, root, storage_options): remove it")
        return data

    title = "".join(part.title() for part in name.split("_")) + "Settings"
    return create_model(title, __config__=ConfigDict(extra="forbid", title=f"{name} settings"),
                        __doc__=f"Settings of the {name} stage (stages/{name}.py); inputs and outputs are wired by the flow.",
                        __validators__={"refuse_wired": model_validator(mode="before")(classmethod(refuse_wired))},
                        **fields)


PrepareSettings, SftSettings, TrainRmSettings = section("prepare"), section("sft"), section("train_rm")
GenerateSettings, ScoreSettings, FilterSettings, EvalSettings = (section("generate"), section("score"), section("filter"),
                                                                 section("eval"))


# ---------------------------------------------------------------------------------------------- loop pieces
class LoopParams(BaseModel):
    """Parameters of a loop flow: the Prefect UI form, checked by the server; also loaded from YAML.
    Data sources are OpenRLHF-format files or committed artifacts on any URI. Per-stage dicts hold that
    stage's Config fields (URIs excepted); they are validated against the stage configs before any work."""

    model_config = ConfigDict(extra="forbid")
    root: str = Field(lock.DEFAULT_ROOT, description="Artifact root: a folder, file://, s3://bucket/prefix, gs://...")
    run_name: str = Field("demo", pattern=r"^([A-Za-z0-9._-]|\{scheduled\})+$", description="Run folder under root; rerun = "
                          "resume. `{scheduled}` is replaced by the flow run's scheduled start (e.g. nightly-{scheduled} "
                          "-> nightly-2026-11-27T0300Z): one folder per scheduled run, the same for its retries.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description=
                                            "fsspec options: endpoint, region... never credentials.")
    credentials_block: str | None = Field(None, description="Name of a Prefect Secret block holding a JSON object of "
                                          "environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) for "
                                          "this run; unset: the worker's own environment.")
    _no_secrets = field_validator("storage_options")(classmethod(lambda cls, v: store.check_no_secrets(v)))
    demo: bool = Field(False, description="Build the demo inputs (tiny models, toy-review data) offline first.")
    iterations: int = Field(3, ge=1, description="Number of loop iterations.")
    stop_when_gain_below: float | None = Field(None, description="Stop when eval gold/RM reward gains less than this.")
    max_wall_time_s: float | None = Field(None, gt=0, description="Stop starting new iterations after this many seconds.")
    promote_min_gain: float | None = Field(None, description="Promotion gate (flows/promotion.py): promote an iteration's "
                                           "policy ({run}/current.json, a Prefect artifact, the flow's result) only when its eval "
                                           "beats the promoted one by at least this on promote_metric; unset: no gate.")
    promote_metric: Literal["gold_reward", "rm_reward"] | None = Field(None, description="What the gate compares: held-out "
                                                                          "gold reward, or RM reward (default: gold where the loop has it).")
    promote_max_kl: float | None = Field(None, ge=0, description="Promote only with eval KL to the run's starting policy at most this.")
    stop_when_not_promoted: bool = Field(False, description="Stop the loop after an iteration the gate did not promote.")
    lineage: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$", description="Runs of one lineage (a nightly deployment) "
                                "continue from each other: a run starts from the policy the lineage last promoted "
                                "({root}/_lineages/{lineage}.json; its first run from pretrain_uri) and moves it when it "
                                "promotes. Needs promote_min_gain.")
    lock_lease_s: float = Field(120.0, gt=0, description="A lock not refreshed for this long is stale.")
    pools: dict[str, str] = Field(default_factory=dict, description="Work pool per stage, e.g. {generate: gpu-vllm, dpo: "
                                  "gpu-train}: those stages run as deployments on their pools (flows/pools.py); the "
                                  "others in the flow's own process.")
    use_tensorboard: bool = Field(False, description="TensorBoard event files of the per-iteration report in {run}/tensorboard/.")
    use_wandb: bool = Field(False, description="A W&B run of the per-iteration report (online with WANDB_API_KEY, else offline in {run}/wandb/).")
    wandb_project: str = Field("rlhf-flows", description="W&B project.")

    pretrain_uri: str | None = Field(None, description="Initial policy (model artifact). demo=true: the tiny policy.")
    reward_uri: str | None = Field(None, description="Reward model artifact; if unset, one is trained on preference_data.")
    reward_func_file: str | None = Field(None, description="Python file with reward_func(queries, prompts, labels), instead of an RM.")
    reward_url: str | None = Field(None, description="Remote reward server (e.g. `rlhf-flows serve-rm MODEL`), instead of an RM; "
                                   "score.timeout_s / score.retries apply.")
    reward_base_uri: str | None = Field(None, description="Model train_rm starts from (default: the reward base of the demo, else pretrain_uri).")
    sft_data: str | None = Field(None, description="SFT warm-up data (input/output rows); skipped if unset.")
    preference_data: str | None = Field(None, description="Preference pairs for train_rm.")
    prompt_data: str | None = Field(None, description="Prompts the loop generates from (sliced per iteration).")
    eval_prompt_data: str | None = Field(None, description="Held-out prompts for evaluation after each iteration.")
    gold_reward_file: str | None = Field(None, description="Python file with a gold reward_func for evaluation (the demo's).")
    prepare: PrepareSettings = Field(default_factory=PrepareSettings, description="Keys for raw sources: input_key, apply_chat_template, ...")
    train_split: str = Field("train", description="Split of prompt_data read where it has splits (OpenRLHF --train_split).")
    eval_split: str = Field("test", description="Split of eval_prompt_data read where it has splits (OpenRLHF --eval_split).")
    sft: SftSettings = Field(default_factory=SftSettings, description="SFT warm-up settings.")
    train_rm: TrainRmSettings = Field(default_factory=TrainRmSettings, description="Reward-model training settings.")
    generate: GenerateSettings = Field(default_factory=GenerateSettings, description="Generation settings (backend, best_of_n, ...).")
    score: ScoreSettings = Field(default_factory=ScoreSettings, description="Scoring settings.")
    filter: FilterSettings = Field(default_factory=FilterSettings, description="Filter settings.")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Evaluation settings.")


# ---------------------------------------------------------------------------------------------- run parameters
def deployment_merged(raw: dict) -> dict:
    """This flow run's `params` over its deployment's, section by section (stages.common.merge); `raw` outside a
    deployment's run. Prefect 3.7 merges them at the top level only (its server's create_flow_run_from_deployment
    does `deployment.parameters.update(run's)` for `prefect deployment run`, the UI's form and a trigger; its
    scheduler `{**deployment's, **schedule's}`): a run's `params` would replace the deployment's as a whole."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.exceptions import ObjectNotFound

    ctx = FlowRunContext.get()
    if not (ctx and ctx.flow_run and ctx.flow_run.deployment_id):
        return raw
    try:
        with get_client(sync_client=True) as client:
            return merge(client.read_deployment(ctx.flow_run.deployment_id).parameters.get("params") or {}, raw)
    except ObjectNotFound:
        calls.run_logger().warning("deployment %s is gone: this run's own params are all it has", ctx.flow_run.deployment_id)
        return raw


def run_params(params: LoopParams | dict, model: type[LoopParams]) -> LoopParams:
    """The loop's parameters: a model as given (a local call, `rlhf-flows run FLOW`), else the run's `params` merged over
    its deployment's and validated here, errors naming `params.section.field` (the loops are flows with
    validate_parameters=False: Prefect would validate the run's partial dict before the body; its server still
    checks keys and types against the typed schema, the UI's form). The merged dict is written back to the flow
    run (the UI shows what ran; a Retry reruns that, whatever a redeploy changed) and into its context (for pools)."""
    if isinstance(params, BaseModel):
        return params
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    merged = deployment_merged(params or {})
    try:
        p = model.model_validate(merged)
    except ValidationError as e:
        raise ConfigError("invalid flow parameters:\n" + "\n".join(
            f"  params.{'.'.join(map(str, err['loc']))}: "
            + ("unknown field (typo?)" if err["type"] == "extra_forbidden" else err["msg"]) for err in e.errors())) from None
    if (ctx := FlowRunContext.get()) is not None and ctx.flow_run is not None:
        if merged != params:
            with get_client(sync_client=True) as client:
                client.update_flow_run(ctx.flow_run.id, parameters={**ctx.flow_run.parameters, "params": merged})
        ctx.parameters["params"] = p
    return p


def flow_run_name() -> str:
    """A loop's flow run is named after its run folder (`run_name`; the deployment's where the run does not set it)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters.get("params")
    name = deployment_merged(p).get("run_name") if isinstance(p, dict) else getattr(p, "run_name", None)
    return calls.scheduled_name(str(name or LoopParams.model_fields["run_name"].default))


def setup(p: LoopParams, flow_name: str, checks: dict | None = None) -> dict:
    """Before any work: credentials are in the environment, the store answers and every stage config is valid.
    A `{scheduled}` run_name becomes this flow run's folder name here (p.run_name is the folder from now on)."""
    p.run_name = calls.scheduled_name(p.run_name)
    if p.credentials_block:
        use_credentials(p.credentials_block)
    store.check_reachable(p.root, p.storage_options)
    validate(p, flow_name, checks)
    if p.pools:
        from flows import pools

        pools.check(p.pools, flow_name)
    return {"flow": flow_name}


def validate(p: LoopParams, flow_name: str, checks: dict | None = None) -> None:
    """Every stage config the flow will build is valid (errors name `stage.field`): the shared stages from
    their LoopParams fields, the flow's own stages (flows/table.py) from `checks` (stage module -> its
    settings). Placeholder URIs stand in for the inputs the loop wires in."""
    if len(given := [f for f in ("reward_uri", "reward_func_file", "reward_url") if getattr(p, f)]) > 1:
        raise ConfigError(f"{flow_name}: set one reward source, not {' and '.join(given)}")
    if given and (unused := [f for f in ("train_rm", "preference_data", "reward_base_uri")
                             if (settings(p.train_rm) if f == "train_rm" else getattr(p, f))]):
        raise ConfigError(f"{flow_name}: {given[0]} is the reward, so no reward model is trained and "
                          f"{', '.join(unused)} would be ignored: remove them (on the command line: "
                          f"{' '.join(u + '=null' for u in unused)})")
    if not (p.demo or p.sft_data) and settings(p.sft):
        raise ConfigError(f"{flow_name}: sft settings apply to the SFT warm-up on sft_data, which is not set: "
                          "remove them (on the command line: sft=null)")
    for k in ("prm_aggregate", "prm_tokens", "prm_step_separator"):  # whether reward_uri is a PRM: the score stage checks
        if getattr(p.score, k) and not p.reward_uri:
            raise ConfigError(f"{flow_name}: score.{k} applies to a process reward model given as reward_uri")
    own = [(module, base) for module, base in (checks or {}).items()]
    for module, base in [(stage(n), {**table.FIXED.get(n, {}), **settings(getattr(p, n))}) for n in table.SHARED] + own:
        name = module.__name__.rsplit(".", 1)[-1]
        stage_config(module, base, **{f: "placeholder://" for f, info in module.Config.model_fields.items()
                                      if (info.is_required() or f in table.WIRED.get(name, ())) and f not in base})
    spec = table.FLOWS.get(flow_name)
    missing = [s for s in (table.iteration(flow_name, p) if spec else ()) if s not in table.SHARED
               and s not in {m.__name__.rsplit(".", 1)[-1] for m, _ in own}]
    if missing:  # a flow whose table entry and checks() disagree: a bug, said before any work
        raise ConfigError(f"{flow_name}: stages {missing} of flows/table.py are not in the flow's checks()")
    promotion.check(p, flow_name)
    if not p.demo:
        missing = [f for f in ("pretrain_uri", "prompt_data") if not getattr(p, f)]
        if not (p.reward_uri or p.reward_func_file or p.reward_url or p.preference_data):
            missing.append("reward_uri (or reward_func_file, reward_url, or preference_data to train one)")
        if missing:
            raise ConfigError(f"{flow_name}: missing {', '.join(missing)} (or set demo=true)")


def prepare_inputs(p: LoopParams, run: dict):
    """Demo inputs, committed prompt sets, SFT warm-up and reward model: everything before iteration 1.
    Returns (policy_uri, score kwargs naming the reward source, prompts_uri, Report with iteration 0)."""
    at = lambda stage: store.run_prefix(p.root, p.run_name, stage)  # noqa: E731
    so = p.storage_options
    carried = promotion.start_policy(p)  # first: a lineage pointer naming a changed artifact is refused before any work
    d = demo_inputs(p.root, p.run_name, storage_options=so) if p.demo else {}
    policy = p.pretrain_uri or d["policy"]
    prompt_data, eval_data = p.prompt_data or d.get("prompts"), p.eval_prompt_data or d.get("eval_prompts")
    sft_data, pref_data = p.sft_data or d.get("sft"), p.preference_data or d.get("preferences")
    if carried:  # a lineage's later run: its first run did the SFT warm-up
        calls.run_logger().info("lineage %s: starting from its promoted policy %s%s", p.lineage, carried,
                                " (SFT warm-up skipped)" if sft_data else "")
        policy, sft_data = carried, None
    gold = p.gold_reward_file or (_demo_gold() if p.demo else None)
    planned = (1 + 2 * bool(eval_data) + bool(sft_data) + (not (p.reward_uri or p.reward_func_file or p.reward_url))
               + p.iterations * table.calls_per_iteration(run["flow"], p))
    report = Report(run["flow"], p.root, p.run_name, so, stages=planned,
                    tracking={"tensorboard": p.use_tensorboard, "wandb": p.use_wandb, "project": p.wandb_project})
    report.gate = promotion.Gate(p, run["flow"]) if p.promote_min_gain is not None else None

    prepare = stage("prepare")
    prompts = call(prepare, stage_config(prepare, {"kind": "prompts", **settings(p.prepare), "split": p.train_split}, data=prompt_data,
                                              tokenizer_uri=_tok(p, policy), output_uri=at("prompts"), storage_options=so))
    if run["flow"] != "ppo":  # ppo passes over all prompts each iteration; the others slice them
        _check_slices(p, prompts["rows"])
    eval_prompts = None
    if eval_data:
        eval_prompts = call(prepare, stage_config(prepare, {"kind": "prompts", **settings(p.prepare), "split": p.eval_split}, data=eval_data,
                                                       tokenizer_uri=_tok(p, policy), output_uri=at("eval_prompts"),
                                                       storage_options=so))["uri"]
    if sft_data:
        sft = stage("sft")
        policy = call(sft, stage_config(sft, p.sft, policy_uri=policy, dataset_uri=sft_data, output_uri=at("sft"),
                                             storage_options=so))["uri"]
        report.links["sft"] = policy
    if p.reward_uri or p.reward_func_file or p.reward_url:
        reward = ({"reward_model_uri": p.reward_uri} if p.reward_uri else {"remote_rm_url": p.reward_url} if p.reward_url
                  else {"reward_func_path": p.reward_func_file})
    else:
        rm = stage("train_rm")
        base = p.reward_base_uri or d.get("reward_base") or p.pretrain_uri
        reward = {"reward_model_uri": call(rm, stage_config(rm, p.train_rm, base_uri=base, dataset_uri=pref_data,
                                                                 output_uri=at("reward_model"), storage_options=so))["uri"]}
    report.links.update({"prompts": prompts["uri"], **({"reward_model": reward.get("reward_model_uri")}
                                                       if reward.get("reward_model_uri") else {})})
    report.eval_cfg = dict(prompts_uri=eval_prompts, gold_reward_file=gold, reward_model_uri=reward.get("reward_model_uri"),
                           remote_rm_url=reward.get("remote_rm_url"), reference_uri=policy,  # KL to the initial policy
                           **{k: getattr(p.score, k) for k in ("prm_aggregate", "prm_tokens", "prm_step_separator")
                              if getattr(p.score, k)})  # a PRM scores the eval samples as score does
    evaluate_and_report(p, report, 0, policy, reward, [])
    return policy, reward, prompts["uri"], report


def _tok(p: LoopParams, policy: str) -> str | None:
    return policy if p.prepare.apply_chat_template else None


def _demo_gold() -> str:
    from rlhf_core.demo import demo_task

    return demo_task.__file__


def _check_slices(p: LoopParams, n_prompts: int) -> None:
    """OpenRLHF slices prompts by iteration: [k*R, (k+1)*R). Refuse a run whose last slice is past the end."""
    r = p.generate.rollout_batch_size
    if p.iterations * r > n_prompts:
        raise ConfigError(f"iterations x generate.rollout_batch_size = {p.iterations} x {r} = {p.iterations * r} "
                          f"prompts, but the prompt set has {n_prompts}: iteration {n_prompts // r + 1} would be "
                          "past the end (lower iterations or rollout_batch_size, or add prompts)")


def _seconds(m: dict) -> float | None:
    import datetime as dt

    try:
        return round((dt.datetime.fromisoformat(m["finished_at"]) - dt.datetime.fromisoformat(m["created_at"])).total_seconds(), 2)
    except (KeyError, ValueError):
        return None


def evaluate_and_report(p: LoopParams, report: Report, k: int, policy: str, reward: dict, manifests: list[dict]) -> dict:
    """Evaluate `policy` on the held-out prompts and add iteration k's row to the report."""
    row: dict[str, Any] = {"iteration": k}
    by_stage = {m["stage"]: m for m in manifests}
    if "generate" in by_stage:
        row["samples"] = by_stage["generate"]["metrics"].get("samples")
    if "score" in by_stage:
        row["train_rm_reward"] = by_stage["score"]["metrics"].get("reward_mean")
    if "filter" in by_stage:
        fm = by_stage["filter"]["metrics"]
        row["kept"] = fm.get("rows_out")
        row["ties_dropped"] = fm.get("dropped_ties")
    if "ppo" in by_stage:
        pm = by_stage["ppo"]["metrics"]
        row.update(ppo_reward_first=pm.get("first_reward"), ppo_reward_last=pm.get("last_reward"), ppo_kl=pm.get("last_kl"),
                   ppo_steps=pm.get("steps_done"))
        if pm.get("eval_last"):  # eval_steps: the last held-out evaluation inside the run, and the best kept
            row.update(ppo_eval_pass1=pm["eval_last"].get("eval_pass1"))
        if pm.get("best_eval"):
            row.update(ppo_best=pm["best_eval"]["value"], ppo_best_step=pm["best_eval"]["step"])
        fs, path = store.filesystem(by_stage["ppo"]["uri"], p.storage_options)
        with fs.open(store.join(path, "training_log.json")) as f:
            report.add_steps(k, json.load(f))
        files = store.read_manifest(by_stage["ppo"]["uri"], storage_options=p.storage_options).files
        sampled = sorted(f["path"] for f in files if f["path"].startswith("rollouts/"))
        if sampled:  # the last logged step's rollouts (rollout_samples_per_step), the report's rollouts card
            import pyarrow as pa
            import pyarrow.parquet as pq

            report.rollouts = pq.ParquetFile(pa.BufferReader(fs.cat_file(store.join(path, sampled[-1])))).read().to_pylist()
    for name in ("dpo", "kto", "sft", "kd"):
        if name in by_stage:
            tm = by_stage[name]["metrics"]
            row.update(training_columns(name, tm))
    ec = report.eval_cfg
    if ec.get("prompts_uri") and (ec.get("reward_model_uri") or ec.get("remote_rm_url") or ec.get("gold_reward_file")):
        ev = stage("eval")
        em = call(ev, stage_config(ev, p.eval, policy_uri=policy, output_uri=store.run_prefix(p.root, p.run_name, "eval", k),
                                        storage_options=p.storage_options, **report.eval_cfg))
        row.update({key: em["metrics"].get(key) for key in ("rm_reward", "gold_reward", "kl")})
        row["response_length"] = em["metrics"].get("response_tokens_mean")
        by_stage["eval"] = em
        for name, variant in report.eval_variants.items():  # e.g. conditional SFT under its low condition
            vm = call(ev, stage_config(ev, p.eval, policy_uri=policy, storage_options=p.storage_options,
                                            output_uri=store.run_prefix(p.root, p.run_name, f"eval_{name}", k),
                                            **{**report.eval_cfg, **variant}))
            row.update({f"{key}_{name}": vm["metrics"].get(key) for key in ("rm_reward", "gold_reward")})
            by_stage[f"eval_{name}"] = vm
    row.update({f"{s}_s": _seconds(m) for s, m in by_stage.items()})
    if report.gate:
        report.gate.decide(k, row, policy, by_stage["eval"])
    report.add(row, {f"iter-{k}/{s}": m["uri"] for s, m in by_stage.items()} | {f"iter-{k}/policy": policy})
    return row


def iterations(p: LoopParams, report: Report):
    """k = 1..p.iterations, stopping early (reason recorded) on max_wall_time_s before an iteration or on
    stop_when_gain_below / stop_when_not_promoted after one."""
    for k in range(1, p.iterations + 1):
        if (why := out_of_time(p, report)):
            report.stop_reason = why
            return
        yield k
        if (why := converged(p, report) or not_promoted(p, report)):
            report.stop_reason = why
            return


def rollout(p: LoopParams, k: int, policy: str, prompts: str, reward: dict, **generate) -> tuple[dict, dict]:
    """Iteration k's samples from `policy` on prompt slice k-1 (OpenRLHF's --iter), and their scores.
    `generate`: settings of this iteration's generate stage over p.generate's."""
    gen, score = stage("generate"), stage("score")
    at = lambda stage: store.run_prefix(p.root, p.run_name, stage, k)  # noqa: E731
    samples = call(gen, stage_config(gen, {**settings(p.generate), **generate}, policy_uri=policy, prompts_uri=prompts, iter=k - 1,
                                               output_uri=at("generate"), storage_options=p.storage_options))
    scored = call(score, stage_config(score, p.score, samples_uri=samples["uri"], **reward, output_uri=at("score"),
                                           storage_options=p.storage_options))
    return samples, scored


def out_of_time(p: LoopParams, report: Report) -> str | None:
    if p.max_wall_time_s and time.time() - report.started > p.max_wall_time_s:
        return f"max_wall_time_s={p.max_wall_time_s:g} reached after {len(report.rows) - 1} iterations"
    return None


def converged(p: LoopParams, report: Report) -> str | None:
    """`stop_when_gain_below`: the eval reward (gold if the task has one, else RM) gained less than the threshold."""
    if p.stop_when_gain_below is None or len(report.rows) < 2:
        return None
    key = "gold_reward" if report.rows[-1].get("gold_reward") is not None else "rm_reward"
    prev, last = report.rows[-2].get(key), report.rows[-1].get(key)
    if prev is None or last is None:
        return None
    if last - prev < p.stop_when_gain_below:
        return (f"{key} gained {last - prev:+.4f} in iteration {report.rows[-1]['iteration']}, "
                f"below stop_when_gain_below={p.stop_when_gain_below:g}")
    return None


def not_promoted(p: LoopParams, report: Report) -> str | None:
    """`stop_when_not_promoted`: the gate kept the promoted policy after this iteration."""
    last = report.gate.decisions[-1] if report.gate and report.gate.decisions else None
    if p.stop_when_not_promoted and last and not last["promoted"]:
        return f"iteration {last['iteration']} not promoted ({last['reason']}): stop_when_not_promoted"
    return None
