"""The memory plan of a ppo run: what every role holds on each GPU in each phase of a step, from the models'
config.json and the stage's settings, before anything starts (`plan(cfg, shapes, gpu_gb)`; `rlhf-flows plan`).

A step has three phases, and the roles follow `role_states` (placement.Roles.phase runs it):
  generate  the engines hold weights and KV cache; with deepspeed_enable_sleep the learners are asleep
  train     experience forwards and updates; with vllm_enable_sleep the engines are asleep
  sync      new weights into the engines: with deepspeed_enable_sleep the learners are asleep again (their
            optimizer states, fp32 masters and gradients offloaded, the bf16 weights kept to send), with
            vllm_enable_sleep the engines hold their weights only (vLLM's wake_up(tags=["weights"])), the KV
            cache comes back before the next generate (["kv_cache"]): OpenRLHF's order (ppo_trainer.py
            broadcast_to_vllm, ppo_train's reload -> fit -> offload). Every weight path gathers one bucket at a time.
`legacy=True` plans the order before issue 35 (learners awake and engines fully awake for the sync, the
object-store path gathering the whole model on every rank), for the before / after comparison.

What a role holds, in bytes (P parameters, b bytes per weight: 2 with bf16, else 4; N ranks of its group):
  learner     weights P.b (/N under ZeRO-3); optimizer 12P (fp32 master + Adam's two moments; /N under ZeRO >= 1;
              none on the GPU with adam_offload); grads P.b (/N under ZeRO >= 2) plus DeepSpeed's reduce bucket
              (5e8 elements); activations of a training micro-batch (per token and layer 2(4 + b)H + b(3H + 3kv)
              + 4bI: two RMSNorms keeping fp32 inputs, attention inputs and output, the gated MLP's four (T, I)
              tensors; with gradient_checkpointing one layer's plus every layer's input) and the LM head's chunked
              backward (3 x chunk x V fp32); the optimizer step's fp32 gradients (4P/N) when they outgrow the
              activations; ZeRO-3 gathers about two layers (or the embedding) at a time.
  reference   weights P.b (/N ZeRO-3 ranks; none between forwards with ref_reward_offload) and an experience
              forward: hidden states plus two fp32 (chunk, V) tensors of the chunked log-probs.
  reward      every reward model's weights (none between scoring calls with ref_reward_offload; it scores in
              generate) and a scoring forward.
  rollout     vLLM: vllm_gpu_memory_utilization x the GPU (weights + activations + KV cache, vLLM's own budget)
              awake, P.b/TP with weights only, nothing asleep; hf: weights, the KV cache of every row it
              generates and about 22 bytes x rows x V of per-step logits (bf16 logits, fp32 scores, the
              sampled log-probs' two fp32 steps, softmax).
  context     CONTEXT_GB per process on a GPU (CUDA context and allocator slack: an estimate, not measured).
Checked against the figures the lent H200 measured (benchmarks/gpu/measured_peaks.json, test_plan.py); what no
GPU has measured yet (vLLM, ZeRO-3 ranks, the sync) is what benchmarks/gpu/gpu_phases.py measures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

GB = 2 ** 30  # "GB" here is 2**30 bytes, as torch and vLLM count a GPU
CONTEXT_GB = 0.5  # CUDA context + allocator slack per process on a GPU (estimate)
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
CHUNK = 1024  # rlhf_core.rl.logprobs.CHUNK: LM-head positions per chunk
PHASES = ("generate", "train", "sync")
KINDS = ("weights", "grads", "optimizer", "kv_cache", "activations", "gather", "context")


class PlanError(ValueError):
    """A model config the plan cannot read, or a planned peak over the GPUs' memory; the message names them."""


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes from its config.json."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    largest: int  # elements of the largest single parameter (the embedding, usually)

    @property
    def layer_params(self) -> int:
        return (self.params - self.vocab * self.hidden) // max(1, self.layers)


def shape(config: dict, head: str = "lm", where: str = "config.json") -> Shape:
    """Sizes of a Llama / Mistral / Qwen2 / Qwen3-shaped decoder with an LM head (`lm`) or a scalar score head
    (`score`: reward models, the critic). Parameters: embedding V.H; per layer q, k, v, o (+ q/k/v biases on
    Qwen2), the gated MLP 3.H.I, two RMSNorms (+ q/k norms on Qwen3); the final norm; the LM head unless tied."""
    c = config.get("text_config", config)
    try:
        H, L, nh, V = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["vocab_size"]
        inter = c["intermediate_size"]
    except KeyError as e:
        raise PlanError(f"{where}: no {e.args[0]} (the plan reads decoder configs: Llama, Mistral, Qwen2, Qwen3)") from None
    if c.get("num_local_experts") or c.get("num_experts"):
        raise PlanError(f"{where}: a mixture-of-experts model ({c.get('model_type')}): the plan has no MoE layout")
    kv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or H // nh
    bias = c.get("attention_bias", c.get("model_type") in ("qwen2",))
    attn = H * nh * hd + 2 * H * kv * hd + nh * hd * H + (nh * hd + 2 * kv * hd if bias else 0)
    qk_norm = 2 * hd if c.get("model_type") == "qwen3" else 0
    layer = attn + 3 * H * inter + 2 * H + qk_norm
    tied = c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    out = V * H if head == "lm" and not tied else H if head == "score" else 0
    return Shape(H, L, nh, kv, hd, inter, V, V * H + L * layer + H + out, max(V * H, H * inter))


def read_config(uri: str, storage_options: dict | None = None) -> dict:
    """config.json of the model at `uri` (a folder, an artifact or a plain HF folder on any fsspec URI)."""
    from rlhf_core import store

    try:
        fs, root = store.filesystem(uri, storage_options)
        with fs.open(store.join(root, "config.json")) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 - unreachable store, no such file, not JSON: all named the same way
        raise PlanError(f"{uri}/config.json cannot be read ({type(e).__name__}: {str(e)[:200]}): the plan needs "
                        f"each model's config.json (point the URI at a folder holding it)") from None


def reward_ranks(cfg) -> tuple[int, bool]:
    """(ranks of the reward group, whether they shard every reward model with ZeRO-3): reward_num_nodes x
    reward_num_gpus_per_node ranks (OpenRLHF's flags), sharded under zero_stage 3 as OpenRLHF runs its reward
    models at the run's ZeRO stage when it is 3 (replicas that each score a shard of the samples otherwise)."""
    n = getattr(cfg, "reward_num_nodes", 1) * getattr(cfg, "reward_num_gpus_per_node", 1)
    return n, n > 1 and cfg.zero_stage == 3


def bundle_plan(cfg, world: int, cworld: int, reference: bool, reward: bool) -> list[tuple[str, int]]:
    """(role, placement-group bundle) for every actor, in the order Roles creates them: policy ranks, critic
    ranks, reference ranks ("reference" for one, "reference0".. for ZeRO-3 ranks: ref_num_nodes x
    ref_num_gpus_per_node), reward ranks ("reward" for one, "reward0".. for reward_num_nodes x
    reward_num_gpus_per_node), rollout engines ("rollout{j}", and "rollout{j}.tp{k}" for the bundles of
    its tensor-parallel workers k = 1 .. vllm_tensor_parallel_size - 1, which the engine starts itself). Each
    gets its own bundle, except (OpenRLHF's flags): colocate_all_models puts critic rank i, reference rank i,
    reward rank i and engine j's TP rank k on policy rank (i, i or j x TP + k) mod world's bundle (the
    hybrid engine); colocate_actor_ref puts reference rank i on policy rank i's bundle; colocate_critic_reward
    puts reward rank i on critic rank i mod cworld's bundle."""
    plan = [(f"policy{r}", r) for r in range(world)]
    nxt = world

    def add(name: str, shared: int | None) -> None:
        nonlocal nxt
        if shared is None:
            shared, nxt = nxt, nxt + 1
        plan.append((name, shared))

    every, tp = cfg.colocate_all_models, cfg.vllm_tensor_parallel_size
    for r in range(cworld):
        add(f"critic{r}", r % world if every else None)
    if reference:
        rworld = cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
        for r in range(rworld):
            add("reference" if rworld == 1 else f"reference{r}", r % world if every or cfg.colocate_actor_ref else None)
    if reward:
        n, critics = reward_ranks(cfg)[0], dict(plan)
        for r in range(n):
            critic = critics.get(f"critic{r % cworld}") if cworld else None
            add("reward" if n == 1 else f"reward{r}",
                r % world if every else critic if cfg.colocate_critic_reward and critic is not None else None)
    for j in range(cfg.vllm_num_engines):
        for k in range(tp):
            add(f"rollout{j}" + (f".tp{k}" if k else ""), (j * tp + k) % world if every else None)
    return plan


# ---------------------------------------------------------------------------------------------- the phases
def role_states(cfg, phase: str, legacy: bool = False) -> dict[str, str]:
    """What the sleeping roles hold in `phase`: learner "awake" | "asleep" (bf16 weights only), engine
    "awake" (weights + KV cache) | "weights" | "asleep". Without the sleep flags every role stays awake."""
    learner = "asleep" if cfg.deepspeed_enable_sleep and (phase == "generate" or phase == "sync" and not legacy) \
        else "awake"
    engine = "awake"
    if cfg.vllm_enable_sleep:
        engine = {"generate": "awake", "train": "asleep", "sync": "awake" if legacy else "weights"}[phase]
    return {"learner": learner, "engine": engine}


def transitions(before: str, after: str) -> list[tuple[str, list[str] | None]]:
    """The calls that take an engine from state `before` to `after`: [("sleep", None)] or [("wake_up", tags)]."""
    if before == after:
        return []
    if after == "asleep":
        return [("sleep", None)]
    if before == "asleep":
        return [("wake_up", ["weights"] if after == "weights" else None)]
    return [("wake_up", ["kv_cache"])] if after == "awake" else [("sleep", None), ("wake_up", ["weights"])]


# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class Holding:
    phase: str
    gpu: int
    role: str
    bytes: dict = field(default_factory=dict)  # kind -> bytes

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class Plan:
    gpu_gb: float
    gpus: int
    rows: list[Holding]
    legacy: bool = False

    def total(self, phase: str, gpu: int) -> int:
        return sum(h.total for h in self.rows if h.phase == phase and h.gpu == gpu)

    def peak(self) -> tuple[str, int, int]:
        """(phase, gpu, bytes) of the fullest GPU in any phase."""
        return max(((p, g, self.total(p, g)) for p in PHASES for g in range(self.gpus)), key=lambda x: x[2])

    def holders(self, phase: str, gpu: int) -> list[Holding]:
        return sorted((h for h in self.rows if h.phase == phase and h.gpu == gpu), key=lambda h: -h.total)

    def fits(self) -> bool:
        return self.peak()[2] <= self.gpu_gb * GB

    def over(self) -> str:
        """The refusal: the phase, the GPU and its largest holders."""
        phase, gpu, used = self.peak()
        top = ", ".join(f"{h.role} {h.total / GB:.1f} ({_kinds(h)})" for h in self.holders(phase, gpu)[:4])
        return (f"planned GPU memory peaks at {used / GB:.1f} GB on GPU {gpu} in phase {phase}, over its "
                f"{self.gpu_gb:g} GB: {top} (GB = 2**30 bytes; `rlhf-flows plan` prints the whole plan)")

    def table(self) -> str:
        """Per phase and GPU, what each role holds (GB), the GPU's total, and the peak. GPUs holding the same are
        one row group (their ranks' names without the number: "policy" on GPUs 1,3,5,7 is policy1, policy3, ...)."""
        import re

        cols = ["phase", "gpus", "role", *KINDS, "total"]
        lines = []
        for p in PHASES:
            groups: dict = {}
            for g in range(self.gpus):
                sig = tuple((re.sub(r"\d+", "", h.role), tuple(sorted(h.bytes.items()))) for h in self.holders(p, g)
                            if h.total)
                groups.setdefault(sig, []).append(g)
            for gs in groups.values():
                many = len(gs) > 1
                for h in [h for h in self.holders(p, gs[0]) if h.total]:
                    lines.append([p, _span(gs), re.sub(r"\d+", "", h.role) if many else h.role,
                                  *(_gb(h.bytes.get(k, 0)) for k in KINDS), _gb(h.total)])
                lines.append([p, _span(gs), "= per GPU", *[""] * len(KINDS), _gb(self.total(p, gs[0]))])
        width = [max(len(c), *(len(r[i]) for r in lines)) for i, c in enumerate(cols)]
        fmt = lambda r: "  ".join(x.ljust(w) if i < 3 else x.rjust(w) for i, (x, w) in enumerate(zip(r, width)))  # noqa: E731
        phase, gpu, used = self.peak()
        verdict = "fits" if self.fits() else "DOES NOT FIT"
        return "\n".join([fmt(cols), *map(fmt, lines),
                          f"peak: {used / GB:.1f} GB on GPU {gpu} in phase {phase} of {self.gpu_gb:g} GB per GPU: {verdict}"
                          + (" (the phase order before issue 35)" if self.legacy else "")])


def _span(gpus: list[int]) -> str:
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))


def _gb(n: int) -> str:
    return f"{n / GB:.2f}" if n else "-"


def _kinds(h: Holding) -> str:
    return ", ".join(f"{k} {v / GB:.1f}" for k, v in sorted(h.bytes.items(), key=lambda kv: -kv[1]) if v >= 0.05 * GB)


def plan(cfg, shapes: dict[str, Shape], gpu_gb: float, legacy: bool = False) -> Plan:
    """The plan of `cfg` (the ppo stage's config, read by attribute) on GPUs of `gpu_gb` GB: `shapes` holds the
    policy's ("policy"), and when used the critic's ("critic") and the reward models' ("reward": a list)."""
    world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node if cfg.advantage_estimator == "gae" else 0
    rworld = cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
    has_ref, rms = cfg.init_kl_coef > 0, shapes.get("reward") or []
    where = bundle_plan(cfg, world, cworld, has_ref, bool(rms))
    b = 2 if cfg.bf16 else 4
    rows = []
    for phase in PHASES:
        state = role_states(cfg, phase, legacy)
        for name, gpu in where:
            kind = name.rstrip("0123456789").split(".")[0]
            if kind == "policy" or kind == "critic":
                got = _learner(cfg, shapes[kind], kind, int(name[len(kind):]), world if kind == "policy" else cworld,
                               b, phase, state["learner"], legacy)
            elif kind == "reference":
                got = _reference(cfg, shapes["policy"], rworld, b, phase)
            elif kind == "reward":
                got = _reward(cfg, rms, b, phase, *reward_ranks(cfg))
            else:
                got = _engine(cfg, shapes["policy"], b, phase, state["engine"], gpu_gb, name)
            got = {k: int(v) for k, v in got.items() if v}
            if got:
                got["context"] = int(CONTEXT_GB * GB)
            rows.append(Holding(phase, gpu, name, got))
    return Plan(gpu_gb, 1 + max(g for _, g in where), rows, legacy)


def _tokens(cfg, train: bool) -> int:
    """Tokens of one micro-batch: token-bounded with use_dynamic_batch, else rows x the longest sequence."""
    if cfg.use_dynamic_batch:
        return cfg.train_max_tokens_per_gpu if train else (cfg.rollout_max_tokens_per_gpu or cfg.train_max_tokens_per_gpu)
    rows = cfg.micro_train_batch_size if train else (cfg.micro_rollout_batch_size or cfg.micro_train_batch_size)
    return rows * (cfg.prompt_max_len + cfg.generate_max_len)


def train_activations(s: Shape, tokens: int, b: int, checkpointing: bool, lm_head: bool) -> int:
    """Bytes a training micro-batch of `tokens` keeps for backward (see the module docstring)."""
    per_layer = 2 * (4 + b) * s.hidden + b * (3 * s.hidden + 3 * s.kv_heads * s.head_dim) + 4 * b * s.intermediate
    kept = tokens * (s.layers * b * s.hidden + per_layer) if checkpointing else tokens * s.layers * per_layer
    head = 3 * min(CHUNK, tokens) * s.vocab * 4 if lm_head else 0
    return kept + head


def forward_activations(s: Shape, tokens: int, b: int, lm_head: bool) -> int:
    """Peak bytes of a no-grad forward of `tokens` above the weights: the MLP's (T, I) tensors of one layer, or
    the hidden states and two fp32 (chunk, V) tensors of the chunked log-probs (logits, then logsumexp's)."""
    body = tokens * b * (3 * s.intermediate + 4 * s.hidden)
    head = tokens * b * s.hidden + 2 * min(CHUNK, tokens) * s.vocab * 4 if lm_head else 0
    return max(body, head)


def _zero3_gather(s: Shape, b: int) -> int:
    """ZeRO-3 keeps about two layers gathered (the one running and the one prefetched), or the embedding."""
    return max(s.largest, 2 * s.layer_params) * b


def _bucket(cfg, s: Shape, b: int) -> int:
    """Bytes of one weight-sync bucket: weight_sync_bucket_mb (or the whole model when smaller), or the largest
    parameter, which travels alone."""
    return max(min(cfg.weight_sync_bucket_mb * 2 ** 20, s.params * b), s.largest * b)


def _learner(cfg, s: Shape, kind: str, rank: int, world: int, b: int, phase: str, state: str, legacy: bool) -> dict:
    P, z = s.params, cfg.zero_stage
    out = {"weights": P * b / (world if z == 3 else 1)}
    if state == "awake":
        if not cfg.adam_offload:
            out["optimizer"] = (12 if b == 2 or z >= 1 else 8) * P / (world if z >= 1 else 1)
        out["grads"] = (P * b / world + min(REDUCE_BUCKET, P) * b) if z >= 2 else P * (4 if z == 0 and b == 2 else b)
    if phase == "train":
        act = max(train_activations(s, _tokens(cfg, True), b, cfg.gradient_checkpointing, kind == "policy"),
                  forward_activations(s, _tokens(cfg, False), b, kind == "policy"))
        out["activations"] = max(act, 4 * P / (world if z >= 1 else 1))  # or the step's fp32 gradients
        if z == 3:
            out["gather"] = _zero3_gather(s, b)
    elif phase == "sync" and kind == "policy" and cfg.vllm_num_engines:
        ipc = cfg.colocate_all_models and cfg.weight_sync_backend != "object_store"
        if cfg.weight_sync_backend == "object_store":
            whole = legacy and z == 3  # before issue 35 every rank gathered every parameter at once
            out["gather"] = P * b if whole else _bucket(cfg, s, b) if z == 3 else 0
        else:  # the gathered bucket, and the flat buffer rank 0 sends (every rank's own with CUDA IPC)
            out["gather"] = _bucket(cfg, s, b) * ((z == 3) + (rank == 0 or ipc))
    return out


def _reference(cfg, s: Shape, rworld: int, b: int, phase: str) -> dict:
    resident = 0 if cfg.ref_reward_offload else s.params * b / rworld
    out = {"weights": resident}
    if phase == "train":  # its forward: the whole model (one rank, offloaded: moved in for it) or gathers
        out["activations"] = forward_activations(s, _tokens(cfg, False), b, True)
        if rworld > 1:
            out["gather"] = _zero3_gather(s, b)
        elif cfg.ref_reward_offload:
            out["weights"] = s.params * b
    return out


def _reward(cfg, shapes: list[Shape], b: int, phase: str, n: int = 1, sharded: bool = False) -> dict:
    """One reward rank: every model's weights (its ZeRO-3 partition when sharded over the n ranks)."""
    weights = sum(s.params for s in shapes) * b / (n if sharded else 1)
    out = {"weights": 0 if cfg.ref_reward_offload and phase != "generate" else weights}
    if phase == "generate":  # the rollout scores its samples, a micro-batch at a time
        rows = cfg.micro_rollout_batch_size or cfg.micro_train_batch_size
        out["activations"] = max(forward_activations(s, rows * cfg.reward_max_len, b, False) for s in shapes)
        if sharded:
            out["gather"] = max(_zero3_gather(s, b) for s in shapes)
    return out


def _engine(cfg, s: Shape, b: int, phase: str, state: str, gpu_gb: float, name: str) -> dict:
    tp = cfg.vllm_tensor_parallel_size
    if cfg.rollout_backend == "vllm":
        if state == "asleep":
            return {}
        if state == "weights":
            out = {"weights": s.params * b / tp}
        else:  # vLLM sizes itself: weights, activations and KV cache within its share of the GPU
            total = cfg.vllm_gpu_memory_utilization * gpu_gb * GB
            out = {"weights": s.params * b / tp, "kv_cache": max(0.0, total - s.params * b / tp)}
        if phase == "sync" and cfg.weight_sync_backend != "object_store" and not cfg.colocate_all_models:
            out["gather"] = _bucket(cfg, s, b)  # the receive buffer of one bucket
        return out
    out = {"weights": s.params * b}
    if phase == "generate":  # every row of the engine's shard at once, prompt + new tokens
        rows = -(-cfg.rollout_batch_size * cfg.n_samples_per_prompt // max(1, cfg.vllm_num_engines))
        seq = cfg.prompt_max_len + cfg.generate_max_len
        out["kv_cache"] = 2 * s.layers * s.kv_heads * s.head_dim * rows * seq * b
        out["activations"] = 22 * rows * s.vocab
    elif phase == "sync" and cfg.weight_sync_backend == "collective" and not cfg.colocate_all_models:
        out["gather"] = 0  # an hf engine's parameters are views of its buckets: they land in place
    return out


def shapes_of(policy: str, reward_models: list[str] = (), critic: str | None = None,
              storage_options: dict | None = None) -> dict:
    """`plan`'s shapes from the models' config.json (folders or URIs): the policy (also the reference and the
    engines), the critic and every reward model (score heads)."""
    out = {"policy": shape(read_config(policy, storage_options), "lm", f"{policy}/config.json"),
           "reward": [shape(read_config(u, storage_options), "score", f"{u}/config.json") for u in reward_models]}
    if critic:
        out["critic"] = shape(read_config(critic, storage_options), "score", f"{critic}/config.json")
    return out


def check(cfg, shapes: dict, gpu_gb: float) -> Plan:
    """The plan, or PlanError naming the phase, the GPU and its largest holders when its peak is over `gpu_gb`."""
    p = plan(cfg, shapes, gpu_gb)
    if not p.fits():
        raise PlanError(p.over())
    return p
