"""transformers' own log records reach run.log (it keeps a stderr handler and does not propagate
unless the plugin asks it to, which loading a model does)."""

from __future__ import annotations

from nexrl_core.run_log import LOG_FILE, setup_logging


def test_transformers_warnings_reach_run_log(tmp_path, reset_loguru):
    from transformers.utils import logging as hf_logging

    from nexrl_grpo.modeling import transformers_logs_to_root

    setup_logging(str(tmp_path), "WARNING")
    try:
        transformers_logs_to_root()
        hf_logging.get_logger("transformers.generation.utils").warning("Setting `pad_token_id` to `eos_token_id`")
        log = (tmp_path / LOG_FILE).read_text()
        assert "transformers.generation.utils: Setting `pad_token_id` to `eos_token_id`" in log
    finally:
        hf_logging.enable_default_handler()
        hf_logging.disable_propagation()
