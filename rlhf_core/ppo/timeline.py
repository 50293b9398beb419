"""The memory timeline of a run as it happened (`trace_memory`): what every role held on its device at the start and
the end of each of its calls, and which calls were in flight together, so that each moment's total per GPU can be read
beside the memory plan's (rlhf_core.ppo.plan) and a test can fail where a GPU would run out of memory.

  the roles    `traced(cls)` records, per call of every public method and the constructor: start and end time, the
               role's holdings before and after (its `holdings()`: bytes of device memory read from its tensors,
               rlhf_core.runtime.residency) and, on CUDA, the allocator's peak during the call.
  the driver   `Timeline` records every wait on the roles (placement.Roles.wait): the calls one wait awaits were sent
               together, so they are in flight together from its start until the driver saw each answer; an actor's
               construction is in flight from its placement until the first wait on it ends.
  a moment     one wait, named by what the driver was doing ("setting up", "entering train", "a weight sync", ...). On
               each GPU, every role placed there adds the most it held in any of its calls of the moment (the larger of
               the start and the end; on CUDA the call's own peak), or, without a call in it, what it held after its
               last call before it. Calls of two roles in one moment add up even when one finished before the other
               started: the driver did not wait for the one before sending the other, and on a GPU nothing orders them.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

EPS = 0.0  # clock slack when a call is matched to a moment: none on one host (a driver and its actors share a clock)


def _held(role) -> dict:
    try:
        return {k: int(v) for k, v in role.holdings().items()}
    except AttributeError:  # not set up yet: it holds nothing of its own
        return {}


def _peak_start() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def traced(cls: type) -> type:
    """`cls` whose constructor and public methods record each call (`calls()` returns them): the class Roles places
    when `trace_memory` is set."""

    def wrap(name, fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            before, start = _held(self), time.time()
            _peak_start()
            try:
                return fn(self, *args, **kwargs)
            finally:
                inside = self.__dict__.pop("held_inside", {})  # what the call held only while it ran (a sync's bucket)
                self.__dict__.setdefault("_calls", []).append(
                    {"method": name, "start": start, "end": time.time(), "before": before, "after": _held(self),
                     "inside": inside, "peak": _peak()})
        return call

    def __init__(self, *args, **kwargs):
        start = time.time()
        _peak_start()
        cls.__init__(self, *args, **kwargs)
        self._calls = [{"method": "__init__", "start": start, "end": time.time(), "before": {}, "after": _held(self),
                        "peak": _peak()}]

    methods = {n: wrap(n, getattr(cls, n)) for n in dir(cls)
               if not n.startswith("_") and n not in ("holdings", "calls") and callable(getattr(cls, n))}
    return type(cls.__name__, (cls,), {**methods, "__init__": __init__, "__module__": cls.__module__,
                                       "calls": lambda self: list(self.__dict__.get("_calls", []))})


@dataclass
class Moment:
    """One wait: its name, and per GPU the roles' bytes (role -> {kind: bytes}) and their total."""
    name: str
    start: float
    end: float
    gpus: dict = field(default_factory=dict)  # gpu -> {role: {kind: bytes}}
    calls: dict = field(default_factory=dict)  # role -> the methods it ran in this moment ("__init__": being built)

    def total(self, gpu: int) -> int:
        return sum(sum(h.values()) for h in self.gpus.get(gpu, {}).values())

    def as_dict(self) -> dict:
        return {"moment": self.name, "start": self.start, "end": self.end, "calls": self.calls,
                "gpus": {str(g): {"total": self.total(g), "roles": roles} for g, roles in self.gpus.items()}}


class Timeline:
    """The driver's record: when each role was placed and every wait (name, start, role -> when its answer came). A
    wait starts when the driver's previous one ended: the calls it awaits were sent since."""

    def __init__(self):
        self.placed: dict[str, float] = {}
        self.waits: list[tuple[str, float, dict[str, float]]] = []
        self.since = time.time()

    def place(self, role: str) -> None:
        self.placed[role] = time.time()

    def waited(self, name: str, done: dict[str, float]) -> None:
        self.waits.append((name, self.since, done))
        self.since = time.time()

    @contextmanager
    def span(self, name: str):
        """A moment that is not one wait (the rollout: the engines' generate calls the episodes send): every role's
        calls that ran inside it belong to it."""
        start = time.time()
        try:
            yield
        finally:
            self.waits.append((name, start, {"": time.time()}))
            self.since = time.time()

    def moments(self, calls: dict[str, list[dict]], gpu_of: dict[str, int]) -> list[Moment]:
        """Every wait as a Moment, from the roles' `calls` (role -> its traced calls) and where each role is
        (`gpu_of`: role -> GPU; a role not in it holds no GPU of its own and is left out)."""
        first: dict[str, float] = {}  # role -> the end of the first wait on it (its construction is done by then)
        for _, _, done in self.waits:
            for r, t in done.items():
                first.setdefault(r, t)
        out = []
        for name, start, done in self.waits:
            end = max(done.values(), default=start)
            m = Moment(name, start, end)
            for role, gpu in gpu_of.items():
                held, ran = self._held(role, calls.get(role, []), start, end, done.get(role, done.get("")),
                                       first.get(role))
                if held:
                    m.gpus.setdefault(gpu, {})[role] = held
                if ran:
                    m.calls[role] = ran
            out.append(m)
        return out

    def _held(self, role: str, calls: list[dict], start: float, end: float, done: float | None,
              first: float | None) -> tuple[dict, list[str]]:
        """(what `role` held in the moment, the methods it ran in it)."""
        placed = self.placed.get(role)
        if placed is None or placed > end:
            return {}, []  # not yet placed
        mine = [c for c in calls if done is not None and c["start"] >= start - EPS and c["end"] <= done + EPS
                and c["method"] != "__init__"]
        init = next((c for c in calls if c["method"] == "__init__"), None)
        if init is not None and (first is None or first >= start):  # still being built
            mine.append(init)
        if mine:
            return max((_most(c) for c in mine), key=lambda h: sum(h.values())), [c["method"] for c in mine]
        before = [c for c in calls if c["end"] <= start + EPS]
        return (dict(before[-1]["after"]) if before else {}), []


def _most(call: dict) -> dict:
    """What a call held at most: the larger of its start and end; on CUDA at least its allocator peak (as "peak")."""
    a, b = call["before"], call["after"]
    most = {**(a if sum(a.values()) > sum(b.values()) else b)}
    for k, v in call.get("inside", {}).items():
        most[k] = most.get(k, 0) + v
    if call.get("peak") is not None and call["peak"] > sum(most.values()):
        most["peak"] = call["peak"] - sum(most.values())
    return most
