"""A local stand-in of the Tinker service: the unmodified ``tinker`` SDK talks to it on loopback.

Run it with ``python -m nexrl_tinker.standin --model NAME=HF_FOLDER`` (see ``--help``), point
the SDK (or a recipe) at the URL it prints with ``TINKER_BASE_URL`` / ``base_url``, and give any
API key starting with ``tml-``. In Python: ``StandinServer({"name": BaseModel.from_folder(...)})``.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"BaseModel": "engine", "LoraLinear": "engine", "TrainingRun": "engine", "UserError": "engine",
            "Fault": "faults", "StandinServer": "server"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: `python -m nexrl_tinker.standin --help` and argument errors need no torch import.
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
