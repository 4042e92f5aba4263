"""A data row's field by its key or by a dotted path into nested mappings.

verl's and NexRL 1.x's math rows keep the answer inside a mapping
(``{"reward_model": {"style": "rule", "ground_truth": "72"}, ...}``): the path
``reward_model.ground_truth`` reads it where the rows have it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

VERL_ANSWER = "reward_model.ground_truth"


def field_at(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]`` when the row has that key; else the value a dotted ``key`` names, one mapping
    level per part; None when there is none."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def missing_field(row: Mapping[str, Any], key: str, option: str) -> ValueError:
    """The error for a row without ``key`` (recipe option ``option``); it names the other usual
    place of an answer (verl's path, or a top-level ``answer``) when the row has one there."""
    hint = ""
    for other in (VERL_ANSWER, "answer"):
        if other != key and field_at(row, other) not in (None, ""):
            hint = f"; the row has '{other}': set {option}: {other}"
            break
    return ValueError(f"data item {row.get('uid')!r} has no '{key}' ({option}){hint}")
