"""A multi-turn environment on the demo task (OpenRLHF's agent contract: `--agent_func_path`).

The policy writes a review ("Review of the movie: ..."). The environment scores it with the demo's gold reward
(positive minus negative words, per word, in [-1, 1]). A review scoring below ACCEPT is sent back: the feedback
is the request again ("Review of the movie: "), so the policy gets another try with its rejected review in
context. The episode ends when a review is accepted or after MAX_TRIES reviews; its reward is the last review's
gold reward minus RETRY_COST per retry, so the policy learns to write a positive review, sooner rather than later.
Each step rewards the change of that value (this try's minus the previous try's): an episode's reward is the sum of
its steps' rewards (OpenRLHF's MultiTurnAgentExecutor), so it is the last review's value, also for an episode the
token budget ends before a review is accepted.

extra_logs: first_reward (the first review's gold reward), tries, accepted.
Written for OpenRLHF: only the import line differs (`from openrlhf.utils.agent import ...`); AgentExecutor runs
AgentInstance as OpenRLHF's MultiTurnAgentExecutor does.
"""
import re

from rlhf_core.rollout.agent import AgentInstanceBase, MultiTurnAgentExecutor
from rlhf_core.demo.demo_task import gold_reward

ACCEPT = 0.5
MAX_TRIES = 3
RETRY_COST = 0.1


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0
        self.first = None
        self.value = 0.0  # the last review's value so far (the sum of the rewards given)
        self.request = ""

    async def reset(self, states, **kwargs):
        match = re.search(r"Review of the \w+:", states["observation"])
        self.request = match.group(0) if match else states["observation"].strip()
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.tries += 1
        score = gold_reward(states["action_text"])
        if self.first is None:
            self.first = score
        accepted = score >= ACCEPT
        done = accepted or self.tries >= MAX_TRIES
        value = score - RETRY_COST * (self.tries - 1)
        reward, self.value = value - self.value, value  # the steps' rewards sum to the last review's value
        return {"rewards": reward, "scores": value,
                "environment_feedback": "" if done else f" {self.request} ",
                "done": done, "sampling_params": states.get("sampling_params"),
                "extra_logs": {"first_reward": self.first, "tries": self.tries, "accepted": float(accepted)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
