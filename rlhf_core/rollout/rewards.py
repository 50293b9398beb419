"""Reward sources behind one interface:

    r = compute_rewards(RewardSpec(model=rm_uri), prompts, responses, labels, num_engines=2)
    r.rewards  # one float per (prompt, response), in input order; r.scores / r.extra_logs when given

Sources (exactly one per RewardSpec):
  model       a reward-model folder or committed artifact: AutoModelForSequenceClassification with one label,
              or an OpenRLHF-style backbone + linear value head (`{value_head_prefix}.weight`). The text
              prompt, response (+ EOS, as OpenRLHF's reward datasets append it) is tokenized exactly as train_rm
              tokenized its pairs (rlhf_core.train.batches.Encoder) and scored at its last token:
              left padding puts every last real token at position -1, and position ids follow the attention
              mask so padding never changes a score. Normalisation: (r - reward_mean) / reward_std when the
              model's config.json holds `reward_mean`/`reward_std` (written by train_rm), or OpenRLHF's
              `normalize_reward` + `mean`/`std`. Sorted by length, batched, on Ray actors like generation.
              Or a process reward model (train_prm; its config.json names `prm_placeholder_token` and
              `prm_reward_tokens`): the text prompt + response is tokenized whole (as train_prm did), each
              step's reward is the softmax probability of the positive (first) reward token over the reward
              tokens at that step's placeholder, and the reward is `prm_aggregate` of the steps: min (the
              default: a solution is as good as its weakest step, Math-Shepherd's verifier, arXiv:2312.08935),
              last, or mean; `step_rewards` holds the per-step values. A causal-LM PRM trained elsewhere
              (e.g. Math-Shepherd's) is named by `prm_tokens`: its placeholder, then its reward tokens.
              A policy's samples hold no placeholders: `prm_step_separator` (e.g. "\n") splits each response
              into steps there and ends every non-blank step with " " + placeholder (Math-Shepherd's layout,
              mark_steps) before scoring; the stored response is left as it was.
  func_path   a Python file defining OpenRLHF's `reward_func(queries, prompts, labels)` (queries are
              prompt + response) returning a tensor/list or a dict with `rewards` (+ `scores`, `extra_logs`).
  remote_url  an HTTP reward server in OpenRLHF's serve_rm shape: POST {"query", "prompts", "labels"} ->
              {"rewards": [...]} (+ optional "scores"); timeout and retries with backoff.
Every reward must be finite: NaN/inf raise RewardError naming the rows.
"""
from __future__ import annotations

import json
import logging
import math
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.inputs import models
from rlhf_core import store
from rlhf_core.rollout.generation import _local_model, _torch_dtype, _cuda, run_engines

log = logging.getLogger("rlhf_flows")


class RewardError(RuntimeError):
    """A reward source failed or returned unusable rewards; the message names the source and rows."""


@dataclass(frozen=True)
class RewardSpec:
    model: str | None = None
    func_path: str | None = None
    remote_url: str | None = None
    value_head_prefix: str = "value_head"
    prm_aggregate: str = "min"  # a process reward model's reduction of its step rewards: min | last | mean
    prm_tokens: tuple[str, ...] | None = None  # a plain causal LM as a PRM: (placeholder, positive, negative, ...)
    prm_step_separator: str | None = None  # a PRM scoring unmarked responses: where one step ends (mark_steps)
    normalize: bool = True  # apply the mean/std stored in the reward model's config, when present
    max_len: int = 1024  # tokens of prompt + response (+ EOS); longer texts are cut as train_rm cuts them
    append_eos: bool = True
    batch_size: int = 64
    dtype: str = "auto"
    timeout_s: float = 30.0
    retries: int = 3
    storage_options: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        given = [k for k in ("model", "func_path", "remote_url") if getattr(self, k)]
        if len(given) != 1:
            raise RewardError(f"give exactly one reward source (model, func_path or remote_url); got {given or 'none'}")
        return given[0]


@dataclass
class Rewards:
    rewards: list[float]
    scores: list[float] | None = None
    extra_logs: dict = field(default_factory=dict)
    step_rewards: list[list[float]] | None = None  # a process reward model's per-step rewards


# ---------------------------------------------------------------------------------------------- reward model
def check_reward_model(path: str | Path, value_head_prefix: str = "value_head", prm_tokens=None) -> str:
    """"seq_cls", "value_head" or "prm" (a process reward model: its config.json names its tokens, or
    `prm_tokens` names them for a plain causal LM) for a reward-model folder; RewardError when it is not one."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise RewardError(f"{path} is not a reward model: it has no config.json")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("prm_placeholder_token"):  # written by train_prm (rlhf_core.train.methods.prm.CONFIG_KEYS)
        saved = (cfg["prm_placeholder_token"], *cfg.get("prm_reward_tokens", ()))
        if prm_tokens and tuple(prm_tokens) != saved:
            raise RewardError(f"{path} is a process reward model with tokens {list(saved)}, not prm_tokens {list(prm_tokens)}")
        return "prm"
    archs = cfg.get("architectures") or []
    if prm_tokens:
        if not any(a.endswith("ForCausalLM") for a in archs):
            raise RewardError(f"prm_tokens name a process reward model, a causal LM; {path} is {archs}")
        return "prm"
    if any(a.endswith("ForSequenceClassification") for a in archs):
        if cfg.get("num_labels", len(cfg.get("id2label") or {0: 0})) != 1:
            raise RewardError(f"{path} is a classifier with {len(cfg.get('id2label', {}))} labels, not a scalar reward model")
        return "seq_cls"
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if f"{value_head_prefix}.weight" in st.keys():
                return "value_head"
    raise RewardError(f"{path} is not a reward model: architectures {archs} has no *ForSequenceClassification "
                      f"and its weights have no {value_head_prefix!r}.weight value head")


def head_prefix(path: str | Path, default: str) -> str:
    """The value head's weight name of an OpenRLHF-format reward model: its config.json's `value_head_prefix`
    (OpenRLHF's train_rm saves it there), else `default`."""
    return json.loads((Path(path) / "config.json").read_text()).get("value_head_prefix") or default


def value_head_as_seq_cls(path: str | Path, prefix: str, out: str | Path) -> str:
    """An OpenRLHF-format reward model (backbone under the model's base_model_prefix + a bias-free
    `{prefix}.weight` Linear(hidden, 1); openrlhf/models/model.py _get_reward_model) rewritten at `out` as the
    *ForSequenceClassification folder transformers loads: the head renamed `score.weight` (its Linear(hidden,
    1, bias=False) is the same layer), num_labels 1, an lm_head dropped. The weights are unchanged."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path, out = Path(path), Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in path.iterdir():  # tokenizer and generation files; the weights and config are rewritten below
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")) \
                and f.name != "config.json":
            shutil.copy(f, out / f.name)
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            sd.update({k: st.get_tensor(k) for k in st.keys()})
    sd["score.weight"] = sd.pop(f"{prefix}.weight")
    cfg = AutoConfig.from_pretrained(path, num_labels=1)
    cls = AutoModelForSequenceClassification._model_mapping[type(cfg)]
    base = cls.base_model_prefix
    keep = {}
    for k, v in sd.items():
        if k.startswith("lm_head."):
            continue
        keep[k if k == "score.weight" or k.startswith(base + ".") else f"{base}.{k}"] = v.contiguous()
    cfg.architectures = [cls.__name__]
    cfg.save_pretrained(out)
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def combine_rewards(each: list[list[float]], agg: str = "sum") -> list[float]:
    """The rewards of several reward models # (n_models, B) -> (B,): sum, as OpenRLHF's reward_fn
    (openrlhf/cli/train_ppo_ray.py v0.6-v0.7: `torch.stack(rewards).sum(dim=0)`), or mean."""
    total = [sum(col) for col in zip(*each)]
    return total if agg == "sum" else [t / len(each) for t in total]


def _norm_stats(cfg) -> tuple[float, float] | None:
    if getattr(cfg, "reward_mean", None) is not None and getattr(cfg, "reward_std", None) is not None:
        return float(cfg.reward_mean), float(cfg.reward_std)
    if getattr(cfg, "normalize_reward", False) and getattr(cfg, "mean", None) is not None:
        return float(cfg.mean), float(cfg.std)  # OpenRLHF's reward-model config keys
    return None


class _Scorer:
    """body + head as one top module, so a ZeRO-3 engine's forward runs inside its top module's call (DeepSpeed's
    fetch trace completes, as rlhf_core.rl.logprobs.through_top does for the policy)."""

    @staticmethod
    def make(body, head):
        import torch

        class Scorer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body, self.head = body, head

            def forward(self, ids, mask, pos):
                h = self.body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state  # (B, T, H)
                return self.head(h[:, -1]).squeeze(-1).float()  # (B,)

        return Scorer()


class RMEngine:
    """Scores (prompt, response) texts with a reward model. One instance per Ray actor (or in-process).
    `offload` (ppo's ref_reward_offload, CUDA only): the weights wait in host memory between scoring calls.
    `zero3` (a DeepSpeed config of ZeRO stage 3, in a process that joined its torch.distributed group): the model
    is built inside zero.Init, each rank holding its partition of every parameter, and every forward gathers
    each layer from the others (ppo's reward_num_nodes x reward_num_gpus_per_node > 1 with zero_stage 3)."""

    def __init__(self, model: str, spec: RewardSpec, offload: bool = False, zero3: dict | None = None):
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        from rlhf_core.train.batches import Encoder

        keep = None
        if zero3 is not None:
            from transformers.integrations import HfDeepSpeedConfig

            keep = HfDeepSpeedConfig(zero3)  # noqa: F841  from_pretrained builds inside zero.Init while it lives
        path = _local_model(model, spec.storage_options)
        prefix = head_prefix(path, spec.value_head_prefix)
        kind = check_reward_model(path, prefix, spec.prm_tokens)
        self.device = "cuda" if _cuda() else "cpu"
        dtype = _torch_dtype(spec.dtype)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.prm = None
        if kind == "prm":
            from transformers import AutoModelForCausalLM

            from rlhf_core.train.methods import prm

            cfg = AutoConfig.from_pretrained(path)
            token, *reward_tokens = spec.prm_tokens or (cfg.prm_placeholder_token, *cfg.prm_reward_tokens)
            try:
                ids = (prm.token_id(self.tok, token, f"PRM {model}: placeholder token"),
                       [prm.token_id(self.tok, t, f"PRM {model}: reward token") for t in reward_tokens])
            except ValueError as e:
                raise RewardError(str(e)) from None
            self.prm = (token, *ids)
            self.body = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            self.head = torch.nn.Identity()
        elif kind == "seq_cls":
            full = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
            self.body = full.base_model
            self.head = getattr(full, "score", None) or getattr(full, "classifier")
        else:  # OpenRLHF: backbone weights under `model.` + a bias-free Linear(hidden, 1) value head
            from safetensors import safe_open

            self.body = AutoModel.from_pretrained(path, dtype=dtype)
            w = None
            for f in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    if f"{prefix}.weight" in st.keys():
                        w = st.get_tensor(f"{prefix}.weight")
            self.head = torch.nn.Linear(w.shape[1], 1, bias=False, dtype=dtype)
            self.head.weight.data.copy_(w.to(dtype))
        self.scorer = None
        if zero3 is not None:  # the partitions stay where DeepSpeed put them (offload_param: the host)
            import deepspeed

            del keep
            self.offload = False
            self.scorer = deepspeed.initialize(model=_Scorer.make(self.body, self.head), config=zero3)[0].module.eval()
        else:
            self.offload = offload and self.device == "cuda"
            self.body.to("cpu" if self.offload else self.device).eval()
            self.head.to("cpu" if self.offload else self.device).eval()
        self.stats = _norm_stats(AutoConfig.from_pretrained(path)) if spec.normalize else None
        self.spec = spec
        self.pad_id = models.pad_id(self.tok, path)
        # The tokenization train_rm trained on (rlhf_core.train.batches.Encoder): the same tokens at serve time.
        self.encoder = Encoder(self.tok, spec.max_len, "truncate", path)

    def encode(self, prompt: str, response: str, finished: bool = True) -> list[int]:
        """A response cut by the generation length gets no EOS (as train_rm encodes an unfinished response)."""
        return self.encoder(prompt, response, finished=self.spec.append_eos and finished)[0]

    def forward(self, batch: list[list[int]]):
        """Raw rewards of a batch of token-id lists (left padded; position ids from the mask). (B,)"""
        import torch

        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, x in enumerate(batch):
            ids[r, width - len(x):] = torch.tensor(x)
            mask[r, width - len(x):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        if self.scorer is not None:
            return self.scorer(ids.to(self.device), mask.to(self.device), pos.to(self.device))
        h = self.body(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                      position_ids=pos.to(self.device)).last_hidden_state  # (B, T, H)
        return self.head(h[:, -1]).squeeze(-1).float()  # (B,) last real token of each row

    def peak_memory_gb(self) -> float:
        from rlhf_core.runtime.devices import peak_memory_gb

        return peak_memory_gb()

    def score(self, pairs: list[tuple[str, str]], finished: list[bool] | None = None) -> list[float]:
        return [r for r, _ in self.rate(pairs, finished)]

    def rate(self, pairs: list[tuple[str, str]], finished: list[bool] | None = None) -> list[tuple[float, list[float] | None]]:
        """(reward, a PRM's per-step rewards or None) of each (prompt, response); `finished` False marks a
        response cut by the generation length (no EOS appended)."""
        if not self.offload:
            return self._rate(pairs, finished)
        import torch

        self.body.to(self.device), self.head.to(self.device)
        try:
            return self._rate(pairs, finished)
        finally:
            self.body.to("cpu"), self.head.to("cpu")
            torch.cuda.empty_cache()

    def _rate(self, pairs, finished):
        import torch

        if self.prm is not None:
            return self._rate_steps(pairs)
        enc = [self.encode(p, r, f) for (p, r), f in zip(pairs, finished or [True] * len(pairs))]
        out = [0.0] * len(enc)
        order = sorted(range(len(enc)), key=lambda i: -len(enc[i]))
        for s in range(0, len(order), self.spec.batch_size):
            idx = order[s:s + self.spec.batch_size]
            with torch.no_grad():  # scoped: an in-process engine must not switch autograd off for its caller
                vals = self.forward([enc[i] for i in idx]).cpu().tolist()
            for i, v in zip(idx, vals):
                out[i] = v if self.stats is None else (v - self.stats[0]) / self.stats[1]
        return [(v, None) for v in out]

    def score_each(self, pairs: list[tuple[str, str]], finished: list[bool] | None = None) -> list[list[float]]:
        return [self.score(pairs, finished)]

    def _rate_steps(self, pairs: list[tuple[str, str]]) -> list[tuple[float, list[float]]]:
        """A PRM's step rewards P(positive reward token) at each placeholder, and their prm_aggregate."""
        import torch

        from rlhf_core.train.methods import prm

        token, ph, reward_ids = self.prm
        bos = models.adds_bos(self.tok)
        if self.spec.prm_step_separator is not None:
            pairs = [(p, mark_steps(r, self.spec.prm_step_separator, token)) for p, r in pairs]
        enc = [prm.encode(self.tok, p + r, ph, self.spec.max_len, bos) for p, r in pairs]
        for k, (ids, n) in enumerate(enc):
            if n == 0:
                raise RewardError(f"process reward model: text {k} of this batch has no step placeholder {token!r} "
                                  f"within max_len {self.spec.max_len} tokens ({pairs[k][1][:60]!r}...)")
        out: list = [None] * len(enc)
        order = sorted(range(len(enc)), key=lambda i: -len(enc[i][0]))
        for s in range(0, len(order), self.spec.batch_size):
            idx = order[s:s + self.spec.batch_size]
            with torch.no_grad():
                logits, sample, _ = prm.reward_logits(self.body, [enc[i][0] for i in idx], self.pad_id, ph, reward_ids)
            p = torch.softmax(logits, -1)[:, 0].cpu().tolist()  # (N,) P(positive token), samples in order
            for j, i in enumerate(idx):
                out[i] = [v for v, b in zip(p, sample.tolist()) if b == j]
        return [(prm.aggregate(v, self.spec.prm_aggregate), v) for v in out]


class RMEnsemble:
    """Several reward models in one actor (ppo's reward_model_uri "a,b", OpenRLHF's --reward_pretrain a,b):
    each scores every pair (`score_each` # (n_models, B)); the driver combines them (combine_rewards).

    One rank of ppo's reward group (reward_num_nodes x reward_num_gpus_per_node ranks, OpenRLHF's flags): each rank
    scores its shard of the pairs. A replica (rank of a group with zero_stage < 3, or world 1) loads every model
    here; with `sharded` (zero_stage 3, as OpenRLHF runs its reward models under the run's ZeRO stage 3) the ranks
    load in `setup`, once the driver knows rank 0's address: each holds its ZeRO-3 partition of every model and
    they forward together (the driver gives every rank the same number of pairs)."""

    def __init__(self, models: list[str], spec: RewardSpec, offload: bool = False, rank: int = 0, world: int = 1,
                 sharded: bool = False):
        self.models, self.spec, self.offload, self.rank, self.world = models, spec, offload, rank, world
        self.engines = [] if sharded else [RMEngine(m, spec, offload) for m in models]

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free there (rank 0 binds it: chosen on its host)."""
        import ray

        from rlhf_core.runtime.jobs import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the reward group and load this rank's ZeRO-3 partition of every model."""
        import os

        import deepspeed
        import deepspeed.ops

        cuda = _cuda()
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0") if cuda else "0")
        if not cuda:
            deepspeed.ops.__dict__["__compatible_ops__"] = {}  # skip the 60-80 s shm op build (ENV-NOTES)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        offload = self.offload and cuda
        zero = {"stage": 3, **({"offload_param": {"device": "cpu", "pin_memory": True}} if offload else {})}
        ds = {"train_batch_size": self.world, "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "bf16": {"enabled": self.spec.dtype == "bfloat16"}, "steps_per_print": 10 ** 9}
        self.engines = [RMEngine(m, self.spec, self.offload, zero3=ds) for m in self.models]
        return self.rank

    def param_elements(self) -> int:
        """Parameter elements this rank holds (its ZeRO-3 partitions, else every parameter)."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                   for e in self.engines for m in (e.body, e.head) for p in m.parameters())

    def score_each(self, pairs: list[tuple[str, str]], finished: list[bool] | None = None) -> list[list[float]]:
        return [e.score(pairs, finished) for e in self.engines]

    def peak_memory_gb(self) -> float:
        from rlhf_core.runtime.devices import peak_memory_gb

        return peak_memory_gb()


def shard_pairs(n: int, world: int) -> list[list[int]]:
    """The indices of n pairs split over `world` reward ranks in contiguous shards of equal length: a shorter
    shard repeats its last index (or the last pair's), so ZeRO-3 ranks forward the same number of micro-batches;
    the driver keeps each index's first score. e.g. n 5, world 2: [[0, 1, 2], [3, 4, 4]]; n 1, world 2: [[0], [0]]."""
    size = -(-n // world)
    out = []
    for r in range(world):
        idx = list(range(r * size, min(n, (r + 1) * size)))
        out.append(idx + [idx[-1] if idx else n - 1] * (size - len(idx)))
    return out


def mark_steps(response: str, separator: str, placeholder: str) -> str:
    """`response` with every non-blank step (the text between separators) ending in " " + placeholder, as
    Math-Shepherd's data marks them ("a = 1 ки\nb = 2 ки"); a blank response becomes one empty step."""
    if not separator:
        raise ValueError("prm_step_separator must not be empty")
    steps = response.split(separator)
    if not any(s.strip() for s in steps):
        return response.rstrip() + f" {placeholder}"
    return separator.join(s.rstrip() + f" {placeholder}" if s.strip() else s for s in steps)


# ---------------------------------------------------------------------------------------------- reward_func file
def load_reward_func(path: str, storage_options: dict | None = None):
    """The `reward_func` defined in a Python file (any fsspec URI)."""
    fs, p = store.filesystem(path, storage_options)
    if not fs.exists(p):
        raise RewardError(f"reward_func file {path} does not exist")
    with fs.open(p, "r") as f:
        code = f.read()
    module = types.ModuleType("rlhf_flows_reward_func")
    module.__file__ = str(path)
    try:
        exec(compile(code, str(path), "exec"), module.__dict__)
    except Exception as e:
        raise RewardError(f"reward_func file {path} failed to import: {type(e).__name__}: {e}") from e
    fn = module.__dict__.get("reward_func")
    if not callable(fn):
        raise RewardError(f"reward_func file {path} defines no reward_func(queries, prompts, labels)")
    return fn


def _floats(value, what: str) -> list[float]:
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().reshape(-1).tolist()
    try:
        return [float(v) for v in value]
    except (TypeError, ValueError):
        raise RewardError(f"{what} returned rewards of type {type(value).__name__}, not numbers") from None


def _parse(result, n: int, what: str) -> Rewards:
    """OpenRLHF's reward_func result: a tensor/list, or a dict with rewards (+ scores, extra_logs)."""
    if isinstance(result, dict):
        if "rewards" not in result:
            raise RewardError(f"{what} returned a dict without 'rewards' (keys {sorted(result)})")
        rewards = _floats(result["rewards"], what)
        scores = _floats(result["scores"], what) if result.get("scores") is not None else None
        logs = {k: sum(_floats(v, what)) / max(1, len(_floats(v, what))) if not isinstance(v, (int, float)) else float(v)
                for k, v in (result.get("extra_logs") or {}).items()}
    else:
        rewards, scores, logs = _floats(result, what), None, {}
    if len(rewards) != n or (scores is not None and len(scores) != n):
        raise RewardError(f"{what} returned {len(rewards)} rewards for {n} queries")
    return Rewards(rewards, scores, logs)


def _remote(url: str, queries, prompts, labels, timeout_s: float, retries: int) -> dict:
    import requests

    last = None
    for attempt in range(max(1, retries)):
        try:
            resp = requests.post(url, json={"query": queries, "prompts": prompts, "labels": labels}, timeout=timeout_s)
            resp.raise_for_status()
            return resp.json()
        except (requests.RequestException, ValueError) as e:
            last = e
            log.warning("reward server %s attempt %d/%d failed: %s", url, attempt + 1, retries, e)
            if attempt + 1 < retries:
                time.sleep(min(8.0, 0.5 * 2 ** attempt))
    raise RewardError(f"remote reward server {url} unreachable after {max(1, retries)} attempts: "
                      f"{type(last).__name__}: {last}")


# ---------------------------------------------------------------------------------------------- the interface
def check_finite(rewards: list[float], what: str = "rewards") -> None:
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise RewardError(f"{what}: {len(bad)} non-finite reward(s) (NaN/inf) at rows {bad[:20]}"
                          + (" ..." if len(bad) > 20 else "") + f": {[rewards[i] for i in bad[:5]]}")


def compute_rewards(spec: RewardSpec, prompts: list[str], responses: list[str], labels: list | None = None,
                    num_engines: int = 0, ray_address: str | None = None) -> Rewards:
    """Rewards for (prompt, response) pairs from the one source `spec` names; finite, in input order."""
    labels = list(labels) if labels is not None else [None] * len(prompts)
    kind = spec.kind
    if kind == "model":
        gpus = 1 if (num_engines > 0 and _cuda()) else 0
        rated = run_engines(RMEngine, (spec.model, spec), "rate", list(zip(prompts, responses)), {}, num_engines,
                            ray_address, num_gpus_per_engine=gpus, label="score")
        steps = [s for _, s in rated]
        out = Rewards([r for r, _ in rated], step_rewards=steps if steps and steps[0] is not None else None)
        what = f"reward model {spec.model}"
    else:
        fn = load_reward_func(spec.func_path, spec.storage_options) if kind == "func_path" else None
        what = f"reward_func in {spec.func_path}" if fn else f"remote reward server {spec.remote_url}"
        out = Rewards([], None, {})
        logs: dict[str, list[tuple[float, int]]] = {}
        for s in range(0, len(prompts), spec.batch_size):
            q = [p + r for p, r in zip(prompts[s:s + spec.batch_size], responses[s:s + spec.batch_size])]
            ps, ls = prompts[s:s + spec.batch_size], labels[s:s + spec.batch_size]
            if fn:
                try:
                    raw = fn(q, ps, ls)
                except Exception as e:
                    raise RewardError(f"{what} raised {type(e).__name__}: {e}") from e
            else:
                raw = _remote(spec.remote_url, q, ps, ls, spec.timeout_s, spec.retries)
            part = _parse(raw, len(q), what)
            out.rewards += part.rewards
            if part.scores is not None:
                out.scores = (out.scores or []) + part.scores
            for k, v in part.extra_logs.items():
                logs.setdefault(k, []).append((v * len(q), len(q)))
        out.extra_logs = {k: sum(a for a, _ in v) / sum(n for _, n in v) for k, v in logs.items()}  # per-row mean
    check_finite(out.rewards, what)
    return out
