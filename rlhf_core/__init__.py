"""rlhf_core: the library behind the stages and flows (no Prefect anywhere in it). Its rooms, bottom up; a room
imports only from rooms below it (tests/test_layers.py holds the order):

    store/     artifacts on object storage: URIs, manifests, the atomic writer, the run lock's fence, leases,
               kept versions
    demo/      the demo's offline tiny models and its toy task with a gold reward
    inputs/    what a stage is given: model folders (plain HF or committed), tokenizer conventions, datasets
    rl/        the math: training losses, online-RL advantages / KL / policy and value losses, chunked log-probs
    runtime/   running work: training jobs as child processes, stages as Ray Jobs, progress lines, trackers,
               devices and memory
    train/     the DeepSpeed training job (sft, rm, dpo, kto, kd, prm) and its launcher
    rollout/   sampling (HF / vLLM engines on Ray), reward sources, the agent executor, the offline filters
    ppo/       online RL on Ray: the roles, engines, weight sync, placement and the driver loop

Heavy dependencies (deepspeed, ray, vllm) load inside the functions that use them, so `import rlhf_core` is light.
"""
