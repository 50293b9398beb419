"""Progress of long work, as log lines on the `rlhf_flows` logger that every consumer parses the same way:

    step 12/40 loss=0.6812 reward_margin=0.0210 tokens=1840 forwarded=1312 tokens/s=10250 eta=31s  (training job)
    progress generate 96/256 rows                                          (Ray engines, per finished chunk)

The training child prints its step lines to stdout (rlhf_core.runtime.jobs forwards them to the logger); in-process
work calls `rows()`. `listeners` (callables taking an Event) see every parsed line: the flows update their
Prefect progress artifact from them. `Display` renders them on a terminal: a bar on a TTY, otherwise one
line every `every_s` seconds.
"""
from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("rlhf_flows")
STEP = re.compile(r"^step (\d+)/(\d+)((?: [\w/]+=\S+)*)\s*$")
ROWS = re.compile(r"^progress (\w+) (\d+)/(\d+) rows$")


@dataclass
class Event:
    what: str  # "train", or the engine method: "generate", "score"
    done: int
    total: int
    unit: str  # "steps" | "rows"
    metrics: dict[str, str] = field(default_factory=dict)


listeners: list[Callable[[Event], None]] = []


def rows(what: str, done: int, total: int) -> None:
    log.info("progress %s %d/%d rows", what, done, total)


def parse(line: str) -> Event | None:
    if m := STEP.match(line):
        metrics = dict(kv.split("=", 1) for kv in m.group(3).split())
        return Event("train", int(m.group(1)), int(m.group(2)), "steps", metrics)
    if m := ROWS.match(line):
        return Event(m.group(1), int(m.group(2)), int(m.group(3)), "rows")
    return None


def eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Dispatch(logging.Handler):
    """On the rlhf_flows logger: every progress line goes to the `listeners`."""

    def emit(self, record: logging.LogRecord) -> None:
        if listeners and (ev := parse(record.getMessage())):
            for fn in list(listeners):
                try:
                    fn(ev)
                except Exception as e:  # a display must never fail the work it displays
                    log.debug("progress listener failed: %s", e)


def install() -> None:
    """Attach the Dispatch handler once (idempotent) and let INFO lines through the logger."""
    if not any(isinstance(h, Dispatch) for h in log.handlers):
        log.addHandler(Dispatch())
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)


class Display:
    """Terminal rendering of Events: a TTY gets one redrawn bar; a pipe or file gets a line at most every
    `every_s` seconds (and the last one). Other `rlhf_flows` lines worth a user's eye (the job's
    "training ...", "checkpoint ...", "done: ..." lines, warnings) are printed as they come; with
    `verbose`, every line."""

    NOTABLE = ("training ", "resumed ", "checkpoint ", "done: ", "generated ", "launching")

    def __init__(self, stream=None, every_s: float = 10.0, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s, self.verbose = every_s, verbose
        self.last_print, self.started, self.open_bar = 0.0, {}, False

    def __call__(self, ev: Event) -> None:
        now = time.time()
        key = (ev.what, ev.total)
        t0 = self.started.setdefault(key, (now, ev.done))
        text = f"{ev.what} {ev.done}/{ev.total} {ev.unit}"
        text += "".join(f" {k}={v}" for k, v in ev.metrics.items())
        if "eta" not in ev.metrics and ev.done > t0[1] and ev.done < ev.total:
            text += f" eta={eta((now - t0[0]) / (ev.done - t0[1]) * (ev.total - ev.done))}"
        if self.tty:
            width = 24
            fill = int(width * ev.done / max(1, ev.total))
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}\033[K")
            self.open_bar = ev.done < ev.total
            if not self.open_bar:
                self.stream.write("\n")
        elif ev.done >= ev.total or now - self.last_print >= self.every_s:
            self.stream.write(text + "\n")
            self.last_print = now
        self.stream.flush()

    def line(self, msg: str, level: int) -> None:
        if parse(msg) is None and (self.verbose or level >= logging.WARNING or msg.startswith(self.NOTABLE)):
            if self.open_bar:
                self.stream.write("\n")
                self.open_bar = False
            self.stream.write(msg + "\n")
            self.stream.flush()

    def handler(self) -> logging.Handler:
        display = self

        class _Lines(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                display.line(record.getMessage(), record.levelno)

        return _Lines()
