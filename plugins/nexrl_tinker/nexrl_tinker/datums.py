"""Trajectories -> ``tinker.types.Datum``: what a Tinker ``forward_backward`` trains on.

A datum holds one sequence ``prompt + response``. Tinker's alignment is next-token: position
``i`` of ``model_input`` predicts ``target_tokens[i]``, so

- ``model_input = (prompt + response)[:-1]`` and ``target_tokens = (prompt + response)[1:]``
  (both ``N = len(prompt) + len(response) - 1`` long);
- response token ``k`` is ``target_tokens[len(prompt) - 1 + k]``; the first ``len(prompt) - 1``
  targets are prompt tokens and never trained on.

Per-token inputs are ``N`` long, zero on prompt positions:

- ``cross_entropy``: ``weights`` = the response tokens' weights (1 unless given) x ``loss_mask``;
- ``importance_sampling`` / ``ppo``: ``logprobs`` = the rollout's (sampling) logprobs of the
  response tokens, ``advantages`` = the response tokens' advantages x ``loss_mask`` (a masked
  token has no advantage, hence no gradient).

Trajectory keys read by :func:`trajectory_to_datums`: ``prompt_token_ids``, ``response_token_ids``,
``response_logprobs`` (RL losses), ``advantages`` (RL losses: one number for the whole response
or one per response token), ``weights`` (cross-entropy, optional, one per response token),
``loss_mask`` (optional, one 0/1 per response token), and ``segments`` (an agent rollout of
several token sequences: one datum each, see :func:`nexrl_core.trajectory_segments`; per-token
``advantages`` and ``weights`` then run over the response tokens of every sequence, end to end).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from nexrl_core import DataError, trajectory_segments

if TYPE_CHECKING:  # tinker's import takes a second: only a run that uses it pays
    from tinker import types

RL_LOSSES = ("importance_sampling", "ppo")
LOSSES = ("cross_entropy",) + RL_LOSSES


def build_datum(prompt_ids: Sequence[int], response_ids: Sequence[int], loss_fn: str, *,
                sampling_logprobs: Sequence[float] | None = None, advantages: float | Sequence[float] | None = None,
                weights: Sequence[float] | None = None, loss_mask: Sequence[float] | None = None,
                name: str = "trajectory") -> types.Datum:
    """One datum for ``loss_fn`` (see the module doc); DataError naming ``name`` on bad input."""
    if loss_fn not in LOSSES:
        raise DataError(f"{name}: loss function '{loss_fn}' is not one of {', '.join(LOSSES)}")
    prompt, response = _ids(prompt_ids, name, "prompt_token_ids"), _ids(response_ids, name, "response_token_ids")
    if not prompt:
        raise DataError(f"{name}: empty prompt (the first response token needs a position to be predicted from)")
    if not response:
        raise DataError(f"{name}: empty response: nothing to train on")
    r = len(response)
    full = prompt + response
    n = len(full) - 1
    mask = _per_token(loss_mask, r, name, "loss_mask") if loss_mask is not None else np.ones(r, dtype=np.float32)
    inputs: dict[str, Any] = {"target_tokens": np.asarray(full[1:], dtype=np.int64)}
    if loss_fn == "cross_entropy":
        w = _per_token(weights, r, name, "weights") if weights is not None else np.ones(r, dtype=np.float32)
        inputs["weights"] = _place(w * mask, n, r)
    else:
        if sampling_logprobs is None:
            raise DataError(f"{name}: loss '{loss_fn}' needs the rollout's response_logprobs (the sampling "
                            f"logprobs of every response token)")
        if advantages is None:
            raise DataError(f"{name}: loss '{loss_fn}' needs advantages")
        if _is_scalar(advantages):
            scalar = float(cast(float, advantages))
            if not math.isfinite(scalar):
                raise DataError(f"{name}: advantages is not finite ({advantages})")
            adv = np.full(r, scalar, dtype=np.float32)
        else:
            adv = _per_token(advantages, r, name, "advantages")
        inputs["logprobs"] = _place(_per_token(sampling_logprobs, r, name, "response_logprobs"), n, r)
        inputs["advantages"] = _place(adv * mask, n, r)
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def trajectory_to_datums(trajectory: Mapping[str, Any], loss_fn: str) -> list[types.Datum]:
    """One datum per token sequence of ``trajectory`` (:func:`nexrl_core.trajectory_segments`):
    one for a single-turn sample, several for an agent rollout whose turns did not merge into one
    sequence. Each sequence brings its own ``loss_mask`` and log-probs. ``advantages`` (one number,
    or one per response token) and ``weights`` (one per response token) are the trajectory's: a
    per-token list covers the response tokens of every sequence, end to end."""
    name = f"trajectory {trajectory.get('uid')}#{trajectory.get('sample_index', 0)}"
    try:
        segments = trajectory_segments(trajectory)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    for i, seg in enumerate(segments):
        for key in ("prompt_token_ids", "response_token_ids"):
            if seg.get(key) is None:
                where = f"{name} segment {i}" if len(segments) > 1 else name
                raise DataError(f"{where}: no {key}: Tinker training needs the inference backend to return "
                                f"prompt and response token ids")
    lengths = [len(seg["response_token_ids"]) for seg in segments]
    advantages = _split(trajectory.get("advantages"), lengths, name, "advantages")
    weights = _split(trajectory.get("weights"), lengths, name, "weights")
    return [build_datum(seg["prompt_token_ids"], seg["response_token_ids"], loss_fn,
                        sampling_logprobs=seg.get("response_logprobs"), advantages=adv, weights=w,
                        loss_mask=seg.get("loss_mask"), name=f"{name} segment {i}" if len(segments) > 1 else name)
            for i, (seg, adv, w) in enumerate(zip(segments, advantages, weights))]


def _split(values: Any, lengths: list[int], name: str, key: str) -> list[Any]:
    """A trajectory's per-token ``values`` cut into one piece per sequence (a number, or None, goes to
    every sequence whole)."""
    if values is None or _is_scalar(values) or len(lengths) == 1:
        return [values] * len(lengths)
    try:
        flat = list(values)
    except TypeError:
        raise DataError(f"{name}: {key} must be a number or a list of numbers") from None
    if len(flat) != sum(lengths):
        raise DataError(f"{name}: {key} has {len(flat)} values for the {sum(lengths)} response tokens of its "
                        f"{len(lengths)} token sequences (segments)")
    bounds = np.cumsum([0] + lengths)
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def trajectory_to_datum(trajectory: dict[str, Any], loss_fn: str) -> types.Datum:
    """The datum of a single-sequence trajectory (:func:`trajectory_to_datums` for any)."""
    datums = trajectory_to_datums(trajectory, loss_fn)
    if len(datums) > 1:
        raise DataError(f"trajectory {trajectory.get('uid')}#{trajectory.get('sample_index', 0)} has {len(datums)} "
                        f"token sequences (segments): use trajectory_to_datums")
    return datums[0]


def response_values(datum: types.Datum, values: Any, response_length: int) -> np.ndarray:
    """The response tokens' entries of a per-position output (e.g. ``loss_fn_outputs[i]["logprobs"]``)."""
    array = values.to_numpy() if hasattr(values, "to_numpy") else np.asarray(values)
    n = datum.model_input.length
    if array.shape != (n,):
        raise DataError(f"expected {n} per-position values, got shape {list(array.shape)}")
    return array[n - response_length:]


def _place(values: np.ndarray, n: int, r: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float32)
    out[n - r:] = values
    return out


def _ids(values: Sequence[int], name: str, key: str) -> list[int]:
    try:
        ids = [int(v) for v in values]
    except (TypeError, ValueError):
        raise DataError(f"{name}: {key} must be a list of token ids") from None
    if any(v < 0 for v in ids):
        raise DataError(f"{name}: {key} holds a negative token id")
    return ids


def _per_token(values: Any, r: int, name: str, key: str) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise DataError(f"{name}: {key} must be a list of numbers") from None
    if array.shape != (r,):
        raise DataError(f"{name}: {key} has {array.size} values for {r} response tokens")
    if not np.isfinite(array).all():
        raise DataError(f"{name}: {key} holds a non-finite value")
    return array


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
