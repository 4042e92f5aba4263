"""Write data/train.jsonl and data/val.jsonl: arithmetic word problems with integer answers.

Deterministic (seeded); the two files share no question. Run from anywhere:
``python recipes/agent_calculator/make_data.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MULTIPLY = [
    "A farm has {a} rows of {b} trees. How many trees are there?",
    "Tom has {a} boxes with {b} apples in each box. How many apples does he have?",
    "A school has {a} classes of {b} students. How many students are there?",
    "Anna buys {a} books at {b} dollars each. How much does she pay in dollars?",
    "A train has {a} cars with {b} seats in each car. How many seats does it have?",
]
ADD = [
    "A library has {a} books and gets {b} more. How many books does it have now?",
    "A shop sold {a} cups on Monday and {b} cups on Tuesday. How many cups did it sell in all?",
]
SUBTRACT = [
    "There are {a} birds on a field and {b} fly away. How many birds are left?",
    "A tank holds {a} liters of water and {b} liters are used. How many liters are left?",
]


def problems(rng: random.Random) -> list[dict]:
    seen, rows = set(), []
    while len(rows) < 400:
        kind = rng.choices(["mul", "add", "sub"], weights=[3, 1, 1])[0]
        if kind == "mul":
            a, b = rng.randint(11, 49), rng.randint(11, 49)
            template, answer = rng.choice(MULTIPLY), a * b
        elif kind == "add":
            a, b = rng.randint(101, 899), rng.randint(101, 899)
            template, answer = rng.choice(ADD), a + b
        else:
            a = rng.randint(300, 999)
            b = rng.randint(101, a - 50)
            template, answer = rng.choice(SUBTRACT), a - b
        prompt = template.format(a=a, b=b)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": answer, "data_source": f"word_{kind}"})
    return rows


def main() -> None:
    rows = problems(random.Random(2024))
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train.jsonl", rows[:320]), ("val.jsonl", rows[320:352])):
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)


if __name__ == "__main__":
    main()
