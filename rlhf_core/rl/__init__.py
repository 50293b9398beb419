"""The math as pure functions over tensors, each tested against hand-computed values: the training losses (losses.py:
SFT, reward model, DPO, KTO, distillation), the online-RL math (rl_math.py: KL estimators, the advantage
estimators, PPO policy and value losses, KL controllers) and per-token log-probs and entropy of a causal LM
without a (B, T, V) fp32 tensor (logprobs.py). Imports nothing else of rlhf_core but torch."""
