"""The memory plan of a ppo run: what every role holds on each GPU at every moment of a run, from the models'
config.json and the stage's settings, before anything starts (`plan(cfg, shapes, gpu_gb)`; `rlhf-flows plan`).

The moments, in the order the roles take them (placement.Roles: OpenRLHF's order, releases before acquires):
  setup: engines   engines that share a GPU load and profile alone on it (vLLM sizes its KV cache then)
  setup            the other roles load beside them (asleep with vllm_enable_sleep): the learners' weights, fp32
                   masters and gradient buffers, plus ZeRO-3's optimizer-state initialisation (a partition-sized fp32
                   buffer it allocates and frees), the reference and the reward models
  enter generate   step 1: the learners go to sleep, then the engines wake
  generate         the engines hold weights and KV cache; with deepspeed_enable_sleep the learners are asleep
  enter train      the engines go to sleep, then the learners reload (step 1: no Adam moments yet; step >= 2: with)
  train            experience forwards and updates; with vllm_enable_sleep the engines are asleep
  sync             the learners go to sleep, then the engines wake with their weights only and receive them
  resume           a checkpoint loads into awake learners (Adam's moments included) beside sleeping engines
A moment is one or more waves of calls (a release wave, then an acquire wave); a role that changes state in a wave
holds the larger of its two states during it (the copy out of vLLM, the reload of DeepSpeed's states), the others
what they hold. The moment's peak on a GPU is its fullest wave. `legacy=True` plans the order before issue 41 (every
phase change in one wave, the engines loading beside the other roles, a resume beside awake engines with DeepSpeed's
offload buffers loaded onto the GPU) and before issue 35 (learners and engines awake for the sync, the object-store
path gathering the whole model on every rank).

What a role holds, in bytes (P parameters, b bytes per weight: 2 with bf16, else 4; N ranks of its group):
  learner     weights P.b (/N under ZeRO-3); optimizer 12P (fp32 master + Adam's two moments; /N under ZeRO >= 1;
              none on the GPU with adam_offload); grads P.b (/N under ZeRO >= 2) plus DeepSpeed's reduce bucket
              (reduce_bucket_size 5e8 elements; ZeRO-3 allocates it whole); activations of a training micro-batch (per
              token and layer 2(4 + b)H + b(3H + 3kv) + 4bI: two RMSNorms keeping fp32 inputs, attention inputs and
              output, the gated MLP's four (T, I) tensors; with gradient_checkpointing one layer's plus every layer's
              input) and the LM head's chunked backward (3 x chunk x V fp32); the optimizer step's fp32 gradients
              (4P/N) when they outgrow the activations; ZeRO-3 gathers about two layers (or the embedding) at a time.
  reference   weights P.b (/N ZeRO-3 ranks; none between forwards with ref_reward_offload) and an experience
              forward: hidden states plus two fp32 (chunk, V) tensors of the chunked log-probs.
  reward      every reward model's weights (none between scoring calls with ref_reward_offload; it scores in
              generate) and a scoring forward.
  rollout     vLLM: vllm_gpu_memory_utilization x the GPU (weights + activations + KV cache, vLLM's own budget)
              awake, P.b/TP with weights only, its residue asleep (SLEEP_RESIDUE_GB: the CUDA graph pool and the
              allocator's blocks outside vLLM's pools; the weights go to pinned host memory); hf: weights, the KV
              cache of every row it generates and about 22 bytes x rows x V of per-step logits (bf16 logits, fp32
              scores, the sampled log-probs' two fp32 steps, softmax), nothing asleep. In sync it receives: one
              bucket (collective), or one layer of temporaries in vLLM's loaders (CUDA IPC maps the sender's bucket).
  context     CONTEXT_GB per process on a GPU, asleep or awake (CUDA context and allocator slack: an estimate).
  nccl        NCCL_COMM_GB per communicator a process is in (the learners' and ZeRO-3 inference ranks' own groups,
              the weight-sync group, an engine's TP group: NCCL's per-channel buffers; an estimate).
A GPU sold as G GB shows CUDA about RESERVED_GB less (an 80 GB H100: 79.6): the plan checks against that, or against
the total a GPU of the cluster reports. Pinned host memory per node (vLLM's weight backups while asleep, DeepSpeed's
offloaded states and ZeRO-Offload's) is its own table, checked against the node's RAM when given.
Checked against the figures the lent H200 measured (benchmarks/gpu/measured_peaks.json, test_plan.py); what no
GPU has measured yet (vLLM, ZeRO-3 ranks, the moments) is what benchmarks/gpu/gpu_phases.py measures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

GB = 2 ** 30  # "GB" here is 2**30 bytes, as torch and vLLM count a GPU
CONTEXT_GB = 0.5  # CUDA context + allocator slack per process on a GPU (estimate)
NCCL_COMM_GB = 0.5  # NCCL's buffers per communicator a process is in (per-channel send/recv buffers; an estimate)
SLEEP_RESIDUE_GB = 1.0  # a sleeping vLLM engine's memory outside its sleep pools (CUDA graphs, torch's blocks; estimate)
RESERVED_GB = 0.4  # what a GPU's sold size has that CUDA does not show (an "80 GB" H100 reports 79.6)
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
CHUNK = 1024  # rlhf_core.rl.logprobs.CHUNK: LM-head positions per chunk
PHASES = ("generate", "train", "sync")
MOMENTS = ("setup: engines", "setup", "enter generate", "generate", "enter train (step 1)", "enter train", "train",
           "sync", "resume")
KINDS = ("weights", "grads", "optimizer", "kv_cache", "activations", "gather", "nccl", "context")


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
    """config.json of the model at `uri`: a folder, an artifact or a plain HF folder on any fsspec URI, or a hub id
    (only its config.json is fetched, at the revision's commit: rlhf_core.inputs.hub)."""
    from rlhf_core import store
    from rlhf_core.inputs import hub

    try:
        ref = hub.model_ref(uri)
        if ref is not None:
            return json.loads((hub.fetch(hub.resolve(ref), ["config.json"]) / "config.json").read_text())
        fs, root = store.filesystem(uri, storage_options)
        with fs.open(store.join(root, "config.json")) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 - unreachable store, no such file or repo, not JSON: all named the same way
        raise PlanError(f"{uri}/config.json cannot be read ({type(e).__name__}: {str(e)[:200]}): the plan needs "
                        f"each model's config.json (point the URI at a folder holding it, or at a hub id)") from None


def reward_ranks(cfg) -> tuple[int, bool]:
    """(ranks of the reward group, whether they shard every reward model with ZeRO-3): reward_num_nodes x
    reward_num_gpus_per_node ranks (OpenRLHF's flags), sharded under zero_stage 3 as OpenRLHF runs its reward
    models at the run's ZeRO stage when it is 3 (replicas that each score a shard of the samples otherwise)."""
    n = getattr(cfg, "reward_num_nodes", 1) * getattr(cfg, "reward_num_gpus_per_node", 1)
    return n, n > 1 and cfg.zero_stage == 3


def bundle_plan(cfg, world: int, cworld: int, reference: bool, reward: bool, teachers: int = 0) -> list[tuple[str, int]]:
    """(role, placement-group bundle) for every actor, in the order Roles creates them: policy ranks, critic
    ranks, reference ranks ("reference" for one, "reference0".. for ZeRO-3 ranks: ref_num_nodes x
    ref_num_gpus_per_node), reward ranks ("reward" for one, "reward0".. for reward_num_nodes x
    reward_num_gpus_per_node), distillation teachers ("teacher{j}", one rank each), rollout engines ("rollout{j}",
    and "rollout{j}.tp{k}" for the bundles of its tensor-parallel workers k = 1 .. vllm_tensor_parallel_size - 1,
    which the engine starts itself). Each gets its own bundle, except (OpenRLHF's flags): colocate_all_models puts
    critic rank i, reference rank i, reward rank i, teacher j and engine j's TP rank k on policy rank (i, i, i, j or
    j x TP + k) mod world's bundle (the
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
    for j in range(teachers):  # on-policy distillation's teachers: one rank each, on a policy rank's bundle colocated
        add(f"teacher{j}", j % world if every else None)
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
    moment: str
    gpu: int
    role: str
    bytes: dict = field(default_factory=dict)  # kind -> bytes
    wave: int = 0  # the moment's wave (0: its only one, or the releases; 1: the acquires)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class Plan:
    gpu_gb: float  # the GPUs' size as given (sold), or as a GPU of the cluster reported it
    usable_gb: float  # what CUDA shows of it
    gpus: int
    rows: list[Holding]  # per moment, wave, GPU and role: what the role holds
    host: dict = field(default_factory=dict)  # node -> {role: pinned host bytes}
    node_gb: float | None = None
    legacy: bool = False

    def total(self, moment: str, gpu: int, wave: int | None = None) -> int:
        """Bytes on `gpu` in `wave` of `moment`, or in its fullest wave."""
        if wave is None:
            return max((self.total(moment, gpu, w) for w in {h.wave for h in self.rows if h.moment == moment}), default=0)
        return sum(h.total for h in self.rows if h.moment == moment and h.gpu == gpu and h.wave == wave)

    def fullest(self, moment: str, gpu: int) -> int:
        waves = sorted({h.wave for h in self.rows if h.moment == moment})
        return max(waves, key=lambda w: self.total(moment, gpu, w))

    def moments(self) -> list[str]:
        return list(dict.fromkeys(h.moment for h in self.rows))

    def peak(self) -> tuple[str, int, int]:
        """(moment, gpu, bytes) of the fullest GPU at any moment."""
        return max(((m, g, self.total(m, g)) for m in self.moments() for g in range(self.gpus)), key=lambda x: x[2])

    def holders(self, moment: str, gpu: int, wave: int | None = None) -> list[Holding]:
        """What each role holds on `gpu` in `wave` of `moment` (default: its fullest wave), the largest first."""
        wave = self.fullest(moment, gpu) if wave is None else wave
        return sorted((h for h in self.rows if h.moment == moment and h.gpu == gpu and h.wave == wave),
                      key=lambda h: -h.total)

    def host_peak(self) -> tuple[int, int]:
        """(node, pinned host bytes) of the fullest node."""
        return max(((n, sum(r.values())) for n, r in self.host.items()), key=lambda x: x[1], default=(0, 0))

    def fits(self) -> bool:
        return self.peak()[2] <= self.usable_gb * GB and (self.node_gb is None or self.host_peak()[1] <= self.node_gb * GB)

    def over(self) -> str:
        """The refusal: the moment, the GPU and its largest holders (or the node and its pinned memory)."""
        moment, gpu, used = self.peak()
        if used <= self.usable_gb * GB:
            node, pinned = self.host_peak()
            return (f"planned pinned host memory peaks at {pinned / GB:.1f} GB on node {node}, over its {self.node_gb:g} GB"
                    f" of RAM: {', '.join(f'{r} {v / GB:.1f}' for r, v in sorted(self.host[node].items(), key=lambda x: -x[1])[:4])}")
        top = ", ".join(f"{h.role} {h.total / GB:.1f} ({_kinds(h)})" for h in self.holders(moment, gpu)[:4])
        sold = f" of {self.gpu_gb:g}" if self.usable_gb != self.gpu_gb else ""
        return (f"planned GPU memory peaks at {used / GB:.1f} GB on GPU {gpu} at {moment}, over the {self.usable_gb:.1f} "
                f"GB{sold} CUDA can use: {top} (GB = 2**30 bytes; `rlhf-flows plan` prints every moment)")

    def table(self) -> str:
        """Per moment and GPU, what each role holds (GB), the GPU's total, and the peak; then the pinned host memory per
        node. GPUs holding the same are one row group (their ranks' names without the number: "policy" on GPUs
        1,3,5,7 is policy1, policy3, ...)."""
        import re

        cols = ["moment", "gpus", "role", *KINDS, "total"]
        lines = []
        for m in self.moments():
            groups: dict = {}
            for g in range(self.gpus):
                sig = tuple((re.sub(r"\d+", "", h.role), tuple(sorted(h.bytes.items()))) for h in self.holders(m, g)
                            if h.total)
                groups.setdefault(sig, []).append(g)
            for gs in groups.values():
                many = len(gs) > 1
                for h in [h for h in self.holders(m, gs[0]) if h.total]:
                    lines.append([m, _span(gs), re.sub(r"\d+", "", h.role) if many else h.role,
                                  *(_gb(h.bytes.get(k, 0)) for k in KINDS), _gb(h.total)])
                lines.append([m, _span(gs), "= per GPU", *[""] * len(KINDS), _gb(self.total(m, gs[0]))])
        width = [max(len(c), *(len(r[i]) for r in lines)) for i, c in enumerate(cols)]
        fmt = lambda r: "  ".join(x.ljust(w) if i < 3 else x.rjust(w) for i, (x, w) in enumerate(zip(r, width)))  # noqa: E731
        moment, gpu, used = self.peak()
        host = [f"pinned host memory: node {n}: {sum(r.values()) / GB:.1f} GB ("
                + ", ".join(f"{k} {v / GB:.1f}" for k, v in _grouped(r)) + ")" for n, r in sorted(self.host.items())
                if sum(r.values())]
        node, pinned = self.host_peak()
        verdict = "fits" if self.fits() else "DOES NOT FIT"
        return "\n".join([fmt(cols), *map(fmt, lines), *host,
                          f"peak: {used / GB:.1f} GB on GPU {gpu} at {moment} of {self.usable_gb:.1f} GB usable per GPU"
                          + (f" ({self.gpu_gb:g} GB sold)" if self.usable_gb != self.gpu_gb else "")
                          + (f"; pinned host memory {pinned / GB:.1f} GB on node {node} of {self.node_gb:g} GB"
                             if self.node_gb else "") + f": {verdict}"
                          + (" (the order before issues 35 and 41)" if self.legacy else "")])


def _span(gpus: list[int]) -> str:
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))


def _gb(n: int) -> str:
    return f"{n / GB:.2f}" if n else "-"


def _kinds(h: Holding) -> str:
    return ", ".join(f"{k} {v / GB:.1f}" for k, v in sorted(h.bytes.items(), key=lambda kv: -kv[1]) if v >= 0.05 * GB)


def _grouped(roles: dict) -> list[tuple[str, int]]:
    """Pinned bytes per kind of role ("policy" for policy0..policy7)."""
    import re

    out: dict[str, int] = {}
    for r, v in roles.items():
        k = re.sub(r"\d+", "", r.split(".")[0])
        out[k] = out.get(k, 0) + v
    return sorted(out.items(), key=lambda kv: -kv[1])


def usable_gb(gpu_gb: float, reported: bool) -> float:
    """What CUDA can use of a GPU: `gpu_gb` as a GPU reported it (torch's total_memory), else the sold size less
    RESERVED_GB."""
    return gpu_gb if reported else gpu_gb - RESERVED_GB


def plan(cfg, shapes: dict[str, Shape], gpu_gb: float, legacy: bool = False, reported: bool = False,
         node_gb: float | None = None) -> Plan:
    """The plan of `cfg` (the ppo stage's config, read by attribute) on GPUs of `gpu_gb` GB (`reported`: as a GPU of
    the cluster reported it, else as sold) and nodes of `node_gb` GB of RAM: `shapes` holds the policy's ("policy"),
    and when used the critic's ("critic") and the reward models' ("reward": a list)."""
    world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node if cfg.advantage_estimator == "gae" else 0
    rworld = cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
    has_ref, rms, teachers = cfg.init_kl_coef > 0, shapes.get("reward") or [], shapes.get("teacher") or []
    where = bundle_plan(cfg, world, cworld, has_ref, bool(rms), len(teachers))
    b = 2 if cfg.bf16 else 4
    engine_gpus = {g for n, g in where if n.startswith("rollout")}
    shared = bool(engine_gpus & {g for n, g in where if not n.startswith("rollout")})
    first = shared and not legacy  # engines load alone, first (placement.Roles)
    after_setup = "asleep" if first and cfg.vllm_enable_sleep else "awake"
    gen, trn, syn = (role_states(cfg, p, legacy) for p in PHASES)
    # each moment: its waves; a wave: (learner state, engine state, activity); a role changing state in a wave is
    # given the larger of its two states
    waves: dict[str, list[tuple[str, str, str | None]]] = {}
    if first:
        waves["setup: engines"] = [("absent", "awake", "profile")]
    waves["setup"] = [("loading", after_setup if not legacy else "awake", None)]
    waves["enter generate"] = [("awake0", _larger(after_setup, gen["engine"]), None)] if legacy \
        else [("awake0", after_setup, None), (gen["learner"], gen["engine"], None)]
    waves["generate"] = [(gen["learner"], gen["engine"], "generate")]
    for name, awake in (("enter train (step 1)", "awake0"), ("enter train", "awake")):
        learner = awake if trn["learner"] == "awake" else trn["learner"]
        waves[name] = [(_larger(gen["learner"], learner), _larger(gen["engine"], trn["engine"]), None)] if legacy \
            else [(gen["learner"], _larger(gen["engine"], trn["engine"]), None), (learner, trn["engine"], None)]
    waves["train"] = [("awake", trn["engine"], "train")]
    waves["sync"] = [("awake", _larger(trn["engine"], syn["engine"]), "sync")] if legacy else \
        [("awake", trn["engine"], None), (syn["learner"], syn["engine"], "sync")]
    waves["resume"] = [("resumed+buffers" if cfg.deepspeed_enable_sleep and cfg.zero_stage == 3 else "awake", "awake",
                        None)] if legacy else [("awake", after_setup, None)]
    comms = _communicators(cfg, where, world, cworld, rworld, rms)
    rows = []
    for moment, ws in waves.items():
        per_wave = []
        for learner, engine, activity in ws:
            held = {}
            for name, gpu in where:
                got = _role(cfg, shapes, name, learner, engine, activity, world, cworld, rworld, rms, b,
                            usable_gb(gpu_gb, reported), legacy)
                if got is None:
                    continue
                got = {k: int(v) for k, v in got.items() if v}
                got["context"] = got.get("context", 0) + int(CONTEXT_GB * GB)
                if comms.get(name):
                    got["nccl"] = int(comms[name] * NCCL_COMM_GB * GB)
                held[name] = (gpu, got)
            per_wave.append(held)
        rows += [Holding(moment, g, name, h, w) for w, held in enumerate(per_wave) for name, (g, h) in held.items()]
    return Plan(gpu_gb, usable_gb(gpu_gb, reported), 1 + max(g for _, g in where), rows,
                _pinned(cfg, shapes, where, world, cworld, rworld, rms, b), node_gb, legacy)


_ORDER = ("asleep", "weights", "awake0", "awake", "resumed+buffers")


def _kind(name: str) -> str:
    """The kind of role a bundle_plan name is: policy3 -> policy, rollout1.tp1 -> rollout."""
    return name[:len(name) - len(name.lstrip("abcdefghijklmnopqrstuvwxyz"))]


def _larger(a: str, b: str) -> str:
    """Of two states of one role, the one holding more (a role changing state in a wave holds it during the change)."""
    return max(a, b, key=_ORDER.index)


def _role(cfg, shapes, name, learner, engine, activity, world, cworld, rworld, rms, b, gpu_gb, legacy):
    """What role `name` holds in a wave, or None where it is not on its GPU yet."""
    kind = _kind(name)
    if learner == "absent" and kind != "rollout":
        return None  # setup: engines: only the engines are loaded
    if kind in ("policy", "critic"):
        rank = int(name[len(kind):])
        state = "awake0" if learner == "loading" else learner
        out = _learner(cfg, shapes[kind], kind, rank, world if kind == "policy" else cworld, b, activity, state, legacy)
        if learner == "loading" and cfg.zero_stage == 3 and not cfg.adam_offload:  # initialize_optimizer_states
            out["optimizer"] = out.get("optimizer", 0) + 4 * shapes[kind].params / (world if kind == "policy" else cworld)
        return out
    if kind == "reference":
        return _reference(cfg, shapes["policy"], rworld, b, activity)
    if kind == "teacher":  # a reference-like forward of the student's samples, with the teacher's sizes
        return _reference(cfg, shapes["teacher"][int(name[len(kind):])], 1, b, activity)
    if kind == "reward":
        return _reward(cfg, rms, b, activity, *reward_ranks(cfg))
    return _engine(cfg, shapes["policy"], b, activity, engine, gpu_gb, name)


def _communicators(cfg, where, world, cworld, rworld, rms) -> dict[str, int]:
    """NCCL communicators each process is in: its group's own (the learners', ZeRO-3 inference ranks'), the weight
    sync's (policy rank 0 and every engine worker, unless CUDA IPC or the object store carries it), an engine's TP
    group."""
    ipc = cfg.colocate_all_models
    weight_group = cfg.vllm_num_engines > 0 and cfg.weight_sync_backend == "collective" and not ipc
    out = {}
    for name, _ in where:
        kind = _kind(name)
        n = {"policy": world > 1, "critic": cworld > 1, "reference": rworld > 1,
             "reward": bool(rms) and reward_ranks(cfg)[1]}.get(kind, False)
        n = int(n) + int(weight_group and (name == "policy0" or kind == "rollout")) + \
            int(kind == "rollout" and cfg.vllm_tensor_parallel_size > 1)
        if n:
            out[name] = n
    return out


def _pinned(cfg, shapes, where, world, cworld, rworld, rms, b) -> dict:
    """Pinned host memory per node (GPU g on node g // actor_num_gpus_per_node): vLLM's weight backups while asleep,
    DeepSpeed's offloaded states (deepspeed_enable_sleep: fp32 masters, Adam's moments, the gradient partition),
    ZeRO-Offload's (adam_offload), the offloaded reference and reward weights (ref_reward_offload)."""
    per_node = max(1, cfg.actor_num_gpus_per_node)
    out: dict = {}
    for name, gpu in where:
        kind = _kind(name)
        got = 0
        if kind in ("policy", "critic"):
            P, n = shapes[kind].params, world if kind == "policy" else cworld
            if cfg.adam_offload:
                got = 12 * P / n
            elif cfg.deepspeed_enable_sleep:
                got = 12 * P / n + P * b / (n if cfg.zero_stage >= 2 else 1)
        elif kind == "rollout" and cfg.vllm_enable_sleep and cfg.rollout_backend == "vllm":
            got = shapes["policy"].params * b / cfg.vllm_tensor_parallel_size
        elif kind == "reference" and cfg.ref_reward_offload:
            got = shapes["policy"].params * b / rworld
        elif kind == "reward" and cfg.ref_reward_offload:
            n, sharded = reward_ranks(cfg)
            got = sum(s.params for s in rms) * b / (n if sharded else 1)
        if got:
            out.setdefault(gpu // per_node, {})[name] = int(got)
    return out


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


def _learner(cfg, s: Shape, kind: str, rank: int, world: int, b: int, activity: str | None, state: str,
             legacy: bool) -> dict:
    """A learner rank: "asleep" (weights only), "awake0" (before its first step: no Adam moments yet), "awake", or
    "resumed+buffers" (before issue 41: a resumed ZeRO-3 rank with DeepSpeed's offload buffers loaded on the GPU)."""
    P, z = s.params, cfg.zero_stage
    out = {"weights": P * b / (world if z == 3 else 1)}
    if state != "asleep":
        if not cfg.adam_offload:
            master = 4 if b == 2 or z >= 1 else 0
            moments = {"awake0": 0, "awake": 8, "resumed+buffers": 16}[state]
            out["optimizer"] = (master + moments) * P / (world if z >= 1 else 1)
        bucket = REDUCE_BUCKET if z == 3 else min(REDUCE_BUCKET, P)  # ZeRO-3 allocates reduce_bucket_size whole
        out["grads"] = (P * b / world + bucket * b) if z >= 2 else P * (4 if z == 0 and b == 2 else b)
    if activity == "train":
        act = max(train_activations(s, _tokens(cfg, True), b, cfg.gradient_checkpointing, kind == "policy"),
                  forward_activations(s, _tokens(cfg, False), b, kind == "policy"))
        out["activations"] = max(act, 4 * P / (world if z >= 1 else 1))  # or the step's fp32 gradients
        if z == 3:
            out["gather"] = _zero3_gather(s, b)
    elif activity == "sync" and kind == "policy" and cfg.vllm_num_engines:
        ipc = cfg.colocate_all_models and cfg.weight_sync_backend != "object_store"
        if cfg.weight_sync_backend == "object_store":
            whole = legacy and z == 3  # before issue 35 every rank gathered every parameter at once
            out["gather"] = P * b if whole else _bucket(cfg, s, b) if z == 3 else 0
        else:  # the gathered bucket, and the flat buffer rank 0 sends (every rank's own with CUDA IPC)
            out["gather"] = _bucket(cfg, s, b) * ((z == 3) + (rank == 0 or ipc))
    return out


def _reference(cfg, s: Shape, rworld: int, b: int, activity: str | None) -> dict:
    resident = 0 if cfg.ref_reward_offload else s.params * b / rworld
    out = {"weights": resident}
    if activity == "train":  # its forward: the whole model (one rank, offloaded: moved in for it) or gathers
        out["activations"] = forward_activations(s, _tokens(cfg, False), b, True)
        if rworld > 1:
            out["gather"] = _zero3_gather(s, b)
        elif cfg.ref_reward_offload:
            out["weights"] = s.params * b
    return out


def _reward(cfg, shapes: list[Shape], b: int, activity: str | None, n: int = 1, sharded: bool = False) -> dict:
    """One reward rank: every model's weights (its ZeRO-3 partition when sharded over the n ranks)."""
    weights = sum(s.params for s in shapes) * b / (n if sharded else 1)
    out = {"weights": 0 if cfg.ref_reward_offload and activity != "generate" else weights}
    if activity == "generate":  # the rollout scores its samples, a micro-batch at a time
        rows = cfg.micro_rollout_batch_size or cfg.micro_train_batch_size
        out["activations"] = max(forward_activations(s, rows * cfg.reward_max_len, b, False) for s in shapes)
        if sharded:
            out["gather"] = max(_zero3_gather(s, b) for s in shapes)
    return out


def _engine(cfg, s: Shape, b: int, activity: str | None, state: str, gpu_gb: float, name: str) -> dict:
    """A rollout engine's worker (one per GPU of its TP group): "awake", "weights" (vLLM's wake_up(tags=["weights"]))
    or "asleep"; receiving in sync."""
    tp = cfg.vllm_tensor_parallel_size
    ipc = cfg.colocate_all_models and cfg.weight_sync_backend != "object_store"
    if cfg.rollout_backend == "vllm":
        if state == "asleep":
            return {"context": SLEEP_RESIDUE_GB * GB}
        if state == "weights":
            out = {"weights": s.params * b / tp}
        else:  # vLLM sizes itself: weights, activations and KV cache within its share of the GPU
            total = cfg.vllm_gpu_memory_utilization * gpu_gb * GB
            out = {"weights": s.params * b / tp, "kv_cache": max(0.0, total - s.params * b / tp)}
        if activity == "sync":  # CUDA IPC maps the sender's bucket: vLLM's loaders' temporaries, about a layer
            out["gather"] = s.layer_params * b / tp if ipc else _bucket(cfg, s, b)
        return out
    if state == "asleep":
        return {}
    out = {"weights": s.params * b}
    if activity == "generate":  # every row of the engine's shard at once, prompt + new tokens
        rows = -(-cfg.rollout_batch_size * cfg.n_samples_per_prompt // max(1, cfg.vllm_num_engines))
        seq = cfg.prompt_max_len + cfg.generate_max_len
        out["kv_cache"] = 2 * s.layers * s.kv_heads * s.head_dim * rows * seq * b
        out["activations"] = 22 * rows * s.vocab
    elif activity == "sync" and cfg.weight_sync_backend == "object_store":
        out["gather"] = _bucket(cfg, s, b)  # one bucket from the object store, on its way into the parameters
    return out  # collective and CUDA IPC land in the parameters themselves


def shapes_of(policy: str, reward_models: list[str] = (), critic: str | None = None,
              storage_options: dict | None = None, teachers: list[str] = ()) -> dict:
    """`plan`'s shapes from the models' config.json (folders or URIs): the policy (also the reference and the
    engines), the critic, every reward model (score heads) and every distillation teacher (LM heads)."""
    out = {"policy": shape(read_config(policy, storage_options), "lm", f"{policy}/config.json"),
           "reward": [shape(read_config(u, storage_options), "score", f"{u}/config.json") for u in reward_models],
           "teacher": [shape(read_config(u, storage_options), "lm", f"{u}/config.json") for u in teachers]}
    if critic:
        out["critic"] = shape(read_config(critic, storage_options), "score", f"{critic}/config.json")
    return out


def check(cfg, shapes: dict, gpu_gb: float, reported: bool = False) -> Plan:
    """The plan, or PlanError naming the moment, the GPU and its largest holders when its peak is over what CUDA can
    use of `gpu_gb` (`reported`: a GPU of the cluster's figure, else the size sold)."""
    p = plan(cfg, shapes, gpu_gb, reported=reported)
    if not p.fits():
        raise PlanError(p.over())
    return p
