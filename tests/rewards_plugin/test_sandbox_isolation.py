"""code_sandbox's isolation modes (issue #29 item 2; docs/rewards.md, "Threat model"): the seccomp
filter refuses ptrace and every socket family but AF_UNIX, with namespaces and on its own; where
the kernel refuses namespaces, ``isolation: auto`` refuses to run, in one line naming the key,
and ``nexrl validate`` says so as ``nexrl run`` does; ``isolation: rlimits`` runs there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nexrl_rewards.sandbox as sandbox_module
from nexrl_core import BaseEvaluationTarget
from nexrl_rewards.code_sandbox import CodeSandboxEvaluator
from tests.rewards_plugin.test_code_sandbox import NAMESPACES, _interpreter_for_other_users, fenced, needs_namespaces

REPO = Path(__file__).resolve().parents[2]
NO_NAMESPACES = REPO / "tests" / "support" / "no_namespaces.py"
needs_seccomp = pytest.mark.skipif(not sandbox_module.seccomp_available(),
                                   reason="this kernel does not accept the seccomp filter")

# Connects to the test's loopback listener; prints how socket() / connect() failed (errno).
CONNECT = """
import socket
try:
    s = socket.create_connection(("127.0.0.1", PORT), timeout=2)
    s.sendall(b"stolen")
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
"""
PTRACE = """
import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", libc.ptrace(0, 0, None, None), ctypes.get_errno())  # PTRACE_TRACEME
a, b = socket.socketpair()                                         # AF_UNIX still works
a.sendall(b"unix ok")
print(b.recv(16).decode())
for family in (socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_NETLINK else socket.SOCK_RAW)
        print("opened", family)
    except OSError as exc:
        print("family", exc.errno)
"""


def run_one(evaluator: CodeSandboxEvaluator, code: str) -> tuple[str, dict]:
    result = evaluator.evaluate({"uid": "0:0", "test_cases": [{"input": "", "output": "-"}]},
                                BaseEvaluationTarget(final_answer=fenced(code)))
    return result.extra_info["cases"][0]["stdout"], result.extra_info


def connect_from_sandbox(evaluator: CodeSandboxEvaluator) -> tuple[str, dict]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.3)
        out, info = run_one(evaluator, CONNECT.replace("PORT", str(listener.getsockname()[1])))
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing reached the listener
    return out, info


@pytest.fixture
def without_seccomp(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_SECCOMP", [False])


@pytest.fixture(scope="module")
def rlimits_python():
    python = _interpreter_for_other_users() if os.geteuid() == 0 else sys.executable
    if python is None:
        pytest.skip("no python interpreter here that another uid can execute")
    return python


@needs_namespaces
@needs_seccomp
def test_namespaces_with_seccomp_refuse_a_loopback_connection_at_socket():
    out, info = connect_from_sandbox(CodeSandboxEvaluator(timeout_s=5.0))
    assert (info["isolation"], info["seccomp"]) == ("namespaces", True)
    assert out.split() == ["refused", "97"]  # EAFNOSUPPORT: the filter refused the AF_INET socket


@needs_namespaces
def test_the_network_namespace_alone_refuses_a_loopback_connection(without_seccomp):
    out, info = connect_from_sandbox(CodeSandboxEvaluator(timeout_s=5.0))
    assert (info["isolation"], info["seccomp"]) == ("namespaces", False)
    assert out.split() == ["refused", "101"]  # ENETUNREACH: no interface is up


@needs_seccomp
def test_the_seccomp_filter_alone_refuses_a_loopback_connection(rlimits_python):
    out, info = connect_from_sandbox(CodeSandboxEvaluator(timeout_s=5.0, isolation="rlimits", python=rlimits_python))
    assert (info["isolation"], info["seccomp"]) == ("rlimits", True)
    assert out.split() == ["refused", "97"]


def test_without_seccomp_or_namespaces_the_connection_goes_through(rlimits_python, without_seccomp):
    """The gap the fallback warning names when seccomp is missing (and proof the tests above can fail)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        code = CONNECT.replace("PORT", str(listener.getsockname()[1]))
        out, info = run_one(CodeSandboxEvaluator(timeout_s=5.0, isolation="rlimits", python=rlimits_python), code)
        listener.accept()[0].close()
    assert info["seccomp"] is False and out.strip() == "connected"


@needs_seccomp
@pytest.mark.parametrize("isolation", ["auto", "rlimits"])
def test_ptrace_and_other_socket_families_are_refused(isolation, rlimits_python):
    if isolation == "auto" and not NAMESPACES:
        pytest.skip("this kernel does not allow Linux namespaces")
    evaluator = CodeSandboxEvaluator(timeout_s=5.0, isolation=isolation, python=rlimits_python)
    out, _ = run_one(evaluator, PTRACE)
    assert out.splitlines() == ["ptrace -1 1", "unix ok"] + ["family 97"] * 3, out  # EPERM; EAFNOSUPPORT


def test_the_filter_program_checks_the_architecture_first():
    from nexrl_rewards._sandbox_launcher import _SECCOMP_ARCH, RET_KILL_PROCESS, seccomp_program

    for machine, (arch, _, _) in _SECCOMP_ARCH.items():
        prog = seccomp_program(machine)
        assert prog[:3] == [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, RET_KILL_PROCESS)]
        assert prog[-1] == (0x06, 0, 0, 0x7FFF0000)  # allow what is not listed
        for i, (code, jt, jf, _) in enumerate(prog):  # every jump lands inside the program
            assert code & 0x07 != 0x05 or i + 1 + max(jt, jf) < len(prog)


# ------------------------------------------------------------------- where namespaces are refused

def _where_namespaces_are_refused(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    if os.geteuid() != 0:
        pytest.skip("denying namespaces to a child (a user namespace of its own) needs root here")
    done = subprocess.run([sys.executable, str(NO_NAMESPACES), *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env={**os.environ, "NO_COLOR": "1"})
    if done.returncode == 97:
        pytest.skip(f"cannot deny namespaces to a child here: {done.stderr.strip()}")
    return done


CHILD = """
import json, sys
from nexrl_core import BaseEvaluationTarget, ConfigError
from nexrl_rewards.code_sandbox import CodeSandboxEvaluator
out = {}
try:
    CodeSandboxEvaluator()
    out["auto"] = "built"
except ConfigError as exc:
    out["auto"] = str(exc)
evaluator = CodeSandboxEvaluator(isolation="rlimits", python=sys.argv[1])
result = evaluator.evaluate({"uid": "0", "test_cases": [{"input": "2 3\\n", "output": "5\\n"}]},
                            BaseEvaluationTarget(final_answer="print(sum(map(int, input().split())))"))
out["rlimits"] = [result.reward, result.extra_info["isolation"]]
print(json.dumps(out))
"""


def test_auto_refuses_where_namespaces_are_missing_and_rlimits_runs(tmp_path, rlimits_python):
    done = _where_namespaces_are_refused([sys.executable, "-c", CHILD, rlimits_python], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    line = out["auto"]
    assert "\n" not in line
    assert line.startswith("rollout_worker.evaluator.isolation: Linux namespaces are not available here (")
    assert "No space left on device" in line  # the kernel's reason, as unshare got it
    assert "isolation: rlimits accepts that weaker sandbox" in line
    assert out["rlimits"] == [1.0, "rlimits"]


def test_validate_and_run_refuse_auto_alike(tmp_path):
    """One `error:` line naming the key, from `nexrl validate` and from `nexrl run`, before a run starts."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        data: {{type: file, path: {REPO / 'tests' / 'bad_inputs' / 'data' / 'train.jsonl'}}}
        rollout_worker: {{num_workers: 1, evaluator: {{type: code_sandbox}}}}
        trajectory_pool: {{batch_size: 2, group_size: 2}}
        trainer: {{type: mock, total_train_steps: 1}}
        service: {{inference_service: {{backend: mock}}}}
        run_dir: {tmp_path / 'run'}
        logger: {{level: WARNING}}
        """))
    outputs = {}
    for command in ("validate", "run"):
        done = _where_namespaces_are_refused([sys.executable, "-m", "nexrl_core.cli", command, str(recipe)], tmp_path)
        assert done.returncode == 2, (command, done.stdout[-2000:], done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        outputs[command] = [line for line in done.stderr.splitlines() if "rollout_worker.evaluator.isolation" in line]
    assert len(outputs["validate"]) == 1 and outputs["validate"] == outputs["run"], outputs
    assert "isolation: rlimits" in outputs["run"][0]
    assert not (tmp_path / "run" / "checkpoints").exists()
