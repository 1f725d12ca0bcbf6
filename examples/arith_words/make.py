"""Write examples/arith_words/arith_words.jsonl: 640 one-turn arithmetic questions in words, seeded.

The same three question shapes as examples/quickstart/arith_qa.jsonl ("What is 15 times 6?"), drawn at
random instead of listed by hand, so a run has hundreds of training rows and a held-out split of 64
(env.dataset.eval_size) that no training step sees:

    level 1: "What is a plus b?" / "What is a minus b?"   a, b in 1..30 (minus: a >= b)
    level 2: "What is a times b?"                         a in 2..25, b in 2..12

Duplicated (a, op, b) are dropped, so held-out questions never appear among the training rows.

    .venv/bin/python examples/arith_words/make.py     # rewrites the file; the same bytes every time
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROWS = 640


def rows(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct questions: {"prompt", "answer", "level"}, in a seeded random order."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        op = rng.choice(["plus", "minus", "times"])
        if op == "times":
            a, b = rng.randint(2, 25), rng.randint(2, 12)
        else:
            a, b = rng.randint(1, 30), rng.randint(1, 30)
            if op == "minus" and a < b:
                a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        answer = {"plus": a + b, "minus": a - b, "times": a * b}[op]
        level = 2 if op == "times" else 1
        out.append({"prompt": f"What is {a} {op} {b}?", "answer": str(answer), "level": level})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("arith_words.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(ROWS)))
    print(f"wrote {ROWS} rows to {path}")
