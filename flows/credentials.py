"""Credentials of a flow run: a Prefect Secret block loaded into the process environment (never parameters)."""
from __future__ import annotations

import os

from rlhf_core import store


def use_credentials(block_name: str) -> list[str]:
    """Load the Prefect Secret block `block_name` (a JSON object of environment variables) into this process's
    environment, which training jobs and the local Ray cluster inherit; the values are redacted from every
    error from here on. Returns the variable names (never the values)."""
    from prefect.blocks.system import Secret

    try:
        values = Secret.load(block_name).get()
    except ValueError as e:
        raise ValueError(f"credentials_block {block_name!r}: no such Prefect Secret block ({e})") from None
    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
        raise ValueError(f"credentials_block {block_name!r} must hold a JSON object of environment variables, e.g. "
                         '{"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "..."}')
    for k, v in values.items():
        os.environ[k] = v
        if k not in store.SECRET_ENV:
            store.SECRET_ENV.append(k)
    return sorted(values)
