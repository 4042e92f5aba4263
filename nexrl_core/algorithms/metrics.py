"""How metrics computed on parts of a batch (micro-batches) combine into the batch's metric.

One explicit rule, by the metric's name, so a train service (local or remote) never has to know
which metric is which:

- a name ending in ``_max`` is the maximum of the parts;
- a name ending in ``_min`` is the minimum of the parts;
- any other name is a mean of the parts weighted by their weights (pass each part's share of
  the batch's valid tokens: a token mean then comes out exact).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def reduction(name: str) -> str:
    """``"max"``, ``"min"`` or ``"mean"``: how ``name`` combines across parts."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def aggregate_metrics(parts: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """Combine ``[(weight, metrics), ...]`` of the parts of one batch by :func:`reduction`.

    A weighted mean is normalised by the weights of the parts that report the metric; when those
    weights are all 0 (no valid token anywhere) it is the plain mean.
    """
    values: dict[str, list[tuple[float, float]]] = {}
    for weight, metrics in parts:
        for name, value in metrics.items():
            values.setdefault(name, []).append((float(weight), float(value)))
    out: dict[str, float] = {}
    for name, pairs in values.items():
        rule = reduction(name)
        if rule == "max":
            out[name] = max(v for _, v in pairs)
        elif rule == "min":
            out[name] = min(v for _, v in pairs)
        else:
            total = sum(w for w, _ in pairs)
            out[name] = sum(w * v for w, v in pairs) / total if total > 0 else sum(v for _, v in pairs) / len(pairs)
    return out
