"""Online RL on Ray behind the ppo stage: the learner and reference roles (roles.py) and their forwards (forward.py),
the rollout engines (engines.py), the weight path between them (weight_sync.py), where they are placed
(placement.py), what they hold on each GPU in each phase (plan.py), the settings' rules checked before Ray starts
(checks.py), each node's store traffic (node_store.py), one step's rollout and the held-out evaluation (rollout.py),
the rollout feed (feed.py), the padded batch (batches.py), the driver loop (loop.py), a step's FLOPs, throughput and
rollout samples (step_metrics.py) and the run's memory timeline (timeline.py). The math is in rlhf_core.rl.rl_math.
Nothing here is imported by `import rlhf_core`; ray and deepspeed load inside functions."""
