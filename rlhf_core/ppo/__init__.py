"""Online RL on Ray: the roles (roles.py) and the driver loop (loop.py) behind the ppo stage. The math is in
rlhf_core.rl_math. Nothing here is imported by `import rlhf_core`; ray and deepspeed load inside functions."""
