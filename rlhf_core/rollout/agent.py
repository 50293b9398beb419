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
`agent_executor_path` names an executor file directly. Files written for OpenRLHF load unchanged: while the file
loads, `openrlhf.utils.agent` is this module (`from openrlhf.utils.agent import AgentInstanceBase, ...`), and
afterwards the name is taken back out, so a real OpenRLHF install is what every other import sees.

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

import importlib.util
import inspect
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, fields
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
        raise NotImplementedError("MultiTurnAgentExecutor's episodes run through rlhf_core.rollout.episodes.Executor: an "
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
        with _as_openrlhf_agent():
            spec.loader.exec_module(mod)
    except Exception as e:  # the user's file: any import error
        raise AgentError(f"{key} {path}: importing it failed: {type(e).__name__}: {e}") from e
    return mod


@contextmanager
def _as_openrlhf_agent():
    """`openrlhf.utils.agent` names this module while an agent file loads (OpenRLHF's files import their bases from
    there). Its parent packages are stand-ins only where OpenRLHF is not installed (an installed one still serves
    the file's other `openrlhf.*` imports); every name is restored afterwards."""
    import sys
    import types

    names = ["openrlhf.utils.agent"]
    if importlib.util.find_spec("openrlhf") is None:
        names = ["openrlhf", "openrlhf.utils", *names]
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    for n in names[:-1]:
        sys.modules.setdefault(n, types.ModuleType(n, "a stand-in while an OpenRLHF agent file loads"))
    sys.modules["openrlhf.utils.agent"] = sys.modules[__name__]
    try:
        yield
    finally:
        for n in names:
            if n in saved:
                sys.modules[n] = saved[n]
            else:
                sys.modules.pop(n, None)


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


async def new_instance(cls):
    if inspect.iscoroutinefunction(cls.__init__):  # some OpenRLHF examples declare `async def __init__`
        obj = cls.__new__(cls)
        await obj.__init__()
        return obj
    return cls()
