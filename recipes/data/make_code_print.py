"""Generate the small code task of recipes/multi_domain.yaml: write a Python program that prints
one computed value; graded by nexrl-rewards' code_sandbox on the program's stdout.

    python recipes/data/make_code_print.py      # rewrites code_print_train.jsonl and code_print_val.jsonl

Deterministic (fixed seed). Train and validation share templates but never a question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUFFIX = " Reply with only the code in a ```python block."
WORDS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "orange", "peach", "pear", "plum", "kiwi",
         "river", "stone", "cloud", "tiger", "piano", "robot", "house", "light", "water", "green", "smile", "bread"]


def questions(rng: random.Random) -> list[tuple[str, str]]:
    """(question, expected stdout) pairs, every template with several values."""
    out = []
    for _ in range(12):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        out.append((f"prints the sum of {a} and {b}", str(a + b)))
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        out.append((f"prints the product of {a} and {b}", str(a * b)))
    for word in WORDS:
        out.append((f"prints the word '{word}' in upper case", word.upper()))
        out.append((f"prints the length of the string '{word}'", str(len(word))))
        out.append((f"prints the string '{word}' reversed", word[::-1]))
    for n in range(3, 10):
        out.append((f"prints the numbers from 1 to {n}, separated by spaces", " ".join(map(str, range(1, n + 1)))))
    return list(dict.fromkeys(out))


def row(question: str, expected: str) -> dict:
    return {"prompt": f"Write a Python program that {question}.{SUFFIX}",
            "test_cases": [{"input": "", "output": expected + "\n"}]}


def main() -> None:
    rng = random.Random(20261123)
    pairs = questions(rng)
    rng.shuffle(pairs)
    val, train = pairs[:24], pairs[24:]
    here = Path(__file__).resolve().parent
    for name, part in (("code_print_train.jsonl", train), ("code_print_val.jsonl", val)):
        with open(here / name, "w", encoding="utf-8") as f:
            for q, expected in part:
                f.write(json.dumps(row(q, expected)) + "\n")
    print(f"{len(train)} training and {len(val)} validation questions")


if __name__ == "__main__":
    main()
