"""Running episodes: the executor that runs an agent's episodes concurrently over the rollout engines, token in,
token out, batching the requests waiting at one event-loop tick into one generate call per engine (`Executor`,
`EngineClient`), an agent file's own executor (`CustomExecutor` over an `EngineHandle`), and the probe the ppo
stage runs before training. agent.py holds OpenRLHF's contract these run and its docstring the rules of a turn."""
from __future__ import annotations

import asyncio
import copy
import math
from dataclasses import dataclass, field

from rlhf_core.rollout.agent import REQUIRED, AgentError, SamplingParams, new_instance


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
            agent = await new_instance(self.agent_cls)
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
