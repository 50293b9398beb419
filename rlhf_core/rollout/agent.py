"""Agent execution: every rollout of the ppo stage is a set of episodes run concurrently (asyncio) over the
rollout engines, token in, token out.

OpenRLHF's contract (openrlhf/utils/agent.py, its agent guide): a Python file (`agent_func_path`) defines

    class AgentInstance(AgentInstanceBase):
        async def reset(self, states):   # states {"observation": prompt, "label": label} -> {"observation": text}
        async def step(self, states):    # states {"observation_text", "action_text", "label", "sampling_params"}
            return {"rewards": ..., "scores": ..., "environment_feedback": text, "done": bool,
                    "sampling_params": ... (optional, for the next turn), "extra_logs": {...} (optional)}

One instance per episode. A turn: the engine continues the episode's tokens (prompt, every action and every
feedback so far); the action's text goes to `step`; the feedback text is tokenized and appended. Only the
model's tokens carry loss (`action_mask` 1), feedback tokens are context (0). An episode ends at `done`, when
`max_new_tokens` tokens (actions and feedback) have been appended, or after `max_turns` turns. As OpenRLHF's
MultiTurnAgentExecutor: the episode's reward is the sum of its steps' `rewards`, its score the last step's
`scores` (that sum without one), and the last step's `extra_logs` become metrics.

The file's `AgentExecutor`, as OpenRLHF uses it (its vllm_engine._load_agent_executor: the class named
AgentExecutor runs every episode): `class AgentExecutor(MultiTurnAgentExecutor)` whose `__init__` passes an
AgentInstance class to `super().__init__` runs that class with the executor here; one that defines its own
`async execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)` (OpenRLHF's
AgentExecutorBase) runs each episode itself (CustomExecutor: `llm_engine` is an EngineHandle over the rollout
engines, vLLM's generate shape, token in, token out; one executor instance per run, as OpenRLHF makes one per
engine) and its `reward` is the episode's. A file without AgentExecutor runs its AgentInstance; an older
OpenRLHF AgentExecutor whose `__init__` takes arguments (v0.8's) runs the file's AgentInstance. ppo's
`agent_executor_path` names an executor file directly. Files written for OpenRLHF run after changing
`from openrlhf.utils.agent import ...` to `from rlhf_core.rollout.agent import ...`.

Sampling parameters: the agent gets a SamplingParams of every setting the rollout engines honour (temperature,
top_p, top_k, max_tokens, min_tokens, repetition_penalty, stop, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, logprobs: vLLM's names) and may return changed ones for its next turn (the object, any
object with these attributes such as a vllm.SamplingParams, or a dict; a dict key outside them is refused by
name). `stop` / `stop_token_ids` end the action where the engine's output first completes one (the tokens up to
and including it are the action, as sampled); `skip_special_tokens` says how `action_text` is decoded.

Without an agent file (the single-turn default) an episode is one generation, done; the stage's reward
source (reward_func, reward model, remote server) then scores every episode in one batch. Same executor,
same token accounting: one rollout path.

Requests of concurrent episodes are batched: whatever episodes are waiting on the engines at one event-loop
tick go out as one `generate` call per engine, grouped by sampling parameters.
"""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from pathlib import Path


class AgentError(RuntimeError):
    """An agent file or one of its episodes failed; the message names the file, the episode and the turn."""


class AgentInstanceBase(ABC):
    """One environment instance per episode (OpenRLHF's base class, same methods)."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """OpenRLHF's executor contract (openrlhf/utils/agent.py AgentExecutorBase): `execute` runs one episode,
    token in, token out. A file named by ppo's agent_executor_path defines `AgentExecutor` of this shape
    (CustomExecutor runs it); in an agent_func_path file an AgentExecutor is not used."""

    def __init__(self, *args, **kwargs):
        pass

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        """-> {"observation_tokens": prompt + every action and feedback token, "action_ranges": [(start, end)]
        of the model's tokens in them, "rollout_log_probs": one per observation token (0 outside actions) or
        None, "reward": float, "scores" (optional), "extra_logs" (optional)}."""
        raise NotImplementedError


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor: `AgentExecutor(MultiTurnAgentExecutor)` with `super().__init__(AgentInstance)`
    runs that AgentInstance class through the executor here (Executor: its turns batched over the engines)."""

    def __init__(self, agent_instance_cls=None, *args, **kwargs):
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError("MultiTurnAgentExecutor's episodes run through rlhf_core.rollout.agent.Executor: an "
                                  "AgentExecutor that defines execute runs it without calling this one")


SingleTurnAgentExecutor = AgentExecutorBase  # OpenRLHF's name, for imports


@dataclass
class SamplingParams:
    """The sampling settings an agent sees each turn and may return changed (vLLM's attribute names)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int | None = None  # None: the episode's remaining budget
    min_tokens: int = 0  # the engine samples no stop / EOS token before this many
    repetition_penalty: float = 1.0
    stop: list[str] | None = None  # the action ends where its text first contains one
    stop_token_ids: list[int] | None = None  # the action ends after the first of these tokens
    include_stop_str_in_output: bool = False  # action_text keeps the stop string
    skip_special_tokens: bool = True  # how action_text is decoded
    logprobs: int | None = 0

    @classmethod
    def coerce(cls, sp, where: str = "sampling_params") -> "SamplingParams":
        """From a SamplingParams, a dict, or any object with these attributes (e.g. vllm.SamplingParams). A dict key
        that is none of them is refused (an AgentError naming it): no setting is dropped unseen."""
        if isinstance(sp, cls):
            return sp
        names = [f.name for f in fields(cls)]
        if isinstance(sp, dict):
            unknown = sorted(set(sp) - set(names))
            if unknown:
                raise AgentError(f"{where}: {unknown} are not sampling settings the rollout engines honour here "
                                 f"({', '.join(names)})")
            got = {k: sp[k] for k in names if k in sp}
        else:
            got = {k: getattr(sp, k) for k in names if hasattr(sp, k)}
        if isinstance(got.get("stop"), str):
            got["stop"] = [got["stop"]]
        nullable = ("max_tokens", "logprobs", "stop", "stop_token_ids")
        return cls(**{k: v for k, v in got.items() if v is not None or k in nullable})

    def key(self, max_new: int) -> tuple:
        """What an engine call depends on (requests with equal keys are batched together)."""
        return (float(self.temperature), float(self.top_p), max(0, int(self.top_k)), int(max_new),
                int(self.min_tokens or 0), float(self.repetition_penalty))

    def cut(self, ids: list[int], decode) -> int:
        """How many of `ids` are the action: up to and including the first stop token id, or the first token whose
        text (`decode(ids)`) completes a stop string; all of them without a stop."""
        end = next((k + 1 for k, t in enumerate(ids) if t in (self.stop_token_ids or ())), len(ids))
        for k in range(1, end + 1) if self.stop else ():
            if any(s and s in decode(ids[:k]) for s in self.stop):
                return k
        return end

    def text(self, ids: list[int], decode) -> str:
        """action_text as vLLM gives it: special tokens skipped or kept (`decode(ids[, skip_special_tokens=False])`),
        a stop string cut off unless kept."""
        text = decode(ids) if self.skip_special_tokens else decode(ids, skip_special_tokens=False)
        hits = [text.find(s) for s in self.stop or () if s and s in text]
        return text[:min(hits)] if hits and not self.include_stop_str_in_output else text


REQUIRED = ("rewards", "done", "environment_feedback")


def _import(path: str, key: str):
    p = Path(path)
    if not p.is_file():
        raise AgentError(f"{key} {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlhf_agent_{abs(hash(str(p.resolve())))}", str(p))
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the user's file: any import error
        raise AgentError(f"{key} {path}: importing it failed: {type(e).__name__}: {e}") from e
    return mod


def _defines_execute(cls) -> bool:
    """Whether an AgentExecutor class runs its episodes itself (its own execute, not one of the bases here)."""
    return callable(getattr(cls, "execute", None)) and getattr(cls, "execute") not in (
        AgentExecutorBase.execute, MultiTurnAgentExecutor.execute)


def _as_executor(cls, path: str, key: str) -> type:
    if not inspect.iscoroutinefunction(getattr(cls, "execute", None)):
        raise AgentError(f"{key} {path}: AgentExecutor.execute must be `async def execute(self, prompt, label, "
                         f"sampling_params, max_length, hf_tokenizer, llm_engine, images=None)` (OpenRLHF's "
                         f"AgentExecutorBase)")
    cls.__agent_path__, cls.__is_executor__ = str(path), True
    return cls


def load_executor(path: str) -> type:
    """The `AgentExecutor` class of an agent_executor_path file (OpenRLHF's AgentExecutorBase shape: an
    `async def execute(...)`); AgentError naming the file when it has none."""
    cls = getattr(_import(path, "agent_executor_path"), "AgentExecutor", None)
    if not inspect.isclass(cls) or not _defines_execute(cls):
        raise AgentError(f"agent_executor_path {path} defines no class AgentExecutor with `async def execute(self, "
                         f"prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None)` "
                         f"(OpenRLHF's AgentExecutorBase)")
    return _as_executor(cls, path, "agent_executor_path")


def load_agent(path: str) -> type:
    """What runs an agent_func_path file's episodes, picked as OpenRLHF picks it (the file's AgentExecutor): an
    executor class (`__is_executor__`) when AgentExecutor defines its own execute; else the AgentInstance class that
    AgentExecutor() hands MultiTurnAgentExecutor (`agent_instance_cls`), or the file's AgentInstance when there is
    no AgentExecutor or it takes constructor arguments (OpenRLHF v0.8's). AgentError naming the file otherwise."""
    mod = _import(path, "agent_func_path")
    ex = getattr(mod, "AgentExecutor", None)
    if inspect.isclass(ex) and _defines_execute(ex):
        return _as_executor(ex, path, "agent_func_path")
    cls = None
    if inspect.isclass(ex) and not inspect.isabstract(ex):
        try:
            cls = getattr(ex(), "agent_instance_cls", None)
        except TypeError:  # v0.8's AgentExecutor(max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
            cls = None
        except Exception as e:  # the user's constructor
            raise AgentError(f"agent_func_path {path}: AgentExecutor() raised {type(e).__name__}: {e}") from e
    where = "AgentExecutor's agent_instance_cls" if cls is not None else "AgentInstance"
    cls = cls or getattr(mod, "AgentInstance", None)
    if not inspect.isclass(cls):
        raise AgentError(f"agent_func_path {path} defines no class AgentInstance (OpenRLHF's contract: "
                         f"class AgentInstance(AgentInstanceBase) with async reset(states) and async step(states), "
                         f"run by `class AgentExecutor(MultiTurnAgentExecutor)`)")
    if not inspect.iscoroutinefunction(getattr(cls, "step", None)):
        raise AgentError(f"agent_func_path {path}: {where}.step must be `async def step(self, states)`")
    cls.__agent_path__ = str(path)
    return cls


async def _instance(cls):
    if inspect.iscoroutinefunction(cls.__init__):  # some OpenRLHF examples declare `async def __init__`
        obj = cls.__new__(cls)
        await obj.__init__()
        return obj
    return cls()


def _number(x, what: str) -> float:
    try:
        v = float(x.item() if hasattr(x, "item") else x)
    except Exception as e:
        raise AgentError(f"{what} is not a number: {x!r}") from e
    if not math.isfinite(v):
        raise AgentError(f"{what} is not finite: {v}")
    return v


def _scalar_logs(logs) -> dict:
    out = {}
    for k, v in (logs or {}).items():
        try:
            out[k] = float(v.float().mean().item() if hasattr(v, "float") else v)
        except (TypeError, ValueError):
            continue  # text logs are not metrics
    return out


@dataclass
class Episode:
    """One finished episode. `ids`, `action_mask`, `logprobs` cover everything after the prompt (actions and
    feedback), one entry per token; feedback tokens have mask 0 and log-prob 0."""
    index: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = "stop"  # done | length (token budget) | max_turns | stop (single turn)
    reward: float | None = None
    score: float | None = None
    extra_logs: dict = field(default_factory=dict)
    text: str = ""  # single turn: the response text, for the reward source


class EngineClient:
    """Batches the generate requests of concurrent episodes onto the rollout engines.

    `engines` are Ray actor handles or plain objects with the engines' `generate(prompt_ids, n, max_new_tokens,
    temperature, top_p, top_k, seed)`; requests waiting at one event-loop tick go out together, one call per
    engine per sampling setting, seeded from (`seed`, flush number, engine)."""

    def __init__(self, engines: list, seed: int):
        self.engines, self.seed = engines, seed
        self.pending: list[tuple[list[int], tuple, asyncio.Future]] = []
        self.flushes = self.calls = 0
        self._scheduled = False

    async def generate(self, ids: list[int], key: tuple) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((ids, key, fut))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().create_task(self._flush())
        return await fut

    async def _flush(self):
        for _ in range(3):  # let every episode that is about to ask join this batch
            await asyncio.sleep(0)
        batch, self.pending, self._scheduled = self.pending, [], False
        groups: dict[tuple, list] = {}
        for req in batch:
            groups.setdefault(req[1], []).append(req)
        self.flushes += 1
        calls = []
        for g, (key, reqs) in enumerate(groups.items()):
            shards = [reqs[i::len(self.engines)] for i in range(len(self.engines))]
            for j, (eng, sh) in enumerate(zip(self.engines, shards)):
                if sh:
                    seed = self.seed * 100003 + self.flushes * 1009 + g * 31 + j
                    calls.append((sh, self._call(eng, [r[0] for r in sh], key, seed)))
        self.calls += len(calls)
        results = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
        for (sh, _), res in zip(calls, results):
            for k, (_, _, fut) in enumerate(sh):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res[k][0])

    @staticmethod
    async def _call(eng, ids: list[list[int]], key: tuple, seed: int):
        temperature, top_p, top_k, max_new, min_new, penalty = key
        extra = {k: v for k, v, off in (("min_new_tokens", min_new, 0), ("repetition_penalty", penalty, 1.0)) if v != off}
        if hasattr(eng.generate, "remote"):  # a Ray actor: its ObjectRef is awaitable
            return await eng.generate.remote(ids, 1, max_new, temperature, top_p, top_k, seed, **extra)
        return await asyncio.to_thread(eng.generate, ids, 1, max_new, temperature, top_p, top_k, seed, **extra)


@dataclass
class Executor:
    """Runs episodes concurrently. `agent_cls` None: single turn. `encode(text) -> ids` (no special tokens),
    `decode(ids) -> text` (special tokens skipped, as vLLM's output text)."""
    client: EngineClient
    encode: object
    decode: object
    sampling: SamplingParams
    max_new_tokens: int
    max_turns: int = 1
    agent_cls: type | None = None
    encode_prompt: object = None  # a rewritten first observation -> prompt ids (BOS, prompt_max_len); default encode

    @property
    def where(self) -> str:
        return getattr(self.agent_cls, "__agent_path__", "AgentInstance")

    async def episode(self, index: int, prompt: str, prompt_ids: list[int], label, what: str = "") -> Episode:
        ep = Episode(index=index, prompt_ids=list(prompt_ids))
        sp = copy.copy(self.sampling)
        if self.agent_cls is None:
            out = await self.client.generate(ep.prompt_ids, sp.key(self.max_new_tokens))
            ep.ids, ep.logprobs, ep.action_mask = list(out["ids"]), list(out["logprobs"]), [1] * len(out["ids"])
            ep.turns, ep.finish_reason, ep.text = 1, out["finish_reason"], self.decode(out["ids"])
            return ep
        name = f"{self.where}: episode {index}{what}"
        try:
            agent = await _instance(self.agent_cls)
            reset = await agent.reset({"observation": prompt, "label": label})
        except AgentError:
            raise
        except Exception as e:
            raise AgentError(f"{name}, reset: {type(e).__name__}: {e}") from e
        obs_text = reset.get("observation", prompt) if isinstance(reset, dict) else prompt
        if obs_text != prompt:  # the environment rewrote the first observation
            ep.prompt_ids = (self.encode_prompt or self.encode)(obs_text)
        last: dict = {}
        total = 0.0  # OpenRLHF's total_reward: the sum of the steps' rewards
        while True:
            budget = self.max_new_tokens - len(ep.ids)
            max_new = min(budget, sp.max_tokens or budget)
            if max_new <= 0:
                ep.finish_reason = "length"
                break
            out = await self.client.generate(ep.prompt_ids + ep.ids, sp.key(max_new))
            ep.turns += 1
            n = sp.cut(out["ids"], self.decode)  # a stop / stop token ends the action there
            action = out["ids"][:n]
            action_text = sp.text(action, self.decode)
            ep.ids += action
            ep.logprobs += out["logprobs"][:n]
            ep.action_mask += [1] * len(action)
            turn = f"{name}, turn {ep.turns}"
            try:
                last = await agent.step({"observation_text": obs_text, "action_text": action_text, "label": label,
                                         "sampling_params": sp})
            except Exception as e:
                raise AgentError(f"{turn}: step raised {type(e).__name__}: {e}") from e
            if not isinstance(last, dict):
                raise AgentError(f"{turn}: step returned {type(last).__name__}, not a dict with keys {list(REQUIRED)}")
            for k in REQUIRED:
                if k not in last:
                    raise AgentError(f"{turn}: step's result has no {k!r} key (it needs {list(REQUIRED)}; "
                                     f"got {sorted(last)})")
            total += _number(last["rewards"], f"{turn}: 'rewards'")
            ep.reward = total
            ep.score = _number(last["scores"], f"{turn}: 'scores'") if last.get("scores") is not None else total
            ep.extra_logs = _scalar_logs(last.get("extra_logs"))
            feedback = last["environment_feedback"] or ""
            obs_text = obs_text + action_text + feedback
            if last.get("sampling_params") is not None:
                sp = SamplingParams.coerce(last["sampling_params"], f"{turn}: 'sampling_params'")
            if bool(last["done"]):
                ep.finish_reason = "done"
                break
            fb = self.encode(feedback) if feedback else []
            room = self.max_new_tokens - len(ep.ids)
            ep.ids += fb[:room]  # feedback past the budget is cut: the episode ends on length below
            ep.logprobs += [0.0] * len(fb[:room])
            ep.action_mask += [0] * len(fb[:room])
            if ep.turns >= self.max_turns:
                ep.finish_reason = "max_turns"
                break
        return ep

    async def run(self, items: list[tuple[int, str, list[int], object]], what=None) -> list[Episode]:
        """items: (index, prompt text, prompt ids, label) per episode -> episodes in the same order. `what(k)`
        describes item k for errors."""
        tasks = [self.episode(i, p, ids, lab, what(k) if what else "") for k, (i, p, ids, lab) in enumerate(items)]
        return list(await asyncio.gather(*tasks))


class EngineHandle:
    """The `llm_engine` a custom executor gets: `await generate(prompt_token_ids, sampling_params)` returns an
    object shaped like vLLM's RequestOutput (`.outputs[0].token_ids`, `.text`, `.logprobs` as one
    {token_id: obj with .logprob} per token, `.finish_reason`), served by the run's rollout engines."""

    def __init__(self, client: EngineClient, decode, max_new_tokens: int):
        self.client, self.decode, self.max_new_tokens = client, decode, max_new_tokens

    async def generate(self, prompt_token_ids, sampling_params, **kwargs):
        from types import SimpleNamespace as NS

        sp = SamplingParams.coerce(sampling_params)
        max_new = min(self.max_new_tokens, sp.max_tokens or self.max_new_tokens)
        if max_new <= 0:
            raise AgentError(f"generate asked for {sp.max_tokens} new tokens")
        out = await self.client.generate(list(prompt_token_ids), sp.key(max_new))
        n = sp.cut(list(out["ids"]), self.decode)
        ids = list(out["ids"])[:n]
        lps = [{t: NS(logprob=lp)} for t, lp in zip(ids, out["logprobs"])]
        reason = "stop" if n < len(out["ids"]) else out["finish_reason"]
        return NS(prompt_token_ids=list(prompt_token_ids), outputs=[
            NS(token_ids=ids, text=sp.text(ids, self.decode), logprobs=lps, finish_reason=reason)])


@dataclass
class CustomExecutor:
    """Runs each episode with a user's `AgentExecutor.execute` (ppo's agent_executor_path) instead of Executor,
    and turns its result (OpenRLHF's final_response) into an Episode: the tokens before the first action are the
    prompt, the rest the response; action_mask 1 inside `action_ranges`; `reward` is the episode's reward."""
    client: EngineClient
    tokenizer: object
    decode: object
    sampling: SamplingParams
    max_new_tokens: int
    executor_cls: type

    async def episode(self, index: int, prompt: str, prompt_ids: list[int], label, what: str = "") -> Episode:
        name = f"{self.executor_cls.__agent_path__}: episode {index}{what}"
        sp = copy.copy(self.sampling)
        sp.max_tokens = self.max_new_tokens
        try:
            res = await _executor(self.executor_cls).execute(prompt, label, sp, len(prompt_ids) + self.max_new_tokens,
                                                    self.tokenizer, EngineHandle(self.client, self.decode,
                                                                                 self.max_new_tokens))
        except AgentError:
            raise
        except Exception as e:
            raise AgentError(f"{name}: execute raised {type(e).__name__}: {e}") from e
        missing = [k for k in ("observation_tokens", "action_ranges", "reward") if not isinstance(res, dict) or k not in res]
        if missing:
            raise AgentError(f"{name}: execute's result lacks {missing} (OpenRLHF's final_response keys)")
        obs, ranges = [int(t) for t in res["observation_tokens"]], [tuple(r) for r in res["action_ranges"]]
        if not ranges:
            raise AgentError(f"{name}: no action_ranges (the model generated nothing)")
        start = ranges[0][0]
        ep = Episode(index=index, prompt_ids=obs[:start], ids=obs[start:], turns=len(ranges), finish_reason="done")
        if len(ep.ids) > self.max_new_tokens:
            raise AgentError(f"{name}: {len(ep.ids)} tokens after the prompt, more than generate_max_len "
                             f"{self.max_new_tokens}")
        ep.action_mask = [0] * len(ep.ids)
        for a, b in ranges:
            ep.action_mask[a - start:b - start] = [1] * (b - a)
        lps = res.get("rollout_log_probs")
        if lps is not None and len(lps) != len(obs):
            raise AgentError(f"{name}: {len(lps)} rollout_log_probs for {len(obs)} observation_tokens")
        ep.logprobs = [float(x) for x in lps[start:]] if lps is not None else [0.0] * len(ep.ids)
        ep.reward = _number(res["reward"], f"{name}: 'reward'")
        ep.score = _number(res["scores"], f"{name}: 'scores'") if res.get("scores") is not None else ep.reward
        ep.extra_logs = _scalar_logs(res.get("extra_logs"))
        return ep

    async def run(self, items: list[tuple[int, str, list[int], object]], what=None) -> list[Episode]:
        tasks = [self.episode(i, p, ids, lab, what(k) if what else "") for k, (i, p, ids, lab) in enumerate(items)]
        return list(await asyncio.gather(*tasks))


_EXECUTORS: dict[type, object] = {}


def _executor(cls):
    """One instance of an AgentExecutor class for the run (OpenRLHF makes one per rollout engine, then calls its
    execute for every prompt)."""
    if cls not in _EXECUTORS:
        _EXECUTORS[cls] = cls()
    return _EXECUTORS[cls]


def run_sync(coro):
    """Run `coro` to completion from synchronous code: on a fresh event loop, or on a helper thread when this
    thread already runs one (e.g. inside an async Prefect task)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_episodes(executor: Executor, items, what=None) -> list[Episode]:
    """Synchronous entry: the episodes on their own event loop (the ppo driver is synchronous)."""
    return run_sync(executor.run(items, what))


async def probe(agent_cls, items, max_turns: int = 1) -> None:
    """Before any engine starts: reset and one step with an empty action for each item, so a file whose
    reset/step fail or whose step lacks a required key is refused before work (AgentError)."""
    class Empty:
        def generate(self, ids, n, max_new, *a):
            return [[{"ids": [], "logprobs": [], "finish_reason": "stop"}] for _ in ids]

    ex = Executor(EngineClient([Empty()], 0), encode=lambda s: [], decode=lambda ids: "", sampling=SamplingParams(),
                  max_new_tokens=1, max_turns=max_turns, agent_cls=agent_cls)
    await ex.run(items, lambda k: " (probe before training: empty action)")
