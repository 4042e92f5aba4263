"""A local stand-in of the Tinker service: the unmodified ``tinker`` SDK talks to it on loopback.

Run it with ``python -m nexrl_tinker.standin --model NAME=HF_FOLDER`` (see ``--help``), point
the SDK (or a recipe) at the URL it prints with ``TINKER_BASE_URL`` / ``base_url``, and give any
API key starting with ``tml-``. In Python: ``StandinServer({"name": BaseModel.from_folder(...)})``.
"""

from .engine import BaseModel, LoraLinear, TrainingRun, UserError
from .server import Fault, StandinServer

__all__ = ["BaseModel", "Fault", "LoraLinear", "StandinServer", "TrainingRun", "UserError"]
