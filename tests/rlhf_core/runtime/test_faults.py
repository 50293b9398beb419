"""Test hooks stay out of the user's settings: a job is slowed through rlhf_core.runtime.faults' environment variable,
which no stage config offers; a bad value fails naming the variable."""
import time

import pytest
from pydantic import ValidationError

from rlhf_core.runtime import faults


def test_step_sleep_reads_the_variable_and_refuses_a_bad_value(monkeypatch):
    monkeypatch.delenv(faults.STEP_SLEEP, raising=False)
    assert faults.step_sleep() == 0.0
    monkeypatch.setenv(faults.STEP_SLEEP, "")
    assert faults.step_sleep() == 0.0
    monkeypatch.setenv(faults.STEP_SLEEP, " 0.25 ")
    assert faults.step_sleep() == 0.25
    t0 = time.perf_counter()
    faults.pause_step()
    assert time.perf_counter() - t0 >= 0.25
    t0 = time.perf_counter()
    faults.pause_step(0.0)  # the job's spec said 0: no sleep whatever the environment says
    assert time.perf_counter() - t0 < 0.2
    for bad, said in (("slow", "not a number of seconds"), ("-1", "must be >= 0"), ("nan", "must be >= 0")):
        monkeypatch.setenv(faults.STEP_SLEEP, bad)
        with pytest.raises(ValueError, match=f"{faults.STEP_SLEEP}='{bad}': {said}"):
            faults.step_sleep()


def test_no_stage_offers_a_step_sleep_setting():
    """debug_step_sleep was a typed field of every trainer and of ppo (so it showed in the run form and the settings
    tables): it is gone, and a config that still sets it is refused by name, not ignored."""
    from stages import dpo, kd, kto, ppo, sft, train_prm, train_rm

    for cfg in (sft.Config, dpo.Config, kto.Config, kd.Config, train_rm.Config, train_prm.Config, ppo.Config):
        assert not [f for f in cfg.model_fields if "step_sleep" in f], cfg
    with pytest.raises(ValidationError, match="debug_step_sleep"):
        sft.Config(policy_uri="p", dataset_uri="d", output_uri="o", debug_step_sleep=1.0)


def test_a_training_job_spec_carries_the_step_sleep_of_the_stage_s_environment(monkeypatch, tiny, tmp_path):
    """The stage writes the variable's value into the job's spec (ranks on other nodes read the spec, not this
    environment); unset, the spec says 0."""
    import json

    from rlhf_core.demo import demo_task
    from rlhf_core.inputs import data
    from rlhf_core import store
    from rlhf_core.runtime import jobs
    from stages import sft

    w = store.ArtifactWriter(str(tmp_path / "rows"), "data", {"n": 8})
    w.begin()
    w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(8, 0), "sft"))
    rows = w.commit().uri
    specs = []

    def no_job(cmd, **kw):  # the spec is what we look at: the job itself is not run
        specs.append(json.loads(open(cmd[-1]).read()) if cmd[-1].endswith(".json") else None)
        raise jobs.JobFailed(cmd, 1, ["not run"])

    monkeypatch.setattr(jobs, "run_job", no_job)
    cfg = dict(policy_uri=tiny.policy_uri, dataset_uri=rows, input_template=demo_task.INPUT_TEMPLATE, max_len=48,
               train_batch_size=8, micro_train_batch_size=8)
    for value, expected in (("0.5", 0.5), (None, 0.0)):
        if value is None:
            monkeypatch.delenv(faults.STEP_SLEEP, raising=False)
        else:
            monkeypatch.setenv(faults.STEP_SLEEP, value)
        with pytest.raises(jobs.JobFailed):
            sft.run(sft.Config(**cfg, output_uri=str(tmp_path / f"out-{expected}")))
        assert specs[-1] is not None and specs[-1]["step_sleep"] == expected
