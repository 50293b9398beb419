"""Training methods: each is one module of this package, and rlhf_core.train.entry is generic over them.

A method module defines
    MODEL: "causal_lm" | "reward_model"   what entry.load_model builds (and save_final saves): an LM, or an LM
                                          body with a scalar score head (AutoModelForSequenceClassification)
    step(engine, spec, recs, pad_id) -> (loss, metrics, tokens)
                                          one micro-batch of records: the scalar loss to backpropagate, detached
                                          per-example metrics # (B,) (logged per step, averaged), and the
                                          forward's batches.Tokens (throughput, tokens forwarded)
    summarize(totals, n) -> dict          optional: the final metrics over the training set from each metric
                                          summed over its n records (evaluated after training with step under
                                          no_grad); without it, no final pass runs
    saved_config(final, spec) -> dict     optional: keys written into the saved model's config.json (from the
                                          final metrics and the job spec)
    setup(engine, spec) -> dict           optional: called once after the engine is built; loads what else the
                                          step needs (e.g. kd's frozen teacher) and returns it as keys merged
                                          into the spec that step and summarize's pass receive
    CLASS_MEANS: dict[str, str]           optional: metric -> a 0/1 metric naming its class; the metric is logged
                                          per step as the mean over that class's examples (kto's class rewards)
and the tokenization its stage uses (records are plain dicts: `ids`/`start` (an int, or [a, b) spans: batches.loss_targets),
or `chosen_ids`/`rejected_ids`...;
batches.seq_len orders them). The stage passes method-specific settings in the job spec; the spec's
`method` names the module. A new trainer is one module here plus its stage file.
"""
from __future__ import annotations

import importlib
from types import ModuleType


def get(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise ValueError(f"unknown training method {name!r}: no module rlhf_core/train/methods/{name}.py") from None
