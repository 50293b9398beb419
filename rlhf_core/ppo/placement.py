"""Where the roles of one ppo run live: a Ray placement group whose bundles the roles share as OpenRLHF's
colocation flags say (bundle_plan), and the actors placed on it (Roles)."""
from __future__ import annotations

import time

import torch


class RoleError(RuntimeError):
    """A role's call failed or did not answer within role_timeout_s; the message names the roles and the phase."""


def wait_all(refs: list, names: list[str], phase: str, timeout_s: float, error=RoleError) -> list:
    """ray.get of every ref (`names[i]` the role behind refs[i]), bounded: a call not answered within `timeout_s`
    raises `error` naming the roles still silent and the phase, never a silent hang (a sleeping vLLM that queues
    a generate, a peer stuck in a collective). The first failure waits a moment for the others to settle, then
    raises one error naming every role that failed, rollout engines first (a dead engine is the cause, a
    sender's broken connection the consequence)."""
    import ray

    pending, failed, deadline = list(refs), [], time.monotonic() + timeout_s
    while pending and not failed:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        failed += [r for r in done if _error(r)]
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
    except Exception as e:  # RayActorError (the actor died), RayTaskError (it raised)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"


def bundle_plan(cfg, world: int, cworld: int, reference: bool, reward: bool) -> list[tuple[str, int]]:
    """(role, placement-group bundle) for every actor, in the order Roles creates them: policy ranks, critic
    ranks, reference ranks ("reference" for one, "reference0".. for ZeRO-3 ranks: ref_num_nodes x
    ref_num_gpus_per_node), reward, rollout engines ("rollout{j}", and "rollout{j}.tp{k}" for the bundles of
    its tensor-parallel workers k = 1 .. vllm_tensor_parallel_size - 1, which the engine starts itself). Each
    gets its own bundle, except (OpenRLHF's flags): colocate_all_models puts critic rank i, reference rank i,
    the reward model and engine j's TP rank k on policy rank (i, 0 or j x TP + k) mod world's bundle (the
    hybrid engine); colocate_actor_ref puts reference rank i on policy rank i's bundle; colocate_critic_reward
    puts the reward model on critic rank 0's bundle."""
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
        critic0 = dict(plan).get("critic0")
        add("reward", 0 if every else critic0 if cfg.colocate_critic_reward and critic0 is not None else None)
    for j in range(cfg.vllm_num_engines):
        for k in range(tp):
            add(f"rollout{j}" + (f".tp{k}" if k else ""), (j * tp + k) % world if every else None)
    return plan


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
                         f"vllm_tensor_parallel_size, the reference ref_num_nodes x ref_num_gpus_per_node) need "
                         f"{' and '.join(short)}; free: {free.get('GPU', 0):g} GPUs, {free.get('CPU', 0):g} CPUs")


class Roles:
    """The Ray actors of one run, on one placement group (bundles as bundle_plan says)."""

    def __init__(self, cfg, policy_dir: str, critic_dir: str | None, ref_dir: str | None, reward_model_dir: str | None,
                 total_opt_steps: int, hp: dict, max_model_len: int, reward_spec=None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.runtime.jobs import free_port
        from rlhf_core.ppo import engines, node_store, weight_sync
        from rlhf_core.ppo.roles import Learner, Reference
        from rlhf_core.rollout.rewards import RMEnsemble

        cuda = torch.cuda.is_available()
        world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
        self.plan = bundle_plan(cfg, world, cworld if critic_dir else 0, bool(ref_dir), bool(reward_model_dir))
        self.cfg, self.hp, self.asleep = cfg, hp, set()
        self.timeout = cfg.role_timeout_s
        n_bundles = 1 + max(b for _, b in self.plan)
        share = [sum(b == i for _, b in self.plan) for i in range(n_bundles)]
        cpus = ray.cluster_resources().get("CPU", 1)
        per_cpu = max(0.01, min(1.0, cpus / n_bundles))  # on a small CPU host the roles share cores
        gpu = 1 if cuda else 0
        check_resources(self.plan, ray.available_resources(), cuda, per_cpu)  # before any actor starts
        self.pg = placement_group([{"CPU": per_cpu, **({"GPU": gpu} if gpu else {})} for _ in range(n_bundles)],
                                  strategy="PACK")
        ray.get(self.pg.ready(), timeout=cfg.ray_timeout_s)
        env = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(cpus // max(1, world))))}}}
        slots = dict(self.plan)

        def place(name, cls, *args, gpus=0, capture=False, **kwargs):
            b = slots[name]  # actors sharing a bundle split its CPU (and GPU) evenly
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=b,
                                                        placement_group_capture_child_tasks=capture)
            role_env = {"runtime_env": {"env_vars": {**env["runtime_env"]["env_vars"], **node_store.actor_env(name)}}}
            return ray.remote(cls).options(num_cpus=per_cpu / share[b], num_gpus=gpus / share[b] if gpus else 0,
                                           scheduling_strategy=strategy, **role_env).remote(*args, **kwargs)

        self.all = []
        # every role runs its model on a GPU when there is one, so each reserves its (share of a) GPU: an actor
        # without a reservation would still see every GPU and use GPU 0
        self.policy = [place(f"policy{r}", Learner, "policy", r, world, gpus=gpu) for r in range(world)]
        self.critic = [place(f"critic{r}", Learner, "critic", r, cworld, gpus=gpu) for r in range(cworld)] \
            if critic_dir else []
        # the reference: a group the driver forwards shards of each batch through (one actor, or ZeRO-3 ranks)
        rworld = cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
        self.reference = [place("reference" if rworld == 1 else f"reference{r}", Reference, ref_dir, hp, r, rworld,
                                gpus=gpu) for r in range(rworld)] if ref_dir else None
        # one actor holds every reward model of reward_model_uri "a,b" (each scores, the driver combines)
        rms = [u.strip() for u in reward_model_dir.split(",") if u.strip()] if reward_model_dir else []
        self.reward = place("reward", RMEnsemble, rms, reward_spec, gpus=gpu,
                            offload=hp["ref_reward_offload"]) if rms else None
        # each engine's bundles, its own first, then its tensor-parallel workers' (for the engine to place them)
        self.engine_bundles = [[b for name, b in self.plan if name.split(".")[0] == f"rollout{j}"]
                               for j in range(cfg.vllm_num_engines)]
        engine_cls, engine_args = engines.engine_spec(cfg, policy_dir, max_model_len)
        if cfg.vllm_num_engines == 0:  # policy rank 0 generates with its own model (Learner.generate)
            self.rollouts = []
        elif cfg.vllm_tensor_parallel_size == 1:
            self.rollouts = [place(f"rollout{j}", engine_cls, *engine_args, gpus=gpu)
                             for j in range(cfg.vllm_num_engines)]
        else:  # the engine's TP workers (vLLM's Ray executor) take its bundles' GPUs: the engine itself none
            self.rollouts = [place(f"rollout{j}", engine_cls, *engine_args, capture=True, bundles=self.engine_bundles[j],
                                   gpus_per_worker=1 / share[self.engine_bundles[j][0]])
                             for j in range(cfg.vllm_num_engines)]
        self.all = [*self.policy, *self.critic, *(self.reference or []), *([self.reward] if self.reward else []),
                    *self.rollouts]
        self._names = [*(f"policy{r}" for r in range(world)), *(f"critic{r}" for r in range(len(self.critic))),
                       *(n for n, _ in self.plan if n.startswith("reference")), *(["reward"] if self.reward else []),
                       *(f"rollout{j}" for j in range(len(self.rollouts)))]
        setups, who = [], []
        for group, model_dir in ((self.policy, policy_dir), (self.critic, critic_dir)):
            if group:
                addr, port = ray.get(group[0].node_ip.remote()), free_port()
                setups += [a.setup.remote(model_dir, hp, addr, port, total_opt_steps) for a in group]
                who += group
        if self.reference and rworld > 1:  # the ZeRO-3 reference ranks join their own group
            addr, port = ray.get(self.reference[0].node_ip.remote()), free_port()
            setups += [a.setup.remote(addr, port) for a in self.reference]
            who += self.reference
        self.wait(setups, who, "setting up")
        if cfg.vllm_num_engines == 0:
            self.rollouts = self.policy[:1]
        self.weights = weight_sync.connect(self, cfg)

    def phase(self, name: str) -> None:
        """The driver enters phase `name` of a step: "generate" (the rollout), "train" (experience forwards and
        updates), "sync" (new weights into the engines). The hybrid engine (OpenRLHF's colocate_all_models
        setup) frees each role's GPU memory while the others use the GPU: deepspeed_enable_sleep puts the
        learners to sleep (DeepSpeed's offload_states) for "generate" and wakes them for "train" (they stay
        awake for "sync", whose weights they send); vllm_enable_sleep puts the engines to sleep (vLLM's sleep:
        weights and KV cache released) for "train" and wakes them for "sync". Without the flags nothing happens."""
        import ray

        learners = [*self.policy, *self.critic] if self.hp["deepspeed_enable_sleep"] else []
        engines = self.rollouts if self.cfg.vllm_enable_sleep else []
        to_sleep = learners if name == "generate" else engines if name == "train" else []
        to_wake = learners if name == "train" else engines if name in ("sync", "generate") else []
        sleeping = [a for a in to_sleep if a not in self.asleep]
        waking = [a for a in to_wake if a in self.asleep]
        calls = [a.sleep.remote() for a in sleeping] + [a.wake_up.remote() for a in waking]
        self.asleep = (self.asleep | set(to_sleep)) - set(to_wake)
        self.wait(calls, sleeping + waking, f"entering {name}")

    def name(self, actor) -> str:
        """The role an actor plays ("policy0", "reward", "rollout1", ...)."""
        return next(n for n, a in zip(self._names, self.all) if a is actor)

    def wait(self, refs: list, actors: list, phase: str, error=RoleError) -> list:
        """wait_all of `refs` (refs[i] a call of actors[i]) within role_timeout_s, errors naming roles and phase."""
        return wait_all(refs, [self.name(a) for a in actors], phase, self.timeout, error)

    def peak_memory(self) -> dict:
        """Peak memory (GB) of the inference roles: the reference, the reward model, the fullest rollout engine
        (the learners report theirs with each train step)."""
        import ray

        named = [("reference", r) for r in self.reference or []] + [("reward", self.reward)] * bool(self.reward) + \
            [("rollout", e) for e in self.rollouts]
        out: dict[str, float] = {}
        for (k, _), v in zip(named, ray.get([a.peak_memory_gb.remote() for _, a in named])):
            out[f"{k}_peak_mem_gb"] = max(v, out.get(f"{k}_peak_mem_gb", 0.0))  # the fullest rank / engine
        return out

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.all:
            ray.kill(a)
        remove_placement_group(self.pg)
