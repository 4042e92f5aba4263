"""The recipe: what it may hold, how it is put together and checked before a run starts.

- :mod:`.options`: ``Option``, a component's declared recipe keys (type, default, range, help)
- :mod:`.schema`: the core's own keys, declared with ``Option``; ``core_defaults()``
- :mod:`.compose`: the ``defaults:`` list and group overrides (Hydra-style composition)
- :mod:`.recipe`: ``load_recipe`` (defaults <- composed recipe <- overrides) and ``check_config``
- :mod:`.preflight`: what a run builds before it starts (data, evaluator, run directory, resume)
- :mod:`.migration_table`, :mod:`.migrate`: NexRL/ROLL recipes rewritten as nexrl recipes
"""


def __getattr__(name: str) -> object:
    # `from nexrl_core.config import load_recipe` named the module this package replaced (now
    # config.recipe): it still works, with a DeprecationWarning.
    from .._moved import forward

    return forward(__name__, name)
