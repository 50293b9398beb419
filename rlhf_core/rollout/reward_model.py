"""The reward-model source: a reward-model folder (AutoModelForSequenceClassification with one label, an OpenRLHF
backbone + value head, or a process reward model) scored on Ray actors or in-process (`RMEngine`), several models
in one actor (`RMEnsemble`), and the checks and conversions a reward-model folder goes through. rewards.py's
docstring says how texts are tokenized, normalised and aggregated."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from rlhf_core.inputs import models
from rlhf_core.rollout.generation import _cuda, _local_model, _torch_dtype
from rlhf_core.rollout.reward_spec import RewardError, RewardSpec

log = logging.getLogger("rlhf_flows")

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

    def holdings(self) -> dict:
        """Bytes of device memory by the memory plan's kinds, read from the tensors: every model's weights (this
        rank's partitions), none while ref_reward_offload keeps them in host memory."""
        from rlhf_core.runtime import residency

        return {"weights": residency.device_bytes(getattr(p, "ds_tensor", p) for e in self.engines
                                                  for m in (e.body, e.head) for p in m.parameters())}

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
