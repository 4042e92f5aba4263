"""Trace -> training data: every LLM call of a run, merged into token sequences with a loss mask.

1. :func:`llm_calls` walks the span tree (ours or NexAU's) and returns one dict per ``LLM`` span
   (the seed's "trajectory infos"): the request's ``prompt_messages`` and ``tools``, the
   ``response_message``, ``finish_reason``, and the token data the inference client returned —
   ``prompt_token_ids``, ``response_token_ids``, ``response_logprobs``. Nothing is re-tokenised.
   Token data is read from ``outputs.nexrl_train`` (NexRL's inference service and our runner),
   else from vLLM's fields (``prompt_token_ids``, ``choices[0].token_ids``, log-probs in
   ``choices[0].logprobs.content``).
2. :func:`token_sequences` lays the calls end to end. A call whose prompt starts with all the
   tokens of an open sequence (the usual multi-turn case: previous prompt + reply + tool
   results) extends it: the new prompt tokens go in with mask 0, the reply with the call's
   mask. A call whose prompt does not (the chat template re-rendered history differently, a
   sub-agent, a compacted context) starts a new sequence.
3. :func:`truncate` cuts a sequence to a maximum length.

Prompt tokens and tokens that came from tools are never trained on; which replies are is the
worker's ``get_train_loss_mask`` (default: all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, TypedDict


class TraceError(ValueError):
    """A trace that cannot become training data (the message names the span and what is missing)."""


def iter_spans(trace: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every span of ``trace``, depth first, children in the order they started."""
    stack = list(reversed(trace or []))
    while stack:
        span = stack.pop()
        if not isinstance(span, dict):
            continue
        yield span
        stack.extend(reversed(span.get("children") or []))


def llm_calls(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per completed ``LLM`` span (a call that failed has no completion and is skipped)."""
    infos: list[dict[str, Any]] = []
    for span in iter_spans(trace):
        if span.get("type") != "LLM" or span.get("error") or not span.get("outputs"):
            continue
        infos.append(_call_info(span, len(infos)))
    return infos


def _call_info(span: dict[str, Any], index: int) -> dict[str, Any]:
    out, inputs = span.get("outputs") or {}, span.get("inputs") or {}
    where = f"LLM call {index} (span {span.get('id')})"
    train, choices = out.get("nexrl_train"), out.get("choices")
    train = train if isinstance(train, dict) else {}
    choices = choices if isinstance(choices, list) else []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    logprob_items = _logprob_items(choice)
    prompt = _first(train.get("prompt_tokens"), out.get("prompt_token_ids"), choice.get("prompt_token_ids"))
    response = _first(train.get("response_tokens"), choice.get("token_ids"),
                      _ids_from_logprob_tokens(logprob_items))
    logprobs = _first(train.get("response_logprobs"),
                      [i.get("logprob") for i in logprob_items] if logprob_items else None)
    if prompt is None or response is None:
        missing = "prompt" if prompt is None else "response"
        raise TraceError(f"{where} has no {missing} token ids: the inference service must return them "
                         f"(nexrl's clients do; a vLLM server needs return_token_ids)")
    prompt, response = _ints(prompt, where, "prompt token ids"), _ints(response, where, "response token ids")
    if logprobs is not None:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in logprobs):
            raise TraceError(f"{where}: response log-probs hold a value that is not a number")
        if len(logprobs) != len(response):
            raise TraceError(f"{where}: {len(response)} response tokens but {len(logprobs)} log-probs")
        logprobs = [float(v) for v in logprobs]
    version = out.get("model_version")
    return {
        "span_id": span.get("id"),
        "prompt_messages": inputs.get("messages", []),
        "tools": inputs.get("tools", []),
        "response_message": choice.get("message", {}),
        "finish_reason": choice.get("finish_reason", ""),
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_logprobs": logprobs,
        "model_version": int(version) if isinstance(version, int) and not isinstance(version, bool) else None,
    }


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _logprob_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [c for c in content if isinstance(c, dict)] if isinstance(content, list) else []


def _ids_from_logprob_tokens(items: list[dict[str, Any]]) -> list[int] | None:
    """vLLM's ``return_tokens_as_token_ids`` writes each token as ``token_id:<N>``."""
    if not items:
        return None
    ids = []
    for item in items:
        token = item.get("token")
        if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
            ids.append(int(token[9:]))
        else:
            return None
    return ids


def _ints(values: Any, where: str, what: str) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in values):
        raise TraceError(f"{where}: {what} are not a list of non-negative integers")
    return list(values)


class SequenceFields(TypedDict):
    """One token sequence as a trajectory (or one of its ``segments``) holds it."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float] | None
    loss_mask: list[int]  # one 0/1 per response token


@dataclass
class TokenSequence:
    """One training sequence: ``tokens[:prompt_length]`` is the first call's prompt."""

    prompt_length: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None  # per token (0.0 where the model did not sample it); None: unknown
    calls: list[int] = field(default_factory=list)  # indices of the LLM calls merged into it
    truncated: bool = False

    def as_trajectory_fields(self) -> SequenceFields:
        """The keys a trainer reads (prompt / response split; ``loss_mask`` per response token)."""
        p = self.prompt_length
        return {"prompt_token_ids": self.tokens[:p], "response_token_ids": self.tokens[p:],
                "response_logprobs": None if self.logprobs is None else self.logprobs[p:],
                "loss_mask": self.loss_mask[p:]}


def call_masks(infos: list[dict[str, Any]], train: list[Any]) -> list[list[int]]:
    """Per-response-token 0/1 masks from ``get_train_loss_mask``'s answer: one entry per call,
    either a bool (the whole reply) or a list with one value per reply token."""
    if not isinstance(train, (list, tuple)) or len(train) != len(infos):
        raise ValueError(f"get_train_loss_mask must return one entry per LLM call ({len(infos)}), "
                         f"got {train!r:.200}")
    masks = []
    for i, (info, entry) in enumerate(zip(infos, train)):
        n = len(info["response_token_ids"])
        if isinstance(entry, (list, tuple)):
            if len(entry) != n:
                raise ValueError(f"get_train_loss_mask: call {i} has {n} response tokens but a mask of {len(entry)}")
            masks.append([1 if v else 0 for v in entry])
        else:
            masks.append([1 if entry else 0] * n)
    return masks


def token_sequences(infos: list[dict[str, Any]], masks: list[list[int]], merge: bool = True) -> list[TokenSequence]:
    """The calls laid into sequences (see the module doc); ``masks`` from :func:`call_masks`."""
    sequences: list[TokenSequence] = []
    for index, (info, mask) in enumerate(zip(infos, masks)):
        prompt, response = info["prompt_token_ids"], info["response_token_ids"]
        lp = info["response_logprobs"]
        target = _extendable(sequences, prompt) if merge else None
        if target is None:
            target = TokenSequence(len(prompt), [], [], [], [])
            new_prompt = prompt
            sequences.append(target)
        else:
            new_prompt = prompt[len(target.tokens):]
        target.tokens += new_prompt + response
        target.loss_mask += [0] * len(new_prompt) + mask
        if target.logprobs is not None and lp is not None:
            target.logprobs += [0.0] * len(new_prompt) + lp
        else:
            target.logprobs = None
        target.calls.append(index)
    return sequences


def _extendable(sequences: list[TokenSequence], prompt: list[int]) -> TokenSequence | None:
    """The most recent sequence whose tokens all start ``prompt``."""
    for seq in reversed(sequences):
        n = len(seq.tokens)
        if n <= len(prompt) and prompt[:n] == seq.tokens:
            return seq
    return None


def truncate(seq: TokenSequence, max_length: int | None) -> TokenSequence:
    """``seq`` cut to ``max_length`` tokens (the prompt is kept whole; a prompt alone longer than
    that leaves no response token)."""
    if max_length is None or len(seq.tokens) <= max_length:
        return seq
    keep = max(max_length, seq.prompt_length)
    return TokenSequence(seq.prompt_length, seq.tokens[:keep], seq.loss_mask[:keep],
                         None if seq.logprobs is None else seq.logprobs[:keep], list(seq.calls), True)
