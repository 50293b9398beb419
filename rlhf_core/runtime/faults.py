"""Fault injection for tests: slows a job so that a test can kill or pause it mid-run. Not a user setting (it is in no
stage's config, the run form or the settings tables), and a run without the variable below does nothing different.

    RLHF_FLOWS_TEST_STEP_SLEEP=SECONDS   each training step of a trainer job (rlhf_core.train.entry) and of the ppo
                                         loop (rlhf_core.ppo.loop) sleeps this long first

A trainer job gets the value through its spec (written by the stage from the stage's environment, so ranks on other
nodes sleep too); the ppo loop reads it in the stage's process. A test sets it in the environment of what it starts
(a subprocess, a Prefect worker) or with monkeypatch for a stage it runs in-process. docs/testing.md lists it.
"""
from __future__ import annotations

import os
import time

STEP_SLEEP = "RLHF_FLOWS_TEST_STEP_SLEEP"


def step_sleep() -> float:
    """Seconds each step sleeps (0 when the variable is unset or empty); a value that is not a number >= 0 fails
    naming the variable."""
    raw = os.environ.get(STEP_SLEEP, "").strip()
    if not raw:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{STEP_SLEEP}={raw!r}: not a number of seconds") from None
    if not seconds >= 0:  # also refuses nan
        raise ValueError(f"{STEP_SLEEP}={raw!r}: must be >= 0 seconds")
    return seconds


def pause_step(seconds: float | None = None) -> None:
    """Sleep `seconds` (default: step_sleep()) before a step; nothing when it is 0."""
    seconds = step_sleep() if seconds is None else seconds
    if seconds:
        time.sleep(seconds)
