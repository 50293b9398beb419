"""Bad flow input and faults: clear errors naming the field / stage / URI / endpoint, nothing lost."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from flows import common, lock
from rlhf_core.store import locks
from flows.iterative_dpo import Params, iterative_dpo
from rlhf_core import store
from flows.tasks import StageFailed
from stages.common import ConfigError, load_config


def test_typo_in_a_stage_setting_is_named_before_any_work(tmp_path):
    """The stage sections are typed (flows.common.section): a typo, a wrong type or a key the flow sets is
    refused when the parameters are read, each named."""
    with pytest.raises(ConfigError) as e:
        load_config(Params, None, ["demo=true", f"root={tmp_path}", "dpo.bta=0.2", "generate.temperature=-1",
                                   "dpo.beta=abc", "reference.pairs_uri=x"])
    msg = str(e.value)
    assert "dpo.bta: unknown field (typo?)" in msg and "dpo.beta: Input should be a valid number" in msg, msg
    assert "generate.temperature: Input should be greater than or equal to 0" in msg, msg
    assert "reference.pairs_uri is set by the flow" in msg, msg
    assert not any(tmp_path.iterdir())  # nothing written


def test_iterations_below_one_and_unknown_flow_key():
    with pytest.raises(ConfigError, match=r"iterations: Input should be greater than or equal to 1"):
        load_config(Params, None, ["iterations=0"])
    with pytest.raises(ConfigError, match=r"iteratons: unknown field"):
        load_config(Params, None, ["iteratons=2"])


def test_prompt_slice_past_the_end_stops_before_training(prefect_harness, tmp_path):
    from flows.cli import DEMO_CONFIG

    p = load_config(Params, DEMO_CONFIG, [f"root={tmp_path}", "run_name=slice", "iterations=5"])
    with pytest.raises(ConfigError, match=r"5 x 64 = 320 prompts, but the prompt set has 256: iteration 5 would be past the end"):
        iterative_dpo(p)
    assert not (tmp_path / "slice" / "sft").exists() and not (tmp_path / "slice" / "_LOCK.json").exists()


@pytest.mark.slow
def test_stage_failure_names_stage_and_uri_and_rerun_resumes(prefect_harness, tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"#{i} Review of the tea:"}) + "\n" for i in range(4)))
    rf = tmp_path / "reward.py"
    rf.write_text("def reward_func(queries, prompts, labels):\n    raise ZeroDivisionError('bad reward')\n")
    over = [f"root={tmp_path / 'runs'}", "run_name=fail", "iterations=1", f"pretrain_uri={tiny.policy_uri}",
            f"prompt_data={prompts}", f"reward_func_file={rf}", "generate.num_engines=0", "generate.best_of_n=2",
            "generate.rollout_batch_size=4", "generate.max_new_tokens=4"]
    with pytest.raises(StageFailed) as e:
        iterative_dpo(load_config(Params, None, over))
    run = tmp_path / "runs" / "fail"
    assert f"stage 'score' failed writing {run}/iter-1/score: RewardError" in str(e.value) and "bad reward" in str(e.value)
    assert not (run / "iter-1" / "score" / store.MANIFEST).exists()
    generated = store.read_manifest(str(run / "iter-1" / "generate"))

    # Fix the reward function (distinct rewards, so every prompt gives a pair) and rerun: generation is reused.
    rf.write_text("import zlib, torch\ndef reward_func(queries, prompts, labels):\n"
                  "    return torch.tensor([zlib.crc32(q.encode()) % 1000 / 1000 for q in queries])\n")
    over += ["dpo.micro_train_batch_size=2", "dpo.train_batch_size=2", "dpo.max_len=32", "reference.max_len=32"]
    report = iterative_dpo(load_config(Params, None, over))
    assert store.read_manifest(str(run / "iter-1" / "generate")).created_at == generated.created_at
    assert store.committed_any(str(run / "iter-1" / "dpo")) and report["stop_reason"] == "completed all iterations"


def test_s3_endpoint_down_fails_fast_naming_it(prefect_harness, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x-secret")
    with pytest.raises(store.StoreUnreachableError, match=rf"127.0.0.1:{port} is unreachable for s3://rlhf/runs"):
        iterative_dpo(load_config(Params, None, ["demo=true", "root=s3://rlhf/runs"]))


def test_run_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path):
    with lock.run_lock(str(tmp_path), "r", lease_s=60):
        with pytest.raises(RuntimeError, match=rf"run {tmp_path}/r is in use by pid {os.getpid()} on"):
            with lock.run_lock(str(tmp_path), "r", lease_s=60):
                pass
    assert not (tmp_path / "r" / lock.LOCK).exists()
    # A lock left by a SIGKILLed process on this host (its pid is gone) is stale at once.
    dead = 2 ** 22 + 12345
    (tmp_path / "r" / lock.LOCK).write_text(json.dumps({"token": "t", **locks.identity(), "pid": dead,
                                                       "refreshed_at": time.time()}))
    with lock.run_lock(str(tmp_path), "r", lease_s=60):
        assert json.loads((tmp_path / "r" / lock.LOCK).read_text())["pid"] == os.getpid()
    # The same host name and a pid that is not alive here, but another pid namespace (a container sharing the
    # host name): its pid says nothing about it, so the lock is honoured until its lease expires.
    (tmp_path / "r" / lock.LOCK).write_text(json.dumps({"token": "t", **locks.identity(), "pid": dead,
                                                       "pidns": "pid:[4026532999]", "refreshed_at": time.time()}))
    with pytest.raises(RuntimeError, match=f"in use by pid {dead} on {socket.gethostname()}"):
        with lock.run_lock(str(tmp_path), "r", lease_s=60):
            pass
    (tmp_path / "r" / lock.LOCK).unlink()
    # A lock from another host is honoured until its lease expires.
    (tmp_path / "r" / lock.LOCK).write_text(json.dumps({"token": "t", "host": "elsewhere", "pid": 1,
                                                          "refreshed_at": time.time() - 30}))
    with pytest.raises(RuntimeError, match="in use by pid 1 on elsewhere"):
        with lock.run_lock(str(tmp_path), "r", lease_s=60):
            pass
    with lock.run_lock(str(tmp_path), "r", lease_s=10):  # 30 s old > 10 s lease: stale
        pass
