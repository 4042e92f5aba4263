"""The in-process engine's recipe keys (``service.inference_service``), declared once: read by the
engine (:mod:`.engine`), the ``hf`` backend (:mod:`.weights`) and their memory plan
(:mod:`nexrl_torch.plan`)."""

from __future__ import annotations

from dataclasses import dataclass

from nexrl_core import setting

from ..models import AutoFlag, ModelSettings, _auto_flag


def _thread_count(value: int | str | None) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return f"expected 'auto', null or a positive integer, got {value!r}"


@dataclass(frozen=True, kw_only=True)
class EngineSettings(ModelSettings):
    """One engine's keys: the model's and the scheduler's and decoder's."""

    max_batch_size: int = setting(64, "most requests decoded together", ge=1)
    batch_wait_ms: float = setting(2.0, "wait for more requests before a batch starts", ge=0)
    batch_wait_max_ms: float = setting(500.0, "longest wait for a batch to fill (it starts sooner once no "
                                              "request came for batch_wait_ms and no caller is tokenizing)", ge=0)
    chat_template: bool = setting(True, "apply the tokenizer's chat template to chat prompts")
    seed: int | None = setting(None, "seed of requests without their own")
    fast_path: AutoFlag = setting(None, "the hand-written batch-invariant decoding path (llama, qwen2, qwen3, "
                                        "mistral, gemma3_text, qwen3_moe): auto (other models: see static_cache) | "
                                        "true (an error when it cannot) | false (the transformers forward with a "
                                        "growing cache, for every model)", check=_auto_flag)
    static_cache: AutoFlag = setting(None, "with fast_path auto, for a model the fast path does not serve: the "
                                           "transformers forward over a preallocated static KV cache (compiled with "
                                           "CUDA graphs on a GPU; not batch-invariant) where transformers supports one "
                                           "for the model: auto (on a CUDA device only: on the CPU it decoded no "
                                           "faster than the growing cache) | true (also on the CPU; an error when the "
                                           "model cannot) | false (the growing cache)", check=_auto_flag)
    cpu_kernels: AutoFlag = setting(None, "on the CPU fast path: decode steps (and float32 matmuls) through C++ "
                                          "kernels compiled once per machine with the C++ compiler found (a float32 "
                                          "decode step about a third faster; other bits than torch ops, still "
                                          "batch-invariant): auto (when they build) | true (an error when they cannot) | "
                                          "false", check=_auto_flag)
    gpu_memory_utilization: float = setting(0.3, "on a GPU: the share of its memory the engine may hold (weights, "
                                                 "decode workspace, and the KV cache in what is left)", gt=0, le=1)
    max_kv_tokens: int | None = setting(None, "KV-cache budget in tokens (null: from gpu_memory_utilization on a GPU, "
                                              "unbounded on the CPU): a batch allocates what it needs within it; one "
                                              "that needs more is decoded in parts", ge=1)
    release_kv_cache: bool = setting(True, "on a GPU: free the KV cache whenever the engine is idle (the trainer "
                                           "steps in that memory); false keeps it allocated")
    cuda_graphs: AutoFlag = setting(None, "on a GPU: replay each decode step as a CUDA graph: auto (on a CUDA "
                                          "device) | true | false", check=_auto_flag)
    decode_threads: int | str | None = setting("auto", "on the CPU: threads the engine decodes on (its own thread's "
                                                       "OpenMP and MKL team; the process's other threads keep "
                                                       "theirs): N always; auto: while a trainer computes beside it "
                                                       "in this process (weight.rollouts_ahead, launch_mode local) "
                                                       "half the torch threads (at least 1) and the rest to the "
                                                       "trainer, else all; null: the process's torch threads",
                                               check=_thread_count)
    lend_idle_threads: bool = setting(False, "with decode_threads auto while a trainer computes beside it: the side "
                                             "computing nothing (the engine between batches, the trainer between "
                                             "its passes) lends its threads to the other, which takes them at its "
                                             "next decode step or layer and gives them back the same way; false: "
                                             "each keeps its part")


@dataclass(frozen=True, kw_only=True)
class HFBackendSettings(EngineSettings):
    """The ``hf`` backend's keys: one engine's, and how many engines serve."""

    replicas: int = setting(1, "engines serving the rollouts, each with its own copy of the model (on a GPU box "
                               "replica i takes the i-th GPU from device on); a request goes to the least busy", ge=1)
    replica_actors: bool = setting(False, "launch_mode ray: replicas 1..N-1 each in a Ray actor of their own "
                                          "(a CPU and, on GPUs, one GPU each, in a placement group; weights "
                                          "reach them through Ray's object store); launch_mode local: "
                                          "engines in this process, as with false")
