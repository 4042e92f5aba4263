"""A plugin that registers things that are not classes of the right kind."""

from nexrl_core import hookimpl


class NotATrainer:  # forgot to subclass nexrl_core.BaseTrainer
    def train(self, trajectories):
        return {}


@hookimpl
def nexrl_trainers():
    return {"not_a_trainer": NotATrainer, "an_instance": NotATrainer()}


@hookimpl
def nexrl_evaluators():
    return {"a_string": "nexrl_bad_class:NotATrainer"}
