"""nexrl-nexau: multi-turn, tool-using agents (NexAU's agent YAML) as nexrl rollout workers.

``rollout_worker.type: nexau`` runs an agent per task, extracts every LLM call from its trace
and trains on exactly the tokens the model produced (tool outputs and prompts masked out).
"""

from .agent_config import AgentSpec, ToolSpec, load_agent_spec
from .runner import STOP_REASONS, AgentRunner, AgentRunResult
from .tracer import TraceRecorder
from .trajectory import TokenSequence, TraceError, call_masks, llm_calls, token_sequences, truncate
from .worker import BaseNexAURolloutWorker, DefaultNexAURolloutWorker, NexAUEvaluationTarget

__all__ = ["AgentRunResult", "AgentRunner", "AgentSpec", "BaseNexAURolloutWorker", "DefaultNexAURolloutWorker",
           "NexAUEvaluationTarget", "STOP_REASONS", "TokenSequence", "ToolSpec", "TraceError", "TraceRecorder",
           "call_masks", "llm_calls", "load_agent_spec", "token_sequences", "truncate"]
