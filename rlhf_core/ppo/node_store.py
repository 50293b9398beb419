"""Each node's own copy of what the roles read and write: models fetched from the store into this node's cache,
checkpoint shards and the final model written by the ranks that hold them.

Today: paths are the driver's local paths (a single machine, or a shared disk).
"""
from __future__ import annotations


def actor_env(role: str) -> dict:
    """Environment variables of the Ray actor of `role` ("policy0", "critic1", "reference", "reward", "rollout0"
    ...: placement.bundle_plan's names), beside the placement's own."""
    return {}


def local_model(src: str) -> str:
    """A local folder holding the model `src` names, on this node."""
    return src


def save_checkpoint(learner, root: str, tag: str) -> None:
    learner.engine.save_checkpoint(root, tag=tag)


def load_checkpoint(learner, root: str, tag: str) -> None:
    learner.engine.load_checkpoint(root, tag=tag)


def save_model(learner, out_dir: str) -> None:
    from transformers import AutoTokenizer

    sd = learner._full_state_dict()
    if learner.rank == 0:
        learner.engine.module.save_pretrained(out_dir, state_dict=sd, safe_serialization=True)
        AutoTokenizer.from_pretrained(learner.model_dir).save_pretrained(out_dir)
