"""The agent executor (rlhf_core.rollout.agent) on an in-process HF rollout engine with the tiny policy: multi-turn
token accounting (feedback appended, action mask), per-step sampling_params (every setting, stops), the three ends
of an episode, an episode's reward as OpenRLHF's MultiTurnAgentExecutor sums it, a file's AgentExecutor picked as
OpenRLHF picks it, concurrency (one batched engine call per turn), the single-turn default, and agent files
refused by name."""
import asyncio
import textwrap
from pathlib import Path

import pytest

from rlhf_core.rollout import agent

from rlhf_core.rollout import episodes
from rlhf_core.inputs import models

# A counting environment: feedback " again ." after each turn, done after `turns` turns; the reward is the
# turn count; each step asks for a lower temperature (recorded) and logs the action's length.
COUNTING = '''
from rlhf_core.rollout.agent import AgentExecutorBase, AgentInstanceBase
SEEN = []

class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        sp = states["sampling_params"]
        SEEN.append((states["label"], self.turn, sp.temperature, sp.max_tokens, states["observation_text"]))
        sp.temperature = sp.temperature / 2
        sp.max_tokens = 3
        done = self.turn >= TURNS
        return {"rewards": float(self.turn), "scores": float(self.turn) / 10, "environment_feedback": " again .",
                "done": done, "sampling_params": sp, "extra_logs": {"action_len": len(states["action_text"])}}

class AgentExecutor(AgentExecutorBase):  # no execute of its own, no AgentInstance given: the file's AgentInstance
    pass
'''


def agent_file(tmp_path: Path, body: str, turns: int = 2, name: str = "env.py") -> str:
    f = tmp_path / name
    f.write_text(f"TURNS = {turns}\n" + textwrap.dedent(body))
    return str(f)


class CountingEngine:
    """The in-process HF engine, counting calls and recording each call's batch size and max_new_tokens."""

    def __init__(self, model_dir):
        from rlhf_core.ppo.engines import HFRollout

        self.hf = HFRollout(str(model_dir))
        self.calls = []

    def generate(self, ids, n, max_new, temperature, top_p, top_k, seed):
        self.calls.append((len(ids), max_new, temperature))
        return self.hf.generate(ids, n, max_new, temperature, top_p, top_k, seed)


@pytest.fixture(scope="module")
def engine(tiny):
    return CountingEngine(tiny.policy_dir)


@pytest.fixture(scope="module")
def tok(tiny):
    return models.load_tokenizer(tiny.policy_dir)


def make_executor(engine, tok, agent_cls=None, max_new=20, max_turns=8, first_max_tokens=None):
    engine.calls.clear()
    return episodes.Executor(episodes.EngineClient([engine], seed=1), encode=lambda s: tok(s, add_special_tokens=False).input_ids,
                          decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                          sampling=agent.SamplingParams(temperature=1.0, max_tokens=first_max_tokens), max_new_tokens=max_new, max_turns=max_turns,
                          agent_cls=agent_cls)


def items(tok, k=4):
    prompts = [f"#{i} Review of the movie: " for i in range(k)]
    return [(i, p, tok(p, add_special_tokens=False).input_ids, f"label{i}") for i, p in enumerate(prompts)]


def test_multi_turn_episodes_append_feedback_and_mask_it(tiny, engine, tok, tmp_path):
    cls = agent.load_agent(agent_file(tmp_path, COUNTING, turns=2))
    ex = make_executor(engine, tok, cls, max_new=40, first_max_tokens=6)
    eps = episodes.run_episodes(ex, items(tok))
    fb = tok(" again .", add_special_tokens=False).input_ids
    seen = cls.step.__globals__["SEEN"]
    for ep, (i, p, pids, label) in zip(eps, items(tok)):
        # the reward: the steps' rewards summed (1 + 2), as OpenRLHF's executor; the score the last step's
        assert ep.turns == 2 and ep.finish_reason == "done" and ep.reward == 3.0 and ep.score == pytest.approx(0.2)
        assert ep.prompt_ids == pids and len(ep.ids) == len(ep.action_mask) == len(ep.logprobs)
        # action 1 (mask 1), feedback (mask 0, log-prob 0), action 2 (mask 1, at most 3 tokens): nothing after done
        zeros = [k for k, m in enumerate(ep.action_mask) if m == 0]
        assert [ep.ids[k] for k in zeros] == fb and all(ep.logprobs[k] == 0.0 for k in zeros)
        first = zeros[0]
        assert 1 <= first <= 6 and all(ep.action_mask[:first]) and 1 <= len(ep.ids) - zeros[-1] - 1 <= 3
        assert all(lp < 0 for lp, m in zip(ep.logprobs, ep.action_mask) if m)  # the engine's own log-probs
        assert "action_len" in ep.extra_logs
        turns = [s for s in seen if s[0] == label]
        assert [(t, temp, mt) for _, t, temp, mt, _ in turns] == [(1, 1.0, 6), (2, 0.5, 3)]  # per-step params honoured
        assert turns[1][4].startswith(p) and turns[1][4].endswith(" again .")  # the observation grows
    # concurrency: the 4 episodes' turns went out as one batched call per turn, with each turn's settings
    assert engine.calls == [(4, 6, 1.0), (4, 3, 0.5)]


def test_episode_ends_at_max_turns_and_at_the_token_budget(engine, tok, tmp_path):
    cls = agent.load_agent(agent_file(tmp_path, COUNTING, turns=100))
    eps = episodes.run_episodes(make_executor(engine, tok, cls, max_new=200, max_turns=3, first_max_tokens=4), items(tok, 2))
    assert all(e.turns == 3 and e.finish_reason == "max_turns" and e.reward == 1.0 + 2.0 + 3.0 for e in eps)
    eps = episodes.run_episodes(make_executor(engine, tok, cls, max_new=12, max_turns=50), items(tok, 2))
    assert all(e.finish_reason == "length" and len(e.ids) == 12 for e in eps)


def test_single_turn_default_runs_through_the_same_executor(engine, tok):
    ex = make_executor(engine, tok, None, max_new=10)
    eps = episodes.run_episodes(ex, items(tok, 3))
    assert engine.calls == [(3, 10, 1.0)]
    for e in eps:
        assert e.turns == 1 and e.reward is None and all(e.action_mask) and 1 <= len(e.ids) <= 10
        assert e.text == tok.decode(e.ids, skip_special_tokens=True)


def test_concurrent_episodes_match_one_at_a_time_in_shape(engine, tok, tmp_path):
    """The same 4 episodes run one at a time take 2 engine calls each (8), concurrently 2 in all."""
    cls = agent.load_agent(agent_file(tmp_path, COUNTING, turns=2))
    ex = make_executor(engine, tok, cls, max_new=40, first_max_tokens=6)
    for it in items(tok):
        episodes.run_episodes(ex, [it])
    assert len(engine.calls) == 8 and all(c[0] == 1 for c in engine.calls)


# ---------------------------------------------------------------------------------------------- bad files
def test_file_without_agent_instance_is_named(tmp_path):
    f = tmp_path / "no_agent.py"
    f.write_text("class Agent:\n    pass\n")
    with pytest.raises(agent.AgentError, match=f"{f} defines no class AgentInstance"):
        agent.load_agent(str(f))
    with pytest.raises(agent.AgentError, match="no such file"):
        agent.load_agent(str(tmp_path / "missing.py"))


@pytest.mark.parametrize("key", ["done", "rewards"])
def test_step_result_without_a_required_key_names_file_and_key(tmp_path, key):
    body = COUNTING.replace(f'"{key}": ', f'"not_{key}": ')
    path = agent_file(tmp_path, body, name=f"lacks_{key}.py")
    cls = agent.load_agent(path)
    with pytest.raises(agent.AgentError, match=rf"{path}: episode 0 \(probe.*turn 1: step's result has no '{key}' key"):
        asyncio.run(episodes.probe(cls, [(0, "p", [], None)]))


def test_step_that_raises_names_episode_and_turn(engine, tok, tmp_path):
    body = COUNTING.replace("        self.turn += 1\n", "        self.turn += 1\n"
                            "        if self.turn == 2 and states['label'] == 'label1':\n"
                            "            raise ValueError('the environment broke')\n")
    path = agent_file(tmp_path, body, turns=3, name="raises.py")
    cls = agent.load_agent(path)
    asyncio.run(episodes.probe(cls, [(0, "p", [], "label1")]))  # turn 1 passes the probe
    with pytest.raises(agent.AgentError, match=rf"{path}: episode 1 \(x\), turn 2: step raised ValueError: the environment broke"):
        episodes.run_episodes(make_executor(engine, tok, cls, first_max_tokens=4), items(tok, 3), lambda k: " (x)")


# ---------------------------------------------------------------------------------------------- dynamic sampling
def test_dynamic_filtering_keeps_in_range_groups_and_counts_rounds(engine, tok, tmp_path):
    """The reward depends on the prompt only: prompts #0..#3 score 1 (every sample right: a group mean of 1,
    outside (0, 1)), the rest 0.5. Step batch [0, 1, 4, 5] keeps 4, 5 and samples 2 more prompts from the
    others (seeded permutation) until 4 in-range groups are kept; with max_rounds 0 the batch is filled up."""
    from types import SimpleNamespace

    from rlhf_core.ppo import rollout as ppo_rollout
    from rlhf_core.rollout.rewards import RewardSpec
    from stages import ppo

    fn = tmp_path / "reward.py"
    fn.write_text("def reward_func(queries, prompts, labels):\n"
                  "    return [1.0 if int(p.split()[0][1:]) < 4 else 0.5 for p in prompts]\n")
    prompts = [{"prompt": f"#{i} Review of the movie: "} for i in range(12)]
    ids = [tok(r["prompt"], add_special_tokens=False).input_ids for r in prompts]
    roles = SimpleNamespace(rollouts=[engine], reward=None)

    def run(**over):
        cfg = ppo.Config(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path=str(fn),
                         advantage_estimator="rloo", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                         generate_max_len=4, dynamic_filtering=True, dynamic_filtering_reward_range=(0.0, 1.0), **over)
        return ppo_rollout.rollout(cfg, roles, prompts, ids, [0, 1, 4, 5], 0, tok, 0, RewardSpec(func_path=str(fn)))

    exp = run()
    m = exp["metrics"]
    assert exp["prompt_indices"][:2] == [4, 5] and all(i >= 4 for i in exp["prompt_indices"])
    assert exp["raw"] == [0.5] * 8 and exp["batch"]["ids"].shape[0] == 8
    assert m["dynamic_filtering_kept"] == 4 and m["dynamic_filtering_filled"] == 0
    # the extra rounds sampled the shortfall: every sampled group was kept or dropped, the dropped ones are
    # exactly the groups of prompts 0..3 (2 from the batch, and any of 2, 3 drawn from the pool)
    assert 1 <= m["dynamic_filtering_rounds"] <= 4 and 2 <= m["dynamic_filtering_dropped"] <= 4
    assert m["dynamic_filtering_sampled"] == m["dynamic_filtering_kept"] + m["dynamic_filtering_dropped"]
    exp = run(dynamic_filtering_max_rounds=0)
    m = exp["metrics"]
    assert (m["dynamic_filtering_rounds"], m["dynamic_filtering_kept"], m["dynamic_filtering_dropped"],
            m["dynamic_filtering_filled"]) == (0, 2, 2, 2)
    assert exp["prompt_indices"] == [4, 5, 0, 1] and exp["raw"] == [0.5] * 4 + [1.0] * 4


def test_dynamic_filtering_range_low_must_be_below_high():
    from stages import ppo
    from stages.common import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"dynamic_filtering_reward_range low must be < high, got \(1.0, 0.0\)"):
        load_config(ppo.Config, None, dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="f.py",
                                           advantage_estimator="rloo", n_samples_per_prompt=2, dynamic_filtering=True, dynamic_filtering_reward_range=(1.0, 0.0)))


def test_episodes_run_from_inside_a_running_event_loop(engine, tok):
    """An async caller (e.g. an async Prefect task) gets the same episodes: run_episodes moves to a thread."""
    async def caller():
        return episodes.run_episodes(make_executor(engine, tok, None, max_new=4), items(tok, 2))

    eps = asyncio.run(caller())
    assert [e.turns for e in eps] == [1, 1] and all(1 <= len(e.ids) <= 4 for e in eps)


# OpenRLHF's examples/python/agent_func.py shape: `async def __init__`, torch tensors for rewards and logs, an
# AgentExecutor subclass; only the import line changed.
OPENRLHF_SHAPE = '''
import torch
from rlhf_core.rollout.agent import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 1

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        done = self.step_idx >= self.max_steps
        reward = torch.tensor([1.0]) if done else torch.tensor(0)
        feedback = "\\n\\nHuman: [CORRECT]\\n</s>" if done else "\\n\\nHuman: [INCORRECT]\\nPlease try again.\\n</s>\\n\\nAssistant: "
        self.step_idx += 1
        return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                "sampling_params": states.get("sampling_params", None), "extra_logs": {"dummy_scores": reward}}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
'''


def test_openrlhf_example_file_runs_after_changing_its_import(engine, tok, tmp_path):
    cls = agent.load_agent(agent_file(tmp_path, OPENRLHF_SHAPE, name="agent_func.py"))
    eps = episodes.run_episodes(make_executor(engine, tok, cls, max_new=60, first_max_tokens=4), items(tok, 2))
    for e in eps:
        assert e.turns == 2 and e.finish_reason == "done" and e.reward == 1.0 and e.extra_logs == {"dummy_scores": 1.0}
        assert 0 in e.action_mask  # the "[INCORRECT] ... Assistant:" feedback is in the tokens, masked


# ---------------------------------------------------------------------------------------------- issue 37
PICKED = """
from rlhf_core.rollout.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):  # not the one AgentExecutor runs
    async def step(self, states, **kwargs):
        raise AssertionError("the executor's instance class runs, not this one")

class Scored(AgentInstanceBase):
    def __init__(self):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": 0.5 * self.turn, "environment_feedback": " ok", "done": self.turn == 2}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(Scored)
"""


def test_the_files_agent_executor_picks_the_instance_class_as_openrlhf(engine, tok, tmp_path):
    """OpenRLHF runs the file's AgentExecutor (vllm_engine._load_agent_executor): a MultiTurnAgentExecutor of the
    class it is given, here Scored, not the file's AgentInstance. Rewards 0.5 and 1.0 -> the episode's 1.5 (the
    sum, OpenRLHF's total_reward), its score the same sum (no 'scores' key)."""
    cls = agent.load_agent(agent_file(tmp_path, PICKED, name="picked.py"))
    assert cls.__name__ == "Scored" and not getattr(cls, "__is_executor__", False)
    eps = episodes.run_episodes(make_executor(engine, tok, cls, max_new=30, first_max_tokens=4), items(tok, 2))
    assert [(e.turns, e.reward, e.score) for e in eps] == [(2, 1.5, 1.5)] * 2


OWN_EXECUTE = """
from rlhf_core.rollout.agent import AgentExecutorBase
MADE = []

class AgentExecutor(AgentExecutorBase):
    def __init__(self):
        MADE.append(self)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        obs = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        sampling_params.max_tokens = 3
        out = (await llm_engine.generate(obs, sampling_params)).outputs[0]
        return {"observation_tokens": obs + list(out.token_ids), "action_ranges": [(len(obs), len(obs) + len(out.token_ids))],
                "rollout_log_probs": [0.0] * len(obs) + [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)],
                "reward": 0.75}
"""


def test_an_agent_executor_with_its_own_execute_runs_every_episode_one_instance_per_run(engine, tok, tmp_path):
    """agent_func_path's AgentExecutor defining execute runs the episodes itself (CustomExecutor), made once (OpenRLHF
    makes one per engine, then calls execute per prompt); the episode's reward is what execute returns."""
    cls = agent.load_agent(agent_file(tmp_path, OWN_EXECUTE, name="own.py"))
    assert cls.__is_executor__
    ex = episodes.CustomExecutor(episodes.EngineClient([engine], 1), tok, lambda ids, **kw: tok.decode(ids, **kw),
                              agent.SamplingParams(), 8, cls)
    eps = episodes.run_episodes(ex, items(tok, 3))
    assert [e.reward for e in eps] == [0.75] * 3 and all(1 <= sum(e.action_mask) <= 3 for e in eps)
    episodes.run_episodes(ex, items(tok, 2))
    assert len(cls.__init__.__globals__["MADE"]) == 1


class FixedEngine:
    """Returns the same 6 tokens [40, 41, 42, 43, 44, 45] for every request; records each call's extra settings."""

    def __init__(self):
        self.kwargs = []

    def generate(self, ids, n, max_new, temperature, top_p, top_k, seed, **kwargs):
        self.kwargs.append(kwargs)
        out = [40, 41, 42, 43, 44, 45][:max_new]
        return [[{"ids": out, "logprobs": [-1.0] * len(out), "finish_reason": "length"}] for _ in ids]


SETTINGS = """
SEEN = []
from rlhf_core.rollout.agent import AgentInstanceBase

class AgentInstance(AgentInstanceBase):
    def __init__(self):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        sp = states["sampling_params"]
        SEEN.append((vars(sp).copy(), states["action_text"]))
        nxt = {"min_tokens": 2, "repetition_penalty": 1.2, "stop_token_ids": [42], "skip_special_tokens": False}
        if self.turn == 2:
            nxt = {"stop": ["cc"], "include_stop_str_in_output": False}
        return {"rewards": 1.0, "environment_feedback": " .", "done": self.turn == 3, "sampling_params": nxt}
"""


def test_every_sampling_setting_reaches_the_agent_and_the_engine(tmp_path):
    """The agent sees all of vLLM's settings the engines honour; what it returns reaches the engine (min_tokens,
    repetition_penalty) or ends the action (stop_token_ids: tokens up to and including 42; stop "cc": up to the
    token completing it, its text cut before "cc"). A dict key the engines do not honour is refused by name."""
    path = agent_file(tmp_path, SETTINGS, name="settings.py")
    cls = agent.load_agent(path)
    eng = FixedEngine()
    text = {40: "a", 41: "b", 42: "c", 43: "c", 44: "d", 45: "e"}
    decode = lambda ids, skip_special_tokens=True: "".join(text[t] for t in ids) + ("" if skip_special_tokens else "<s>")  # noqa: E731
    ex = episodes.Executor(episodes.EngineClient([eng], 1), encode=lambda s: [7] * len(s), decode=decode,
                        sampling=agent.SamplingParams(temperature=0.7, top_p=0.9, top_k=5), max_new_tokens=40,
                        max_turns=5, agent_cls=cls)
    ep = episodes.run_episodes(ex, [(0, "p", [1, 2], None)])[0]
    seen = cls.step.__globals__["SEEN"]
    first = seen[0][0]
    assert {k: first[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "repetition_penalty",
                                  "stop", "stop_token_ids", "skip_special_tokens", "logprobs")} == dict(
        temperature=0.7, top_p=0.9, top_k=5, max_tokens=None, min_tokens=0, repetition_penalty=1.0, stop=None,
        stop_token_ids=None, skip_special_tokens=True, logprobs=0)
    assert seen[0][1] == "abccde"  # turn 1: all 6 tokens
    assert eng.kwargs == [{}, {"min_new_tokens": 2, "repetition_penalty": 1.2}, {}]
    assert seen[1][1] == "abc<s>"  # turn 2: cut after stop token 42, special tokens kept
    assert seen[2][1] == "ab"  # turn 3: the token completing "cc" (43) ends it; the text is cut before "cc"
    actions = [ep.ids[k] for k, m in enumerate(ep.action_mask) if m]
    assert actions == [40, 41, 42, 43, 44, 45] + [40, 41, 42] + [40, 41, 42, 43]
    assert ep.reward == 3.0
    bad = agent_file(tmp_path, SETTINGS.replace('"stop": ["cc"]', '"n": 4'), name="bad_settings.py")
    ex.agent_cls = agent.load_agent(bad)
    with pytest.raises(agent.AgentError, match=r"bad_settings.py: episode 0, turn 2: 'sampling_params': \['n'\] are "
                                               r"not sampling settings the rollout engines honour"):
        episodes.run_episodes(ex, [(0, "p", [1, 2], None)])


def test_hf_engine_takes_min_tokens_and_repetition_penalty(engine):
    """The HF engine's min_new_tokens: no EOS among the first 3 tokens (transformers' processor)."""
    outs = engine.hf.generate([[5, 6, 7]], 4, 6, 1.0, 1.0, 0, 3, min_new_tokens=3, repetition_penalty=1.3)
    assert len(outs[0]) == 4 and all(not set(o["ids"][:3]) & engine.hf.eos_ids for o in outs[0])
