"""Where the roles of one ppo run live: a Ray placement group whose bundles the roles share as OpenRLHF's
colocation flags say (bundle_plan), and the actors placed on it (Roles)."""
from __future__ import annotations

import torch


def bundle_plan(cfg, world: int, cworld: int, reference: bool, reward: bool) -> list[tuple[str, int]]:
    """(role, placement-group bundle) for every actor, in the order Roles creates them: policy ranks, critic
    ranks, reference, reward, rollout engines. Each actor gets its own bundle, except (OpenRLHF's flags):
    colocate_all_models puts critic rank i, the reference, the reward model and engine j on policy rank
    (i or j) mod world's bundle (the hybrid engine); colocate_actor_ref puts the reference on policy rank 0's
    bundle; colocate_critic_reward puts the reward model on critic rank 0's bundle."""
    plan = [(f"policy{r}", r) for r in range(world)]
    nxt = world

    def add(name: str, shared: int | None) -> None:
        nonlocal nxt
        if shared is None:
            shared, nxt = nxt, nxt + 1
        plan.append((name, shared))

    every = cfg.colocate_all_models
    for r in range(cworld):
        add(f"critic{r}", r % world if every else None)
    if reference:
        add("reference", 0 if every or cfg.colocate_actor_ref else None)
    if reward:
        critic0 = dict(plan).get("critic0")
        add("reward", 0 if every else critic0 if cfg.colocate_critic_reward and critic0 is not None else None)
    for j in range(cfg.vllm_num_engines):
        add(f"rollout{j}", j % world if every else None)
    return plan


class Roles:
    """The Ray actors of one run, on one placement group (bundles as bundle_plan says)."""

    def __init__(self, cfg, policy_dir: str, critic_dir: str | None, ref_dir: str | None, reward_model_dir: str | None,
                 total_opt_steps: int, hp: dict, max_model_len: int, reward_spec=None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.jobs import free_port
        from rlhf_core.ppo import engines, node_store, weight_sync
        from rlhf_core.ppo.roles import Learner, Reference
        from rlhf_core.rewards import RMEngine

        cuda = torch.cuda.is_available()
        world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
        self.plan = bundle_plan(cfg, world, cworld if critic_dir else 0, bool(ref_dir), bool(reward_model_dir))
        n_bundles = 1 + max(b for _, b in self.plan)
        share = [sum(b == i for _, b in self.plan) for i in range(n_bundles)]
        cpus = ray.cluster_resources().get("CPU", 1)
        per_cpu = max(0.01, min(1.0, cpus / n_bundles))  # on a small CPU host the roles share cores
        gpu = 1 if cuda else 0
        self.pg = placement_group([{"CPU": per_cpu, **({"GPU": gpu} if gpu else {})} for _ in range(n_bundles)],
                                  strategy="PACK")
        ray.get(self.pg.ready(), timeout=cfg.ray_timeout_s)
        env = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(cpus // max(1, world))))}}}
        slots = iter(self.plan)

        def place(cls, *args, gpus=0):
            name, b = next(slots)  # actors sharing a bundle split its CPU (and GPU) evenly
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=b)
            role_env = {"runtime_env": {"env_vars": {**env["runtime_env"]["env_vars"], **node_store.actor_env(name)}}}
            return ray.remote(cls).options(num_cpus=per_cpu / share[b], num_gpus=gpus / share[b] if gpus else 0,
                                           scheduling_strategy=strategy, **role_env).remote(*args)

        self.all = []
        # every role runs its model on a GPU when there is one, so each reserves its (share of a) GPU: an actor
        # without a reservation would still see every GPU and use GPU 0
        self.policy = [place(Learner, "policy", r, world, gpus=gpu) for r in range(world)]
        self.critic = [place(Learner, "critic", r, cworld, gpus=gpu) for r in range(cworld)] if critic_dir else []
        self.reference = place(Reference, ref_dir, hp, gpus=gpu) if ref_dir else None
        self.reward = place(RMEngine, reward_model_dir, reward_spec, gpus=gpu) if reward_model_dir else None
        engine_cls, engine_args = engines.engine_spec(cfg, policy_dir, max_model_len)
        self.rollouts = [place(engine_cls, *engine_args, gpus=gpu) for _ in range(cfg.vllm_num_engines)]
        self.all = [*self.policy, *self.critic, *[a for a in (self.reference, self.reward) if a], *self.rollouts]
        setups = []
        for group, model_dir in ((self.policy, policy_dir), (self.critic, critic_dir)):
            if group:
                addr, port = ray.get(group[0].node_ip.remote()), free_port()
                setups += [a.setup.remote(model_dir, hp, addr, port, total_opt_steps) for a in group]
        ray.get(setups)
        self.weights = weight_sync.connect(self, cfg)

    def phase(self, name: str) -> None:
        """The driver enters phase `name` of a step: "generate" (the rollout), "train" (experience forwards and
        updates), "sync" (new weights into the engines). The hybrid engine's sleep flags act here; without them
        nothing happens."""

    def peak_memory(self) -> dict:
        """Peak memory (GB) of the inference roles: the reference, the reward model, the fullest rollout engine
        (the learners report theirs with each train step)."""
        import ray

        named = [(k, a) for k, a in (("reference", self.reference), ("reward", self.reward)) if a is not None]
        got = ray.get([a.peak_memory_gb.remote() for _, a in named] + [e.peak_memory_gb.remote() for e in self.rollouts])
        out = {f"{k}_peak_mem_gb": v for (k, _), v in zip(named, got)}
        if self.rollouts:
            out["rollout_peak_mem_gb"] = max(got[len(named):])
        return out

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.all:
            ray.kill(a)
        remove_placement_group(self.pg)
