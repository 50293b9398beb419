"""The demo task: "make the review positive", with a programmatic gold reward.

Prompts ask for a short review of a thing ("Review of the movie:"). A response is a few words from a
small vocabulary of positive, negative and neutral words. The gold reward is
(positive words - negative words) / words, in [-1, 1], so improvement is measurable exactly. The SFT
warm-up data mixes positive and negative words evenly (the warm policy scores about 0); the reward model
learns from pairs labelled by the gold reward; RLHF should push the policy's gold reward up.

Everything is generated from a seed: the project ships the generator, not data.
"""
from __future__ import annotations

import random

POSITIVE = ["great", "good", "excellent", "lovely", "amazing", "wonderful", "nice", "perfect", "fantastic", "superb"]
NEGATIVE = ["bad", "awful", "terrible", "poor", "boring", "horrible", "ugly", "weak", "sad", "broken"]
NEUTRAL = ["the", "was", "and", "very", "really", "it", "a", "quite", "so", "overall"]
THINGS = ["movie", "food", "service", "hotel", "book", "song", "game", "phone", "car", "show", "coffee", "room",
          "park", "museum", "album", "shop", "bus", "train", "pizza", "bread", "tea", "camera", "laptop", "chair"]
INPUT_TEMPLATE = "{} "


def prompt_for(thing: str) -> str:
    return f"Review of the {thing}:"


def gold_reward(response: str) -> float:
    words = [w.strip(".,!") for w in response.lower().split()]
    words = [w for w in words if w]
    if not words:
        return -1.0
    pos = sum(w in POSITIVE for w in words)
    neg = sum(w in NEGATIVE for w in words)
    return (pos - neg) / len(words)


def random_review(rng: random.Random, p_pos: float = 0.25, p_neg: float = 0.25) -> str:
    n = rng.randint(4, 9)
    words = []
    for _ in range(n):
        u = rng.random()
        pool = POSITIVE if u < p_pos else NEGATIVE if u < p_pos + p_neg else NEUTRAL
        words.append(rng.choice(pool))
    return " ".join(words) + " ."


def split_things(seed: int = 0) -> tuple[list[str], list[str]]:
    """Train / held-out split of the things being reviewed (held-out prompts are never trained on)."""
    things = list(THINGS)
    random.Random(seed).shuffle(things)
    return things[:18], things[18:]


def prompts(n: int, seed: int = 0, held_out: bool = False) -> list[dict]:
    """`n` distinct prompt rows ({"input": ...}) over the train (or held-out) things. Distinct texts matter:
    the filters group samples by prompt."""
    train, test = split_things(seed)
    pool = test if held_out else train
    rng = random.Random(seed + (1 if held_out else 2))
    return [{"input": f"#{i} " + prompt_for(rng.choice(pool))} for i in range(n)]


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    """Warm-up rows ({"input", "output"}) with balanced sentiment."""
    train, _ = split_things(seed)
    rng = random.Random(seed + 3)
    return [{"input": prompt_for(rng.choice(train)), "output": random_review(rng)} for _ in range(n)]


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    """Gold-labelled pairs ({"prompt", "chosen", "rejected"}); ties are skipped."""
    train, _ = split_things(seed)
    rng = random.Random(seed + 4)
    rows = []
    while len(rows) < n:
        prompt = prompt_for(rng.choice(train))
        a, b = random_review(rng), random_review(rng)
        ra, rb = gold_reward(a), gold_reward(b)
        if ra == rb:
            continue
        chosen, rejected = (a, b) if ra > rb else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def corpus(seed: int = 0) -> list[str]:
    """Text the tiny tokenizer is trained on: every word and prompt of the task, plus chat markup."""
    rng = random.Random(seed + 5)
    lines = [prompt_for(t) for t in THINGS]
    lines += [random_review(rng) for _ in range(400)]
    lines += [" ".join(POSITIVE + NEGATIVE + NEUTRAL + THINGS)]
    lines += ["User: Assistant: <|user|> <|assistant|> <|system|> <rm_score>: 0.12 -0.5 1.00 3 4 5 6 7 8 9"]
    return lines


def reward_func(queries: list[str], prompts: list[str], labels: list[str | None]):
    """OpenRLHF's custom reward contract (`--remote_rm_url path/to/file.py`), on the gold reward: the
    response is the query with its prompt removed."""
    import torch

    responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor([gold_reward(r) for r in responses], dtype=torch.float32)}


# ---------------------------------------------------------------------------------------------- step labels (PRM)
PLACEHOLDER, REWARD_TOKENS = "ки", ["+", "-"]  # Math-Shepherd's step tag and labels (OpenRLHF train_prm's example)


def step_rows(n: int, seed: int = 0, held_out: bool = False) -> list[dict]:
    """Step-labelled rows in Math-Shepherd's shape for a process reward model: {"input": a prompt and 2-4
    review steps, each ending in " ки", "value": one of "+" / "-" per step}. A step is 2-4 words, one of them
    a positive or a negative word, the rest neutral; its label is "+" iff its gold reward is positive. Held-out
    rows use the held-out things and another seed."""
    train, test = split_things(seed)
    rng = random.Random(seed + (7 if held_out else 6))
    rows = []
    for _ in range(n):
        steps, labels = [], []
        for _ in range(rng.randint(2, 4)):
            good = rng.random() < 0.5
            words = [rng.choice(NEUTRAL) for _ in range(rng.randint(1, 3))]
            words.insert(rng.randint(0, len(words)), rng.choice(POSITIVE if good else NEGATIVE))
            steps.append(" ".join(words) + f" {PLACEHOLDER}")
            labels.append(REWARD_TOKENS[0] if gold_reward(" ".join(words)) > 0 else REWARD_TOKENS[1])
        rows.append({"input": prompt_for(rng.choice(test if held_out else train)) + " " + "\n".join(steps), "value": labels})
    return rows
