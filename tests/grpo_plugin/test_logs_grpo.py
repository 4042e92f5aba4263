"""transformers' own log records reach run.log (it keeps a stderr handler and does not propagate
unless the plugin asks it to, which loading a model does)."""

from __future__ import annotations

from nexrl_core.runtime.run_log import LOG_FILE, setup_logging
from tests.support.torch_fixtures import tiny_services


def test_transformers_warnings_reach_run_log(tmp_path, reset_loguru):
    from transformers.utils import logging as hf_logging

    from nexrl_torch.models import transformers_logs_to_root

    setup_logging(str(tmp_path), "WARNING")
    try:
        transformers_logs_to_root()
        hf_logging.get_logger("transformers.generation.utils").warning("Setting `pad_token_id` to `eos_token_id`")
        log = (tmp_path / LOG_FILE).read_text()
        assert "transformers.generation.utils: Setting `pad_token_id` to `eos_token_id`" in log
    finally:
        hf_logging.enable_default_handler()
        hf_logging.disable_propagation()


def test_decoding_through_the_transformers_forward_warns_nothing(tiny_model_dir):
    # transformers 5.x deprecates the `past_key_values` keyword every supported version takes:
    # importing the plugin silences exactly that notice (it used to reach every run's console). In a
    # fresh process, where pytest's own warning capture does not reset the filters.
    import os
    import subprocess
    import sys

    script = f"""
import warnings, torch
from nexrl_torch.rollout.decoding import HFSession
from nexrl_torch.models import load_causal_lm
model, tokenizer = load_causal_lm({tiny_model_dir!r})
ids = torch.tensor([tokenizer.encode("hello world")])
session = HFSession(model)
session.prefill(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
session.step(torch.tensor([5]), torch.tensor([ids.shape[1]]))
try:
    warnings.warn("another library's deprecation", FutureWarning)
except FutureWarning as exc:
    print("still raised:", exc)
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", script], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr  # -W error: any FutureWarning of the decoding raises
    assert run.stdout.strip() == "still raised: another library's deprecation"  # only that one is silenced


BROKEN_WORKER = '''
from nexrl_core import hookimpl
from nexrl_core.builtins.workers import SimpleRolloutWorker


class Unrecorded(SimpleRolloutWorker):
    """Drops the sampling record the trainer scores each row with (after the base class filled it in)."""

    def _check_trajectory(self, trajectory):
        secret_prompt = trajectory.pop("sampling", None)
        return super()._check_trajectory(trajectory)


@hookimpl
def nexrl_rollout_workers():
    return {"unrecorded": Unrecorded}
'''


def test_a_worker_breaking_the_trainers_contract_is_one_message(tiny_model_dir, tmp_path, monkeypatch, capfd,
                                                                 reset_loguru):
    """The trainer's error ends the run: the console says it once (the run's error line), without a
    traceback or local variables; run.log has the traceback once."""
    import importlib.util
    import sys

    import yaml

    from nexrl_core.cli import main
    from tests.support.letters import grpo_plugin_manager

    path = tmp_path / "unrecorded_worker.py"
    path.write_text(BROKEN_WORKER)
    spec = importlib.util.spec_from_file_location("unrecorded_worker", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["unrecorded_worker"] = module
    spec.loader.exec_module(module)
    pm = grpo_plugin_manager()
    pm.register(module, name="unrecorded", distribution="nexrl-unrecorded")
    import nexrl_core.plugins as plugins

    monkeypatch.setattr(plugins, "_DEFAULT", pm)  # what `nexrl run` uses
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": [{"prompt": p} for p in ("the quick", "what is")]},
        "rollout_worker": {"type": "unrecorded", "num_workers": 2, "sampling": {"max_tokens": 4},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 2},
        "weight": {"sync_mode": "sync", "backend": "in_process"},
        "service": tiny_services(tiny_model_dir, lr=None),
        "runtime_monitor": {"stop_timeout": 10, "exception_handling": {"check_interval": 0.05}},
    }))
    assert main(["run", str(recipe)]) == 1
    err = capfd.readouterr().err
    message = "has no 'sampling'"
    assert err.count(message) == 1, err
    [error_line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert message in error_line and "trainer stopped at step 1" in error_line
    assert "Traceback" not in err and "│" not in err and "└" not in err, err
    # Short: the header, the footer and a line a step (as in tests/core/test_failure_visibility.py).
    assert len([line for line in err.splitlines() if not line.lstrip().startswith("step ")]) < 22, err
    assert "Loading weights" not in err  # transformers' progress bars stay off
    log = (tmp_path / "run" / "run.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1
    assert "secret_prompt" not in log and "│" not in log  # no local variables, in any sink
