"""What is a secret, and the one function every output of a run goes through (:func:`scrub`).

A secret is

- the value of a key named like one (``api_key``, ``password``, ``hf_token``...; see
  :func:`is_secret_key`), wherever it sits in a recipe or on the command line;
- the value of an option declared ``Option(..., secret=True)`` (a plugin's key whose name does
  not say so);
- the value of an environment variable named like one (an ``${oc.env:OPENAI_API_KEY}`` lands
  under any key).

The first two are remembered as a recipe is loaded and checked (:func:`add_secret`), before a
run writes anything; every file a run writes (``run.json``, ``config.yaml``, ``run.log``, the
``*.jsonl`` records, checkpoint state, a tracker's config) and every console line replaces
them by ``***``. Torch-free and import-light: :mod:`nexrl_core.config.options` uses it.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

# A key names a secret when it says so (api_key, secret, password, hf_token...). "token" only as the
# last word, so max_tokens / prompt_token_ids stay readable.
_SECRET_KEY = re.compile(r"api[_-]?key|secret|passw(or)?d|credential|authorization|private[_-]?key|"
                         r"access[_-]?key|(^|[_\-.])(auth|bearer|access)?[_-]?token$", re.IGNORECASE)
_NOT_SECRET = re.compile(r"(pad|eos|bos|unk|sep|cls|mask|start|end|stop)_token$", re.IGNORECASE)  # tokenizer's
_MIN_SECRET_LEN = 4  # shorter values would redact innocent substrings
# What OpenAI-compatible servers take for "no key": replacing it everywhere would only confuse.
_PLACEHOLDERS = frozenset({"EMPTY", "none", "None", "null"})
_INTERPOLATION = re.compile(r"\$\{[^${}]+\}")

_known: set[str] = set()
_lock = threading.Lock()


def is_secret_key(key: Any) -> bool:
    return _is_secret_name(str(key))


@functools.lru_cache(maxsize=4096)
def _is_secret_name(key: str) -> bool:  # cached: every log line asks it of every environment variable
    return bool(_SECRET_KEY.search(key)) and not _NOT_SECRET.search(key)


def add_secret(value: Any) -> None:
    """Remember ``value`` (a string) as a secret of this process: every later :func:`scrub` hides it.
    An interpolation (``${oc.env:TINKER_API_KEY}``) names where the secret is, not the secret: it
    stays readable (what it resolves to is remembered when it is resolved)."""
    if isinstance(value, str) and _INTERPOLATION.fullmatch(value.strip()):
        return
    if isinstance(value, str) and len(value) >= _MIN_SECRET_LEN and value not in _PLACEHOLDERS:
        with _lock:
            _known.add(value)


def add_config_secrets(values: Any) -> None:
    """Remember the values of every key named like a secret in ``values`` (plain dicts/lists)."""
    if isinstance(values, Mapping):
        for key, value in values.items():
            if is_secret_key(key):
                add_secret(value)
            add_config_secrets(value)
    elif isinstance(values, (list, tuple)):
        for value in values:
            add_config_secrets(value)


def known_secrets() -> list[str]:
    """Every secret :func:`scrub` hides now, longest first (a key that contains another goes whole).
    The environment is read each time: a variable set during the run counts too."""
    env = [v for k, v in os.environ.items() if _is_secret_name(k) and len(v) >= _MIN_SECRET_LEN
           and v not in _PLACEHOLDERS]
    with _lock:
        values = _known.union(env)
    return sorted(values, key=len, reverse=True)


def scrub(text: str, _secrets: list[str] | None = None) -> str:
    """``text`` with every known secret replaced by ``***``."""
    for secret in known_secrets() if _secrets is None else _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_values(value: Any, _secrets: list[str] | None = None) -> Any:
    """A copy of ``value`` (plain dicts/lists) with every string scrubbed; keys are kept (metric
    names such as ``train/num_token`` are not secrets)."""
    secrets = known_secrets() if _secrets is None else _secrets
    if not secrets:
        return value
    if isinstance(value, Mapping):
        return {k: scrub_values(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_values(v, secrets) for v in value]
    if isinstance(value, str):
        return scrub(value, secrets)
    return value


def redact(value: Any, _secrets: list[str] | None = None) -> Any:
    """A copy of ``value`` (plain dicts/lists) with secrets replaced by ``***``: the value of every
    key named like a secret, and every known secret inside any string."""
    secrets = known_secrets() if _secrets is None else _secrets
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret_key(k) and v not in (None, "") else redact(v, secrets))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        return scrub(value, secrets)
    return value


def redact_override(text: str) -> str:
    """A ``key=value`` command-line override with the value hidden when the key names a secret
    (``+key=``, ``++key=`` too), and every known secret scrubbed."""
    key, sep, _ = text.partition("=")
    if sep and is_secret_key(key.lstrip("+~").rsplit(".", 1)[-1]):
        text = f"{key}={REDACTED}"
    return scrub(text)


def redact_command(argv: list[str]) -> list[str]:
    return [redact_override(str(a)) for a in argv]


class ScrubbedStream:
    """A text stream (a loguru sink) that scrubs what it is given before writing it on; ``stop``
    (called by loguru when the sink is removed) closes a stream it owns."""

    def __init__(self, stream: Any, owned: bool = False):
        self._stream = stream
        self._owned = owned

    def write(self, text: str) -> None:
        self._stream.write(scrub(str(text)))

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty()) if callable(isatty) else False

    def stop(self) -> None:
        if self._owned:
            self._stream.close()
