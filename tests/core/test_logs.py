"""Every log line of a run reaches run.log through loguru: nexrl's own modules (the OpenAI client
among them), third-party libraries logging with the standard ``logging`` module, and Python
warnings."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from nexrl_core.builtins.openai_client import OpenAICompatibleClient
from nexrl_core.runtime.inference import SamplingParams
from nexrl_core.runtime.run_log import LOG_FILE, setup_logging
from tests.support.openai_server import FakeOpenAIServer

REPO = Path(__file__).resolve().parents[2]


def test_openai_client_warnings_and_retries_reach_run_log(tmp_path, reset_loguru, capfd):
    setup_logging(str(tmp_path), "WARNING")
    with FakeOpenAIServer() as server:
        client = OpenAICompatibleClient({"url": server.url, "model": server.model, "retry_backoff": 0.01,
                                         "timeout": 5})
        try:
            server.strict_params = True  # rejects return_token_ids: the client warns and goes on
            server.fail_next(1, status=503)  # retried once: a DEBUG line
            assert client.complete("What is 1 + 2?", SamplingParams()).text == "3"
        finally:
            client.close()
    log = (tmp_path / LOG_FILE).read_text()
    assert f"inference server {server.url} rejects `return_token_ids`" in log
    assert "retry 1 in" in log and "DEBUG" in log  # run.log keeps DEBUG
    err = capfd.readouterr().err
    assert "rejects `return_token_ids`" in err and "retry 1 in" not in err  # the console keeps its level


def test_standard_logging_and_warnings_of_libraries_reach_run_log(tmp_path):
    # A fresh interpreter: pytest installs its own logging handlers and warning capture.
    script = textwrap.dedent(f"""
        import logging, warnings
        from nexrl_core.runtime.run_log import setup_logging

        setup_logging({str(tmp_path)!r}, "INFO")
        logging.getLogger("httpx").warning("connection pool is full")
        logging.getLogger("some.library").error("could not parse %s", "x.json")
        logging.getLogger("some.library").info("one line per request")  # below WARNING: not forwarded
        warnings.warn("this argument is deprecated", UserWarning)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / LOG_FILE).read_text()
    assert "WARNING" in log and "httpx: connection pool is full" in log
    assert "ERROR" in log and "some.library: could not parse x.json" in log
    assert "one line per request" not in log
    assert "py.warnings" in log and "UserWarning: this argument is deprecated" in log
    assert "httpx: connection pool is full" in done.stderr  # and the console shows them too


def test_no_module_logs_around_loguru():
    """Only the bridge itself may use the standard logging module."""
    allowed = {REPO / "nexrl_core" / "runtime" / "logs.py"}
    offenders = []
    for path in sorted([*(REPO / "nexrl_core").rglob("*.py"), *(REPO / "plugins").rglob("*.py")]):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if "logging" in names:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == [], offenders


def test_a_librarys_routine_warnings_can_be_demoted(tmp_path):
    script = textwrap.dedent(f"""
        import logging
        from nexrl_core import demote_library_log
        from nexrl_core.runtime.run_log import setup_logging

        setup_logging({str(tmp_path)!r}, "INFO")
        demote_library_log("some.sdk", "because of try_again")
        logging.getLogger("some.sdk").warning("Retrying request 7 because of try_again")
        logging.getLogger("some.sdk").warning("request 8 failed")
        logging.getLogger("other.sdk").warning("Retrying request 9 because of try_again")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for text in ((tmp_path / LOG_FILE).read_text(), done.stderr):
        assert "request 7" not in text  # demoted below the level library records are forwarded at
        assert "some.sdk: request 8 failed" in text and "other.sdk: Retrying request 9" in text


def test_every_loguru_sink_leaves_local_variables_out():
    """loguru's ``diagnose`` (on by default) prints every local variable under a traceback: secrets
    and prompts. Each ``logger.add`` of nexrl's code passes ``diagnose=False`` (or
    ``**SINK_SAFETY``, which does)."""
    from nexrl_core.runtime.run_log import SINK_SAFETY

    assert SINK_SAFETY["diagnose"] is False
    sources = [*REPO.glob("nexrl_core/**/*.py"), *REPO.glob("plugins/*/nexrl_*/**/*.py"),
               *REPO.glob("benchmarks/*.py")]
    calls, unsafe = 0, []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "logger":
                calls += 1
                kinds = {(k.arg, getattr(k.value, "value", None)) for k in node.keywords}
                spread = any(k.arg is None and getattr(k.value, "id", "") == "SINK_SAFETY" for k in node.keywords)
                if ("diagnose", False) not in kinds and not spread:
                    unsafe.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls >= 4 and not unsafe, unsafe
