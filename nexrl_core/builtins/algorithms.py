"""Built-in advantage estimators, registered like a plugin's (``algorithm.type``)."""

from __future__ import annotations

from ..algorithms import advantages
from ..markers import hookimpl


@hookimpl
def nexrl_advantage_estimators():
    return {"grpo": advantages.grpo, "dr_grpo": advantages.dr_grpo, "rloo": advantages.rloo,
            "reinforce_plus_plus": advantages.reinforce_plus_plus, "gae": advantages.gae}
