"""nexrl-rewards passes the plugin conformance check (``nexrl plugins check nexrl-rewards``):
math_rule, code_sandbox and instruction_following on their EXAMPLES and on odd replies; llm_judge
is skipped until it is given a judge to call."""

from __future__ import annotations

import nexrl_rewards.plugin as rewards_plugin
from nexrl_core.testing import check_plugin, plugin_manager


def test_nexrl_rewards_conforms():
    pm = plugin_manager(rewards_plugin)
    reports = {r.component.split("'")[1]: r for r in check_plugin("nexrl_rewards.plugin", pm)}
    assert set(reports) == {"math_rule", "code_sandbox", "llm_judge", "instruction_following"}
    for name in ("math_rule", "code_sandbox", "instruction_following"):
        assert reports[name].ok, reports[name].text()
    judge = reports["llm_judge"]
    assert judge.skipped is not None and "rollout_worker.evaluator.service" in judge.skipped and not judge.problems
