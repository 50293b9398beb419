"""Producing and judging samples: generation over HF / vLLM engines on Ray (generation.py), reward sources behind
one interface (rewards.py: reward_func files and remote HTTP servers, dispatching; reward_spec.py: the interface's
types; reward_model.py: reward models on Ray actors; serve_rm.py serves one), OpenRLHF's AgentInstance contract
(agent.py) and the executor that runs its episodes over the engines (episodes.py), and OpenRLHF's offline filters
over scored rows (postprocess.py: rs / iter_dpo / csft). Uses the trainers' tokenization (train.batches) so a
reward model scores exactly what it was trained on."""
