"""In-process generation engine shared by the rollout-worker threads of one process.

Callers block in :meth:`HFInferenceEngine.complete` on their own event while one scheduler
thread gathers every queued request (up to ``max_batch_size``, waiting ``batch_wait_ms`` for
late-comers), left-pads them and decodes them together with a KV cache: through
:mod:`nexrl_torch.rollout.decoding`'s fast loop for Llama-family models, through the model's own forward
otherwise. Rows leave the batch as soon as they finish.

Conventions of the returned :class:`CompletionResult`:

- Sampling applies ``temperature``, then ``top_k`` (the k most likely tokens), then ``top_p``
  (the smallest set of the remaining tokens, renormalised, whose mass reaches ``top_p``): the
  order of vLLM and transformers. ``temperature`` 0 is greedy (argmax).
- ``response_logprobs[i]`` is ``log_softmax(logits / temperature)[token_i]`` over the **full
  vocabulary** at the request's temperature, even when ``top_k``/``top_p`` truncated the sampling
  distribution; temperature 1 for greedy requests
  (:attr:`~nexrl_core.runtime.inference.SamplingParams.logprob_temperature`). This is exactly what
  :func:`nexrl_torch.logprobs.compute_response_logprobs` computes at the temperature each
  trajectory carries, so rollout and trainer log-probs differ only by numerics (the trainer
  logs that mismatch every step).
- Finished on an EOS token: ``finish_reason="stop"``; the EOS id is the last response token
  (the trainer then learns to stop); ``text`` omits it.
- Finished on a stop string: ``finish_reason="stop"``; ``text`` ends right before the earliest
  stop string; ``response_token_ids`` is the shortest prefix of the generated tokens whose
  decoded text covers ``text``: tokens that decode only to the stop string are dropped, a token
  straddling the boundary is kept (its text may run into the stop string). A stop string at
  the very start leaves no response token.
- Hit ``max_tokens`` (or the model's context size): ``finish_reason="length"``.
- ``model_version`` is the weight version the whole batch was generated with.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nexrl_core import (
    CompletionResult,
    InferenceClient,
    InferenceError,
    SamplingParams,
    as_text_messages,
    parse_tool_calls,
)

from ..cpu_threads import (
    computing,
    current_share,
    end_share,
    follow_share,
    release_idle_workers,
    start_share,
    use_threads,
)
from ..logprobs import compute_response_logprobs, position_ids_from_mask, scoring_batch
from ..models import log_auto_device, model_from_config, own_settings, resolve_device
from .decoding import kv_budget_tokens, kv_token_bytes, make_session_factory
from .settings import EngineSettings

_STOP = object()
_WAKE = object()  # wakes the idle scheduler: weights handed over to take (push_weights)


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None  # None: greedy
    generator: torch.Generator | None  # on the CPU: the request's own stream of uniforms
    max_new_tokens: int
    event: threading.Event = field(default_factory=threading.Event)
    result: CompletionResult | None = None
    error: BaseException | None = None


@dataclass
class _Update:
    """Weights handed to the running batch (``load_weights(..., in_flight=True)``), or to the engine's
    own thread (:meth:`HFInferenceEngine.push_weights`; ``in_flight`` False: taken between batches)."""

    state_dict: Mapping[str, torch.Tensor]
    version: int
    recompute_prefix: bool
    in_flight: bool = True
    release: Callable[[], None] | None = None  # the pusher's tensors are read: its trainer may step on
    after_apply: Callable[[], None] | None = None  # the weights in, before any token is sampled under them
    on_done: Callable[[BaseException | None], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class HFInferenceEngine(InferenceClient):
    """Batched generation with a transformers causal LM, safe to call from many threads.

    Config keys: :class:`~nexrl_torch.rollout.settings.EngineSettings` (the model's and the engine's
    own, each with its default and meaning; docs/recipe.md lists them under ``service.inference_service``).
    ``model``/``tokenizer`` keyword arguments share an already-built pair.

    Sampling draws each row's uniforms from its request's seed, never from a shared stream: on the
    CPU from a ``torch.Generator`` per request, on a GPU from a counter-based hash of (seed, token
    index) computed for the whole batch at once (a generator per row would cost a kernel launch per
    row and token).
    """

    SETTINGS = EngineSettings

    def __init__(self, config: Mapping[str, Any] | None = None, *, model: torch.nn.Module | None = None,
                 tokenizer: Any = None):
        super().__init__(config if config is not None else {})
        # Its keys are read once, into the attributes below (a subclass keeps `self.settings` for its own).
        settings = own_settings(EngineSettings, self.config)
        self.device = resolve_device(settings.device)
        log_auto_device("inference engine", settings.device, self.device)
        model, tokenizer = model_from_config("HFInferenceEngine", settings, model, tokenizer, self.device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = settings.max_batch_size
        self.batch_wait_s = settings.batch_wait_ms / 1000.0
        self.batch_wait_max_s = settings.batch_wait_max_ms / 1000.0
        self.use_chat_template = settings.chat_template
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self._seed_rng = random.Random(settings.seed)
        self._tool_support: tuple[bool, bool] | None = None
        # Where each row's uniforms come from (see the class doc); a test may switch a CPU engine over.
        self.counter_rng = self.device.type != "cpu"
        self.kv_tokens = self._kv_budget(settings)
        threads = settings.decode_threads
        self._decode_threads_auto = threads == "auto"
        self._decode_threads: int | None = None if threads is None or threads == "auto" else int(threads)
        self._threads_before_share: int | None = None  # torch's default before share_cpus_with_trainer
        self._lend_idle_threads = settings.lend_idle_threads
        self.decoder = make_session_factory(self.model, settings.fast_path,
                                            rows_hint=min(self.max_batch_size, 16), kv_tokens=self.kv_tokens,
                                            graphs=settings.cuda_graphs, release=settings.release_kv_cache,
                                            cpu_kernels=settings.cpu_kernels, static_cache=settings.static_cache)

        self._queue: queue.Queue = queue.Queue()
        # Generation batches and weight loads take turns; re-entrant: a push's after_apply scores on the engine's thread.
        self._model_lock = threading.RLock()
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe under concurrent use
        self._submit_lock = threading.Lock()  # makes "check open + enqueue" atomic against close()
        self._update: _Update | None = None  # weights the running batch takes at its next decode step
        self._update_lock = threading.Lock()
        self._failed_update: BaseException | None = None  # weights that did not go in: nothing is served after
        self._open = True
        self._arriving = 0  # callers inside complete() that have not queued their request yet
        self.num_batches = 0  # scheduler counters, for monitoring and benchmarks
        self.num_requests = 0
        self._thread = threading.Thread(target=self._loop, name="hf-inference-engine", daemon=True)
        self._thread.start()
        release_idle_workers()  # the thread that loaded the model computes no more here

    def share_cpus_with_trainer(self) -> int | None:
        """A trainer computes in this process while the engine decodes (weight.rollouts_ahead): with
        ``decode_threads: auto`` on the CPU, the engine's thread takes half the torch threads (at least
        1) and torch's default, which the trainer's thread starts with, becomes the rest, so the two
        teams together hold no more threads than the process had; with ``lend_idle_threads`` a side
        computing nothing lends the other its part (:class:`~nexrl_torch.cpu_threads.ThreadShare`).
        Returns the engine's count (None: unchanged: another device, or a count set by hand)."""
        if not self._decode_threads_auto or self.device.type != "cpu":
            return None
        total = self._threads_before_share = torch.get_num_threads()
        engine = max(1, total // 2)
        torch.set_num_threads(max(1, total - engine))  # this thread's and every later thread's default
        self._decode_threads = engine
        if total > 1:
            start_share(total, engine, self._lend_idle_threads)
        from loguru import logger

        lend = " (a side computing nothing lends the other its threads: lend_idle_threads)" \
            if total > 1 and self._lend_idle_threads else ""
        logger.info(f"inference engine: decodes on {engine} of {total} CPU threads while the trainer steps "
                    f"beside it on {max(1, total - engine)}{lend} (service.inference_service.decode_threads: auto)")
        return engine

    def _use_decode_threads(self) -> None:
        """On the engine's thread: run on ``decode_threads`` when that is set (or was set since).
        Checked every batch: pausing a thread's OpenMP team (cpu_threads) gives it back the
        runtime's default count."""
        if self._threads_before_share is not None and current_share() is not None:
            follow_share("engine")
            return
        wanted = self._decode_threads
        if wanted is not None and self.device.type == "cpu" and torch.get_num_threads() != wanted:
            use_threads(wanted)

    def _kv_budget(self, settings: EngineSettings) -> int | None:
        """Tokens of KV cache a batch may hold: ``max_kv_tokens``, else on a GPU its
        ``gpu_memory_utilization`` share less the weights and the decode workspace (the logits and
        the sampler's float64 CDF of ``max_batch_size`` rows); unbounded on the CPU."""
        if settings.max_kv_tokens:
            return settings.max_kv_tokens
        if self.device.type != "cuda":
            return None
        fraction = settings.gpu_memory_utilization
        total = torch.cuda.get_device_properties(self.device).total_memory
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        workspace = self.max_batch_size * self.model.config.vocab_size * 32
        tokens = kv_budget_tokens(total, fraction, weights, workspace, kv_token_bytes(self.model))
        gib = float(1 << 30)
        if tokens < 1:
            raise ValueError(f"gpu_memory_utilization: {fraction} of {total / gib:.1f} GiB leaves room for {tokens} "
                             f"tokens of KV cache after the engine's weights ({weights / gib:.2f} GiB) and decode "
                             f"workspace ({workspace / gib:.2f} GiB): raise it, or lower max_batch_size")
        from loguru import logger

        logger.info(f"inference engine: KV-cache budget of {tokens} tokens ({tokens * kv_token_bytes(self.model) / gib:.2f} "
                    f"GiB, gpu_memory_utilization {fraction} of {total / gib:.1f} GiB on {self.device}); a batch "
                    f"takes what it needs")
        return tokens

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ client API

    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        return self._submit(params, lambda: self.encode_prompt(prompt))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        """A chat reply offered ``tools``: through the chat template's ``tools=`` when the template
        uses them, else described in the system message; the reply's calls are read from its text
        (``<tool_call>`` blocks, :func:`nexrl_core.parse_tool_calls`). ``text`` stays as the model
        wrote it, so the reply put back into the history renders to the tokens it was sampled as."""
        if not tools and not any(m.get("tool_calls") for m in messages):
            return self.complete(messages, params)  # the single-turn path, unchanged
        result = self._submit(params, lambda: self.encode_chat(messages, tools))
        if tools:
            result.tool_calls = parse_tool_calls(result.text)[1] or None
        return result

    def _submit(self, params: SamplingParams, encode: Any) -> CompletionResult:
        """Queue one request (its prompt ids from ``encode()``) and wait for its result."""
        params.check()
        with self._submit_lock:
            self._arriving += 1  # the scheduler waits for callers that are still tokenizing
        try:
            prompt_ids = encode()
            room = self.max_positions - len(prompt_ids)
            if room < 1:
                raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_positions}")
            seed = generator = None
            if params.temperature > 0:
                seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
                if not self.counter_rng:
                    generator = torch.Generator().manual_seed(seed)
            request = _Request(prompt_ids, params, seed, generator, min(params.max_tokens, room))
        except BaseException:
            with self._submit_lock:
                self._arriving -= 1
            raise
        with self._submit_lock:
            self._arriving -= 1
            if not self._open:
                raise InferenceError("HFInferenceEngine is closed")
            self._queue.put(request)
        request.event.wait()
        if request.error is not None:
            # A fresh exception per caller: the batch's error object is shared between threads.
            raise InferenceError(str(request.error)) from request.error.__cause__
        if request.result is None:  # the scheduler died mid-batch (e.g. interpreter shutdown)
            raise InferenceError("generation was interrupted")
        return request.result

    def encode_prompt(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """Token ids the engine feeds the model for ``prompt``."""
        with self._tokenizer_lock:
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt).input_ids)
            if self.use_chat_template:
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            else:
                text = "\n".join(str(m.get("content", "")) for m in prompt)
            # The template already holds every special token it wants.
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of a chat prompt with tools and tool calls (see :meth:`chat`)."""
        takes_tools, renders_calls = self.template_tool_support()
        native = takes_tools and self.use_chat_template
        prepared = as_text_messages(messages, None if native else tools, renders_calls and self.use_chat_template)
        with self._tokenizer_lock:
            if not self.use_chat_template:
                text = "\n".join(str(m.get("content", "")) for m in prepared)
            else:
                text = self.tokenizer.apply_chat_template(prepared, tools=tools if native else None,
                                                          add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def template_tool_support(self) -> tuple[bool, bool]:
        """Whether the chat template renders ``tools`` and assistant ``tool_calls`` (probed once)."""
        if self._tool_support is None:
            probe = "nexrl_probe_function"
            tool = {"type": "function", "function": {"name": probe, "description": "probe",
                                                     "parameters": {"type": "object", "properties": {}}}}
            user = [{"role": "user", "content": "hi"}]
            call = {"role": "assistant", "content": "",
                    "tool_calls": [{"id": "c0", "type": "function", "function": {"name": probe, "arguments": {}}}]}
            with self._tokenizer_lock:
                self._tool_support = (self._renders(user, [tool], probe), self._renders(user + [call], None, probe))
        return self._tool_support

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """Log-probs of the given response tokens (no generation), ``max_batch_size`` rows per
        forward, laid out as the trainer lays out a batch (prompts left-padded, responses
        right-padded) and computed by the trainer's own function, so a reference served here
        equals one held in the trainer's process to float tolerance."""
        out: list[list[float]] = []
        for start in range(0, len(requests), self.max_batch_size):
            chunk = requests[start:start + self.max_batch_size]
            batch = {k: v.to(self.device) for k, v in scoring_batch(chunk, self.pad_token_id).items()}
            with self._model_lock, torch.no_grad():
                lp = compute_response_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                               batch["position_ids"], batch["responses"].shape[1],
                                               batch["temperature"]).cpu()
            out += [lp[row, :len(r)].tolist() for row, (_, r, _) in enumerate(chunk)]
        return out

    def _renders(self, messages: list[dict[str, Any]], tools: Any, marker: str) -> bool:
        try:
            return marker in self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that rejects the probe has no such support
            return False

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, in_flight: bool = False,
                     recompute_prefix: bool = False) -> None:
        """Copy ``state_dict`` (all or some of the model's tensors) into the engine's model.

        Waits for the running batch to finish; batches started afterwards use the new weights
        and report ``version``. The tensors are read once, in order (a sharded trainer's are
        gathered one by one as they are read).

        ``in_flight`` (``weight.partial_rollout``): the running batch takes them at its next decode
        step instead, each request going on from the tokens it has (its later tokens are
        ``version``'s: ``CompletionResult.token_versions``); the prefix's KV cache is kept, or
        computed again under the new weights with ``recompute_prefix``. Returns once they are in.
        """
        self.check_weights(state_dict)
        self._wait_pending()  # a push not taken yet goes in first: pushes stay in order
        if not in_flight:
            with self._model_lock, computing("trainer"):  # the caller's thread copies (the trainer's, beside it)
                self._apply(state_dict, version)
            release_idle_workers()  # the caller (the trainer's thread) goes back to its own work
            return
        update = _Update(state_dict, version, recompute_prefix)
        self._hand_over(update)
        while not update.done.wait(0.005):
            if self._model_lock.acquire(blocking=False):  # no batch running: take them here
                try:
                    if self._take_update() is update:
                        with computing("trainer"):
                            self._install(update)
                finally:
                    self._model_lock.release()
        if update.error is not None:
            raise update.error
        release_idle_workers()

    def push_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, in_flight: bool = False,
                     recompute_prefix: bool = False, after_apply: Callable[[], None] | None = None,
                     on_done: Callable[[BaseException | None], None] | None = None) -> bool:
        """:meth:`load_weights` without waiting: the engine's own thread copies the tensors, at the
        running batch's next decode step (``in_flight``), else before its next batch, or at once when
        idle, and calls ``after_apply`` there (the weights in, no token sampled under them yet: an
        exception from it fails the push) and ``on_done(error)`` once done. The tensors must stay as
        they are until read: ``state_dict.hold()`` (:class:`~nexrl_torch.train.service.HeldWeights`)
        keeps them so, released once copied. A mapping without ``hold`` is loaded here, waiting, as
        :meth:`load_weights` does (then ``after_apply`` and ``on_done`` run here too). Returns whether
        the engine took them off the caller's thread. After a failed push the engine serves nothing
        (requests fail): its weights are no version's."""
        hold = getattr(state_dict, "hold", None)
        if not callable(hold):
            self._push_here(state_dict, version, in_flight, recompute_prefix, after_apply, on_done)
            return False
        self.check_weights(state_dict)
        update = _Update(state_dict, version, recompute_prefix, in_flight=in_flight, release=hold(),
                         after_apply=after_apply, on_done=on_done)
        self._hand_over(update)
        with self._submit_lock:
            if not self._open:
                self._drop_update(InferenceError("HFInferenceEngine is closed"))
            else:
                self._queue.put(_WAKE)  # an idle scheduler takes them now
        return True

    def _push_here(self, state_dict: Mapping[str, torch.Tensor], version: int, in_flight: bool,
                   recompute_prefix: bool, after_apply: Callable[[], None] | None,
                   on_done: Callable[[BaseException | None], None] | None) -> None:
        """:meth:`push_weights` on the caller's thread, waiting as :meth:`load_weights` does."""
        error: BaseException | None = None
        try:
            self.load_weights(state_dict, version, in_flight, recompute_prefix)
            if after_apply is not None:
                after_apply()
        except BaseException as exc:
            error = exc
            raise
        finally:
            if on_done is not None:
                on_done(error)

    def _wait_pending(self) -> None:
        while (pending := self._update) is not None and self.health_check():
            pending.done.wait(0.005)

    def _hand_over(self, update: _Update) -> None:
        """``update`` is the one the engine takes next (a push not yet taken is waited for first: pushes stay in order)."""
        while True:
            with self._update_lock:
                pending = self._update
                if pending is None:
                    self._update = update
                    return
            pending.done.wait(0.005)

    def _apply(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights into the model (the model lock held) and the packed copies the decoder reads."""
        copy_weights(state_dict, [self])
        self.set_model_version(version)
        self.decoder.refresh()

    def _install(self, update: _Update) -> None:
        """``update`` into the model (the model lock held); its pusher hears how it went. A failure
        leaves the engine serving nothing (its weights are half copied, or failed the check)."""
        try:
            try:
                copy_weights(update.state_dict, [self])
            finally:
                if update.release is not None:
                    update.release()  # read: the trainer may step on while the decoder repacks
            self.set_model_version(update.version)
            self.decoder.refresh()
            if update.after_apply is not None:
                update.after_apply()
        except BaseException as exc:
            update.error = exc
            self._failed_update = exc
            raise
        finally:
            update.done.set()
            if update.on_done is not None:
                update.on_done(update.error)

    def _take_update(self, in_flight_only: bool = False) -> _Update | None:
        with self._update_lock:
            update = self._update
            if update is None or (in_flight_only and not update.in_flight):
                return None
            self._update = None
        return update

    def _take_pending(self) -> None:
        """On the scheduler's thread: weights pushed and not taken yet go in now (the model lock held)."""
        update = self._take_update() if self._update is not None else None
        if update is not None:
            with computing("engine"):
                self._use_decode_threads()
                self._install(update)

    def _drop_update(self, error: BaseException) -> None:
        """A push the engine will never take (it closed): its pusher hears ``error``."""
        update = self._take_update()
        if update is None:
            return
        update.error = error
        if update.release is not None:
            update.release()
        update.done.set()
        if update.on_done is not None:
            update.on_done(error)

    def check_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Names and shapes of ``state_dict`` against the model's (read without touching the tensors)."""
        own = self.model.state_dict()
        shapes = getattr(state_dict, "shapes", None) or {k: tuple(v.shape) for k, v in state_dict.items()}
        unknown = sorted(set(shapes) - set(own))
        if unknown:
            raise ValueError(f"load_weights: unknown parameter names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, shape in shapes.items():
            if tuple(shape) != tuple(own[name].shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(shape)}, expected {tuple(own[name].shape)}")

    def health_check(self) -> bool:
        return self._open and self._thread.is_alive() and self._failed_update is None

    def close(self) -> None:
        """Stop the scheduler: the batch being generated finishes, requests not started yet fail with InferenceError."""
        with self._submit_lock:
            if not self._open:
                return
            self._open = False
            self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._drop_update(InferenceError("HFInferenceEngine is closed"))
        if self._threads_before_share is not None:  # the process gets its threads back (a later run in it)
            end_share()
            torch.set_num_threads(self._threads_before_share)
            self._threads_before_share = None

    # ------------------------------------------------------------------ scheduler

    def _loop(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if not self._open:
                    self._fail(batch, InferenceError("HFInferenceEngine is closed"))
                    break
                if batch:
                    self._run_batch(batch)
                else:  # woken for pushed weights
                    try:
                        with self._model_lock:
                            self._take_pending()
                    except Exception:  # noqa: BLE001 - its pusher has the error; later batches fail with it
                        pass
                if self._queue.empty() and not self._arriving:
                    with self._model_lock:
                        self.decoder.release()  # idle: the trainer may use that memory
                    release_idle_workers()  # and its CPUs, at full speed
        finally:
            # However the loop ended, nobody may stay blocked on a request that will never run.
            with self._submit_lock:
                self._open = False
            self._drop_update(InferenceError("HFInferenceEngine is closed"))
            leftovers = []
            while True:
                try:
                    leftovers.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._fail(leftovers, InferenceError("HFInferenceEngine is closed"))

    def _next_batch(self) -> list[_Request]:
        """Block for one request, then take more until none has arrived for ``batch_wait_ms``
        and no caller is still inside :meth:`complete` preparing one, for at most
        ``batch_wait_max_ms``. Rollout workers submit one after another (each tokenizes its prompt
        first); a batch cut short would run the late-comers as a second, serial batch."""
        batch = [self._queue.get()]
        if batch[0] is _WAKE:
            return []
        start = time.monotonic()
        deadline, cap = start + self.batch_wait_s, start + max(self.batch_wait_max_s, self.batch_wait_s)
        while len(batch) < self.max_batch_size and batch[-1] is not _STOP:
            now = time.monotonic()
            end = min(cap, deadline) if self._arriving == 0 else cap
            if now >= end:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except queue.Empty:
                    break
            try:  # while callers are arriving, wait in short slices and re-check
                batch.append(self._queue.get(timeout=min(end - now, 0.001) if self._arriving else end - now))
            except queue.Empty:
                continue
            deadline = time.monotonic() + self.batch_wait_s  # each arrival extends the wait
        return [r for r in batch if r is not _STOP and r is not _WAKE]

    @staticmethod
    def _fail(requests: list, error: InferenceError) -> None:
        for request in requests:
            if request is not _STOP and request is not _WAKE:
                request.error = error
                request.event.set()

    def _run_batch(self, batch: list[_Request]) -> None:
        # Longest prompts first, a prompt's samples together: the fast path attends per run of rows
        # with the same padding, and a request's numbers never depend on its neighbours anyway.
        batch = sorted(batch, key=lambda r: (-len(r.prompt_ids), r.prompt_ids))
        self.num_batches += 1
        self.num_requests += len(batch)
        try:
            with self._model_lock, computing("engine"):
                self._use_decode_threads()
                self._take_pending()  # weights pushed since the last batch: this one samples under them
                if self._failed_update is not None:
                    raise RuntimeError(f"the engine serves no weights since a push failed: {self._failed_update}")
                outputs = [out for chunk in self._chunks(batch) for out in self._generate(chunk)]
            for request, (text, reason, ids, logprobs, versions) in zip(batch, outputs):
                mixed = len(set(versions)) > 1
                request.result = CompletionResult(
                    text=text,
                    finish_reason=reason,
                    prompt_token_ids=request.prompt_ids,
                    response_token_ids=ids,
                    response_logprobs=logprobs,
                    model_version=versions[0] if versions else InferenceClient.model_version(self),
                    token_versions=list(versions) if mixed else None,
                )
        except Exception as exc:  # delivered to every caller of the batch, the engine keeps serving
            if isinstance(exc, torch.OutOfMemoryError):
                self.decoder.release()
                exc = MemoryError(f"out of memory on {self.device} decoding {len(batch)} requests: lower "
                                  f"service.inference_service.max_batch_size ({self.max_batch_size}) or "
                                  f"gpu_memory_utilization / max_kv_tokens, or the trainer's "
                                  f"service.train_service.micro_batch_size")
            error = InferenceError(f"generation failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            for request in batch:
                request.error = error
        finally:
            for request in batch:
                request.event.set()

    def _chunks(self, batch: list[_Request]) -> list[list[_Request]]:
        """The batch cut, in order, into runs whose KV cache fits ``kv_tokens`` (one chunk when unbounded)."""
        if self.kv_tokens is None:
            return [batch]
        chunks: list[list[_Request]] = []
        for request in batch:
            chunk = chunks[-1] if chunks else None
            if chunk is not None:
                width = max(len(chunk[0].prompt_ids), len(request.prompt_ids))
                new = max(max(r.max_new_tokens for r in chunk), request.max_new_tokens)
                if self.decoder.footprint(len(chunk) + 1, width + new) <= self.kv_tokens:
                    chunk.append(request)
                    continue
            if self.decoder.footprint(1, len(request.prompt_ids) + request.max_new_tokens) > self.kv_tokens:
                raise MemoryError(f"one request needs {len(request.prompt_ids) + request.max_new_tokens} tokens of KV "
                                  f"cache; the engine holds {self.kv_tokens}: raise service.inference_service."
                                  f"gpu_memory_utilization or max_kv_tokens, or lower the sampling max_tokens")
            chunks.append([request])
        return chunks

    @torch.inference_mode()
    def _generate(self, batch: list[_Request]) -> list[tuple[str, str, list[int], list[float], list[int]]]:
        """Decode ``batch``; per request its text, finish reason, token ids, log-probs and the weight
        version that sampled each token (an in-flight update changes it mid-batch)."""
        device = self.device
        version = InferenceClient.model_version(self)  # this engine's own, replicated or not
        n = len(batch)
        # Identical prompts (a GRPO group's samples) are prefilled once and share their KV cache.
        distinct: dict[tuple[int, ...], int] = {}
        row_prompt = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in batch]
        prompts = list(distinct)
        width = max(len(p) for p in prompts)
        input_ids, attention_mask, position_ids = self._left_padded(prompts)

        temps = torch.tensor([r.params.temperature for r in batch], dtype=torch.float32, device=device)
        greedy = temps == 0
        scale = torch.where(greedy, torch.ones_like(temps), temps)
        top_p = torch.tensor([r.params.top_p for r in batch], dtype=torch.float32, device=device)
        top_k = torch.tensor([max(r.params.top_k, 0) for r in batch], dtype=torch.long, device=device)

        tokens_out: list[list[int]] = [[] for _ in batch]
        logprobs_out: list[list[float]] = [[] for _ in batch]
        versions_out: list[list[int]] = [[] for _ in batch]
        finish: list[str] = ["length"] * n
        active = list(range(n))  # batch index of each row still being decoded

        capacity = width + max(r.max_new_tokens for r in batch)
        session = self.decoder(tokens=self.decoder.footprint(n, capacity))
        logits = session.prefill(input_ids, attention_mask, position_ids, capacity=capacity)
        next_pos = position_ids[:, -1] + 1
        if len(prompts) < n:
            idx = torch.tensor(row_prompt, device=device)
            session.select(idx)
            logits, next_pos = logits[idx], next_pos[idx]
        seeds = torch.tensor([r.seed or 0 for r in batch], dtype=torch.long, device=device)
        while True:
            self._use_decode_threads()  # a kernel's set-up may have reset the thread's count
            draw = _counter_draw(seeds, len(tokens_out[active[0]])) if self.counter_rng else \
                _generator_draw([batch[i].generator for i in active])
            tokens, logprobs = _sample(logits, scale, greedy, top_p, top_k, draw)
            keep = []
            for row, (b, tok, lp) in enumerate(zip(active, tokens.tolist(), logprobs.tolist())):
                tokens_out[b].append(tok)
                logprobs_out[b].append(lp)
                versions_out[b].append(version)
                if tok in self.eos_token_ids or (batch[b].params.stop and self._has_stop(tokens_out[b], batch[b].params.stop)):
                    finish[b] = "stop"
                elif len(tokens_out[b]) < batch[b].max_new_tokens:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                # Drop finished rows from every per-row tensor and from the KV cache.
                idx = torch.tensor(keep, device=device)
                session.select(idx)
                tokens, next_pos = tokens[idx], next_pos[idx]
                scale, greedy, top_p, top_k, seeds = scale[idx], greedy[idx], top_p[idx], top_k[idx], seeds[idx]
                active = [active[row] for row in keep]
            update = self._take_update(in_flight_only=True) if self._update is not None else None
            if update is not None:  # weights pushed while this batch decodes (weight.partial_rollout)
                self._install(update)  # a failure: the pusher hears of it; the batch fails
                version = update.version
                if update.recompute_prefix:  # the prefix's keys and values under the new weights
                    session, logits, next_pos = self._prefill_again(batch, active, tokens_out)
                    continue
            logits = session.step(tokens, next_pos)
            next_pos = next_pos + 1

        out = []
        for b in range(n):
            text, reason, ids, logprobs = self._finish(tokens_out[b], logprobs_out[b], finish[b], batch[b].params.stop)
            out.append((text, reason, ids, logprobs, versions_out[b][:len(ids)]))  # a stop string may cut it
        return out

    def _left_padded(self, rows: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token id rows left-padded to one width on the engine's device: ids, mask, positions."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r):] = torch.tensor(r)
            attention_mask[i, width - len(r):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        return input_ids, attention_mask, position_ids_from_mask(attention_mask)

    def _prefill_again(self, batch: list[_Request], active: list[int],
                       tokens_out: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """A new session holding the running requests' prompts and tokens so far, prefilled by the
        current weights; its logits of each request's next token and next positions."""
        rows = [batch[b].prompt_ids + tokens_out[b] for b in active]
        width = max(len(r) for r in rows)
        input_ids, attention_mask, position_ids = self._left_padded(rows)
        capacity = width + max(batch[b].max_new_tokens - len(tokens_out[b]) for b in active)
        session = self.decoder(tokens=self.decoder.footprint(len(rows), capacity))
        logits = session.prefill(input_ids, attention_mask, position_ids, capacity=capacity)
        return session, logits, position_ids[:, -1] + 1

    def _decode(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _has_stop(self, ids: list[int], stops: list[str]) -> bool:
        """Whether the text of ``ids`` holds a stop string, checked after every token: the text before
        the newest token held none, so a new one ends in that token's text. Only a tail is decoded
        (decoding the whole response every step cost O(length^2): 1.7 s a batch at 256 rows of
        256 tokens): enough tokens for the longest stop (a character is at most 4 bytes, a token at
        least one) and a margin for the tail's first token, whose text may differ from its text in
        the whole (a cut character, a dropped leading space)."""
        window = 4 * max(len(s) for s in stops) + 4
        text = self._decode(ids[-window:])
        return any(s and s in text for s in stops)

    def _finish(self, ids: list[int], logprobs: list[float], reason: str, stops: list[str]):
        text = self._decode(ids)
        cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
        if cut >= 0:  # a stop string ends the response, whenever it was seen
            text, reason = text[:cut], "stop"
            keep = len(ids)
            while keep > 0 and len(self._decode(ids[: keep - 1])) >= cut:
                keep -= 1
            ids, logprobs = ids[:keep], logprobs[:keep]
        return text, reason, ids, logprobs


def copy_weights(state_dict: Mapping[str, torch.Tensor], engines: list[HFInferenceEngine]) -> None:
    """One pass over ``state_dict``, each tensor into every engine's model (the callers hold their locks)."""
    owns = [engine.model.state_dict() for engine in engines]
    with torch.no_grad():
        for name, tensor in state_dict.items():
            for own in owns:
                own[name].copy_(tensor)


Draw = Callable[[torch.Tensor], torch.Tensor]  # sampled row indices -> one float64 uniform in [0, 1) each


def _generator_draw(generators: list[torch.Generator | None]) -> Draw:
    """Uniforms from each row's own ``torch.Generator`` (the CPU's source)."""
    return lambda rows: torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64)
                                   for i in rows.tolist()])


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for 32-bit ``x`` and ``c`` in int64, no product reaching 2**63."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counter: int) -> torch.Tensor:
    """A float64 uniform in [0, 1) for each 63-bit seed at position ``counter``: a pure function of
    the two, computed on the seeds' device for every row at once (53 bits from two hashes)."""
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(low ^ _mix32(high ^ _mix32(torch.full_like(seeds, counter & _MASK32))))
    first, second = _mix32(key ^ 0x68E31DA4), _mix32(key ^ 0xB5297A4D)
    return ((first >> 6) * (1 << 27) + (second >> 5)).double() / float(1 << 53)


def _counter_draw(seeds: torch.Tensor, counter: int) -> Draw:
    """Uniforms of token ``counter`` from each row's seed (a GPU's source: one computation for the batch)."""
    return lambda rows: counter_uniform(seeds[rows], counter)


def _sample(
    logits: torch.Tensor,
    scale: torch.Tensor,
    greedy: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    draw: Draw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every row and its logprob under ``logits / scale`` (full vocabulary).

    Sampled rows keep their ``top_k`` most likely tokens (0: all), then the smallest prefix of
    those, by probability, whose renormalised mass reaches ``top_p``, and invert the CDF of what
    is left at one uniform ``draw`` of the row's own (from its seed), so a row's sample never
    depends on the other rows of the batch. The CDF is summed in float64: a token of probability
    0 can never be picked.
    """
    logprobs = torch.log_softmax(logits.float() / scale.unsqueeze(-1), dim=-1)
    # Each pass over the vocabulary costs: argmax only for greedy rows, no copy when all are sampled.
    sampled = torch.nonzero(~greedy).squeeze(-1)
    if sampled.numel() == len(greedy):
        tokens = logprobs.new_zeros(len(greedy), dtype=torch.long)
    else:
        tokens = logprobs.argmax(dim=-1)
    if sampled.numel():
        probs = (logprobs if sampled.numel() == len(greedy) else logprobs[sampled]).exp()
        k, p = top_k[sampled], top_p[sampled]
        truncated = torch.nonzero((p < 1) | ((k > 0) & (k < probs.shape[-1]))).squeeze(-1)
        if truncated.numel():
            sub = probs[truncated]
            sorted_p, order = sub.sort(dim=-1, descending=True)
            rank = torch.arange(sub.shape[-1], device=sub.device)
            k_rows = k[truncated].unsqueeze(-1)
            outside_k = (k_rows > 0) & (rank >= k_rows)
            kept = sorted_p.masked_fill(outside_k, 0.0)
            # Nucleus over the top-k distribution renormalised: always keeps at least the top token.
            cumulative = kept.cumsum(-1)
            drop_sorted = outside_k | ((cumulative - kept) >= p[truncated].unsqueeze(-1) * cumulative[:, -1:])
            probs[truncated] = sub.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
        cdf = probs.double().cumsum(-1)
        uniform = draw(sampled).to(cdf.device)
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        tokens[sampled] = picked.clamp(max=probs.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
