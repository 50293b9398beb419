"""A ppo role on a node that cannot reach the store says which role, which host and which model, when the roles
start (rlhf_core.ppo.node_store.local_model runs in each actor's constructor), before any training step."""
from __future__ import annotations

import json
import socket

import pytest

from rlhf_core.ppo import node_store


def test_a_role_whose_node_cannot_reach_the_store_is_named(monkeypatch):
    with socket.socket() as sock:  # a port nobody listens on: the node's route to the store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv(node_store.OPTIONS_ENV, json.dumps({"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}))
    monkeypatch.setenv(node_store.ROLE_ENV, "rollout1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDLEAKCHECK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(RuntimeError) as e:
        node_store.local_model("s3://bucket/models/policy")
    msg = str(e.value)
    assert f"rollout1 on {socket.gethostname()} cannot fetch the model s3://bucket/models/policy from the store" in msg
    assert "very-secret-value" not in msg and "AKIDLEAKCHECK" not in msg
