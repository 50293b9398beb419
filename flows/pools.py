"""Stages on their own work pools (issue 26): filled in by the pools work."""
from __future__ import annotations


def check(pools: dict[str, str], flow_name: str) -> None:
    raise NotImplementedError("pools")
