"""Comparing models' tensors in tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def same_weights(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """The same names holding bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
