"""Producing and judging samples: generation over HF / vLLM engines on Ray (generation.py), reward sources behind
one interface (rewards.py: reward models, reward_func files, remote HTTP; serve_rm.py serves a reward model), the
multi-turn agent executor of OpenRLHF's AgentInstance contract (agent.py) and OpenRLHF's offline filters over
scored rows (postprocess.py: rs / iter_dpo / csft). Uses the trainers' tokenization (train.batches) so a reward
model scores exactly what it was trained on."""
