"""Talking to the Tinker service: credentials, deadlines, retries, and errors that name the request.

The ``tinker`` SDK already retries HTTP 408/409/429/5xx, timeouts and connection errors, for up
to several minutes per request, and polls futures forever. This layer adds what a training run
needs on top:

- a deadline per remote call (``request_timeout``): a call still unanswered by then is
  abandoned and reported, naming the request;
- a few more attempts, with exponential backoff, for calls that are safe to repeat (sampling,
  snapshots for sampling, creating clients, saving and loading checkpoints) when the SDK gives
  up or the service reports a server-side failure; ``forward_backward`` and ``optim_step`` are
  never repeated (gradients would accumulate twice), their failure is reported;
- error messages that never contain the API key.

Credentials: ``api_key`` from the recipe, else the SDK's ``TINKER_API_KEY``; ``base_url`` from
the recipe, else the SDK's ``TINKER_BASE_URL``, else the SDK's default (the hosted service).
The SDK's other credential sources (``TINKER_CREDENTIAL_CMD``, a key stored by
``tinker auth login``) are accepted too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from loguru import logger

from nexrl_core import ConfigError, NexRLError, Settings, demote_library_log, setting

T = TypeVar("T")

ENV_API_KEY = "TINKER_API_KEY"
ENV_BASE_URL = "TINKER_BASE_URL"
ENV_CREDENTIAL_CMD = "TINKER_CREDENTIAL_CMD"


@dataclass(frozen=True, kw_only=True)
class TinkerConnectionSettings(Settings):
    """Keys of every section that reaches the service (service.train_service, service.inference_service)."""

    api_key: str | None = setting(None, f"the Tinker API key (null: ${ENV_API_KEY}, or the SDK's "
                                        f"${ENV_CREDENTIAL_CMD} / stored key); prefer ${{oc.env:{ENV_API_KEY}}} to a "
                                        f"literal", secret=True)
    base_url: str | None = setting(None, f"where the service is (null: ${ENV_BASE_URL}, else the hosted service)")
    request_timeout: float = setting(600.0, "seconds one remote call may take before it is reported", gt=0)
    max_retries: int = setting(3, "extra attempts of calls that are safe to repeat", ge=0)
    retry_backoff: float = setting(1.0, "seconds before the first extra attempt, doubled after each", ge=0)


CONNECTION_OPTIONS = TinkerConnectionSettings.options()


# The SDK logs a WARNING each time the service answers a poll "try again" (a result not ready yet:
# normal while a request waits in the queue); a request that never finishes is reported at its
# deadline instead.
demote_library_log("tinker.lib.api_future_impl", "because of try_again")


class TinkerRequestError(NexRLError):
    """A remote call failed for good. ``request`` names it (operation, model, size)."""

    def __init__(self, request: str, reason: str):
        super().__init__(f"Tinker {request} failed: {reason}")
        self.request = request
        self.reason = reason


@dataclass(frozen=True)
class TinkerConnection:
    """Where the service is and how to reach it. The key is kept out of ``repr`` and messages."""

    base_url: str | None
    api_key: str | None = field(repr=False)  # None: the SDK finds it (credential command, stored key)
    request_timeout: float
    max_retries: int
    retry_backoff: float

    def service_client(self) -> Any:
        import tinker

        return tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)

    def server_capabilities(self) -> Any:
        """What the service says it serves (no session needed: the SDK's REST client)."""
        import tinker

        return tinker.RestClient(base_url=self.base_url, api_key=self.api_key).get_server_capabilities().result()

    def redact(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text

    @property
    def where(self) -> str:
        return self.base_url or "the hosted Tinker service"


def plain_section(section: Mapping[str, Any] | None, path: str) -> dict[str, Any]:
    """A recipe section as a plain dict, interpolations (``${oc.env:TINKER_API_KEY}``) resolved."""
    if section is None:
        return {}
    if hasattr(section, "to_dict"):  # a Section (nexrl_core.config.settings)
        return section.to_dict()
    if hasattr(section, "_get_node"):  # an OmegaConf node
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            return dict(cast(dict[str, Any], OmegaConf.to_container(section, resolve=True)))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
            detail = str(exc).splitlines()[0]
            raise ConfigError(f"{path}{f'.{key}' if key else ''}: {detail}") from None
    return dict(section)


def resolve_connection(section: TinkerConnectionSettings | Mapping[str, Any] | None, path: str) -> TinkerConnection:
    """Connection settings of a recipe section (``service.train_service``...), or of its settings;
    ConfigError if no API key can be found or a key is bad. Reads only the recipe and the
    environment: nothing is contacted."""
    settings = section if isinstance(section, TinkerConnectionSettings) else \
        TinkerConnectionSettings.own(plain_section(section, path), path)
    api_key = settings.api_key or os.environ.get(ENV_API_KEY) or None
    if api_key is not None:
        if not api_key.startswith(("tml-", "eyJ")):
            source = f"{path}.api_key" if settings.api_key else ENV_API_KEY
            raise ConfigError(f"{source}: not a Tinker API key (a key starts with 'tml-')")
    elif not os.environ.get(ENV_CREDENTIAL_CMD) and not _stored_key_exists():
        raise ConfigError(f"{path}.api_key: no Tinker API key: set {path}.api_key (e.g. "
                          f"${{oc.env:{ENV_API_KEY}}}) or the {ENV_API_KEY} environment variable")
    base_url = settings.base_url or os.environ.get(ENV_BASE_URL) or None
    return TinkerConnection(base_url=base_url.rstrip("/") if base_url else None, api_key=api_key,
                            request_timeout=settings.request_timeout, max_retries=settings.max_retries,
                            retry_backoff=settings.retry_backoff)


def _stored_key_exists() -> bool:
    """A default key stored by ``tinker auth login`` (the SDK's own fallback)."""
    try:
        from tinker.lib.credentials import JsonCredentialStore, default_credentials_path

        return JsonCredentialStore(default_credentials_path()).get_default_key() is not None
    except Exception:
        return False


class RemoteCalls:
    """Runs remote calls with the connection's deadline and retry policy."""

    def __init__(self, connection: TinkerConnection):
        self.connection = connection

    def call(self, request: str, submit: Callable[[], Any], *, repeatable: bool) -> Any:
        """``submit()`` returns an SDK future (or a plain value); wait for its result.

        ``repeatable``: the call may be sent again (up to ``max_retries`` more times, backing off
        ``retry_backoff * 2**i`` seconds) when it fails in a way worth retrying.
        """
        attempts = 1 + (self.connection.max_retries if repeatable else 0)
        for attempt in range(attempts):
            deadline = time.monotonic() + self.connection.request_timeout
            try:
                return self.wait(request, self.run(request, submit, deadline), deadline)
            except TinkerRequestError as exc:
                cause = exc.__cause__
                if attempt + 1 >= attempts or not _worth_retrying(cause):
                    raise
                delay = self.connection.retry_backoff * 2 ** attempt
                logger.warning(f"Tinker {request}: {exc.reason}; retrying in {delay:.1f}s "
                               f"(attempt {attempt + 2} of {attempts})")
                time.sleep(delay)
        raise AssertionError("unreachable")

    def run(self, request: str, fn: Callable[[], T], deadline: float | None = None) -> T:
        """Run a blocking SDK call (creating a client contacts the service) under the deadline."""
        deadline = deadline if deadline is not None else time.monotonic() + self.connection.request_timeout
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            done.set()

        # A daemon thread: an SDK call stuck past the deadline must not hold the process at exit.
        threading.Thread(target=target, name=f"tinker-{request.split()[0]}", daemon=True).start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise self._timeout(request)
        if "error" in box:
            raise self._failure(request, box["error"])
        return box["value"]

    def wait(self, request: str, future: Any, deadline: float | None = None) -> Any:
        """The result of an SDK future (an ``APIFuture`` or a concurrent future) by the deadline."""
        if not hasattr(future, "result"):
            return future
        deadline = deadline if deadline is not None else time.monotonic() + self.connection.request_timeout
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            inner = future.future() if hasattr(future, "future") else future
            inner.cancel()  # stop the SDK's polling of an abandoned request
            raise self._timeout(request) from None
        except TinkerRequestError:
            raise
        except Exception as exc:
            raise self._failure(request, exc) from exc

    def _timeout(self, request: str) -> TinkerRequestError:
        return TinkerRequestError(request, f"no result within request_timeout={self.connection.request_timeout:g}s "
                                           f"from {self.connection.where} (the Tinker SDK retries HTTP 429/5xx, "
                                           f"timeouts and connection errors until then)")

    def _failure(self, request: str, exc: BaseException) -> TinkerRequestError:
        error = TinkerRequestError(request, self.connection.redact(_describe(exc)))
        error.__cause__ = exc
        return error


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    message = str(getattr(exc, "message", None) or exc) or type(exc).__name__
    if len(message) > 400:
        message = message[:400] + "..."
    return f"{type(exc).__name__}{f' (HTTP {status})' if status else ''}: {message}"


def _worth_retrying(exc: BaseException | None) -> bool:
    import tinker

    if isinstance(exc, tinker.RequestFailedError):
        return str(exc.category) != "user"
    if isinstance(exc, tinker.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    return isinstance(exc, (tinker.APIConnectionError, ConnectionError))
