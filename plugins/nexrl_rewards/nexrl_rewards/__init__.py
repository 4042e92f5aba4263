"""nexrl-rewards: verifiable-reward evaluators for nexrl (``math_rule``, ``code_sandbox``, ``llm_judge``,
``instruction_following``)."""
