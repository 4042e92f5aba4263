"""code_sandbox: scoring, and an attack corpus that must end at reward 0 with a reason, leave
nothing behind on the host and leave the run unharmed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from nexrl_core import BaseEvaluationTarget, ConfigError
from nexrl_rewards.code_sandbox import CodeSandboxEvaluator, extract_code, outputs_match
from nexrl_rewards.sandbox import LAUNCHER, NamespacesRefused, Sandbox, seccomp_available

REPO = Path(__file__).resolve().parents[2]
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"},
             {"input": "7 7\n", "output": "14\n"}]


def _namespaces_work() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
                            "--fork", "true"], capture_output=True)
    return probe.returncode == 0


NAMESPACES = _namespaces_work()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="this kernel does not allow Linux namespaces")


def sandbox_processes() -> list[str]:
    """Command lines of live processes that belong to a sandbox run (launcher or solution), less those
    another pytest worker started and still runs (its own tests check those): an orphan counts."""
    ours = {os.getpid(), *_ancestors(os.getpid())}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = _cmdline(int(entry))
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (LAUNCHER in cmdline or "solution.py" in cmdline or "nexrl-sandbox-marker" in cmdline) \
                and not any(pid not in ours and "xdist" in _cmdline(pid) for pid in _ancestors(int(entry))):
            found.append(f"{entry}: {cmdline}")
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
        chain.append(pid)
    return chain


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    assert sandbox_processes() == []
    assert not list(Path("/tmp").glob("nexrl-sandbox-*"))  # the fallback's directories are removed


@pytest.fixture(scope="module")
def evaluator():
    # Short limits keep the corpus fast; the defaults are larger (docs/rewards.md). Where the kernel
    # refuses namespaces, `auto` refuses to run: these tests then use the opt-in weaker mode.
    return CodeSandboxEvaluator(timeout_s=2.0, cpu_time_s=1.0, memory_mb=256, max_output_kb=64, **runnable_here())


def runnable_here() -> dict:
    """The evaluator's options that run here: none where namespaces work, else the opt-in to rlimits."""
    if NAMESPACES:
        return {}
    python = _interpreter_for_other_users() if os.geteuid() == 0 else sys.executable
    if python is None:
        pytest.skip("no namespaces, and no python interpreter here that another uid can execute")
    return {"isolation": "rlimits", "python": python}


def evaluate(evaluator, reply: str, cases=None, **data):
    item = {"uid": "0:0", "test_cases": SUM_CASES if cases is None else cases, **data}
    return evaluator.evaluate(item, BaseEvaluationTarget(final_answer=reply))


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(code)}```\nIt reads stdin."


# ----------------------------------------------------------------------------------- scoring

def test_a_correct_solution_passes_every_case(evaluator):
    result = evaluate(evaluator, fenced(ADD))
    assert result.reward == 1.0
    assert result.metrics == {"accuracy": 1.0, "pass_rate": 1.0, "num_cases": 3.0}
    info = result.extra_info
    assert info["reason"] is None and info["passed"] == 3 and info["code_source"] == "python_block"
    assert [c["status"] for c in info["cases"]] == ["passed"] * 3
    assert info["isolation"] == ("namespaces" if NAMESPACES else "rlimits")


def test_reward_is_the_fraction_of_cases_passed(evaluator):
    wrong_on_negatives = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"
    result = evaluate(evaluator, fenced(wrong_on_negatives))
    assert result.reward == pytest.approx(2 / 3)
    assert result.metrics["accuracy"] == 0.0 and result.metrics["pass_rate"] == pytest.approx(2 / 3)
    assert [c["status"] for c in result.extra_info["cases"]] == ["passed", "wrong_answer", "passed"]
    assert result.extra_info["reason"] == "wrong_answer"
    assert result.extra_info["detail"].startswith("case 1: wrong answer (stdout began '14")


def test_all_or_nothing_stops_at_the_first_failing_case():
    strict = CodeSandboxEvaluator(reward_mode="all_or_nothing", timeout_s=3.0, **runnable_here())
    result = evaluate(strict, fenced("a, b = map(int, input().split())\nprint(a * b if a == 10 else a + b)\n"))
    assert result.reward == 0.0 and result.metrics["pass_rate"] == pytest.approx(1 / 3)
    assert [c["status"] for c in result.extra_info["cases"]] == ["passed", "wrong_answer", "not_run"]
    assert evaluate(strict, fenced(ADD)).reward == 1.0


def test_test_cases_may_come_as_a_json_string(evaluator):
    import json

    assert evaluate(evaluator, fenced(ADD), cases=json.dumps(SUM_CASES)).reward == 1.0


@pytest.mark.parametrize("cases, match", [
    (None, r"has no 'test_cases' \(rollout_worker.evaluator.test_cases_key\)$"),
    ([], "must be a non-empty list"),
    ("{not json", "not JSON"),
    ([{"input": "1"}], r"\[0\] must be"),
    ([{"input": 1, "output": "1"}], r"\[0\] must be"),
])
def test_malformed_test_cases_fail_the_sample(evaluator, cases, match):
    item = {"uid": "3:1"} if cases is None else {"uid": "3:1", "test_cases": cases}
    with pytest.raises(ValueError, match=match) as info:
        evaluator.evaluate(item, BaseEvaluationTarget(final_answer=ADD))
    assert "'3:1'" in str(info.value) and "'test_cases'" in str(info.value)


def test_the_test_cases_key_is_configurable():
    evaluator = CodeSandboxEvaluator(test_cases_key="tests", timeout_s=3.0, **runnable_here())
    result = evaluator.evaluate({"tests": SUM_CASES[:1]}, BaseEvaluationTarget(final_answer=ADD))
    assert result.reward == 1.0 and result.extra_info["code_source"] == "whole_reply"


@pytest.mark.parametrize("reply, code, source", [
    ("```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```", "print(2)\n", "python_block"),
    ("```py\nprint(3)\n```", "print(3)\n", "python_block"),
    ("```\nprint(4)\n```\n```bash\nls\n```", "print(4)\n", "plain_block"),
    ("```python\nprint(1)\n```\n```\nplain\n```", "print(1)\n", "python_block"),
    ("cut off:\n```python\nprint(5)\n", "print(5)\n", "python_block"),
    ("print(6)", "print(6)", "whole_reply"),
])
def test_code_extraction(reply, code, source):
    assert extract_code(reply) == (code, source)


@pytest.mark.parametrize("actual, expected, mode, same", [
    ("3\n", "3", "trailing_whitespace", True),
    ("1 2   \n3\n\n\n", "1 2\n3", "trailing_whitespace", True),
    ("1\r\n2\r\n", "1\n2\n", "trailing_whitespace", True),
    (" 3", "3", "trailing_whitespace", False),
    ("1\n\n2", "1\n2", "trailing_whitespace", False),
    ("3\n", "3", "exact", False),
    ("3\n", "3\n", "exact", True),
    ("1  2\n3", "1 2 3", "whitespace", True),
    ("1 2", "12", "whitespace", False),
])
def test_output_comparison(actual, expected, mode, same):
    assert outputs_match(actual, expected, mode) is same


def test_comparison_mode_is_used(evaluator):
    exact = CodeSandboxEvaluator(compare="exact", timeout_s=3.0, **runnable_here())
    result = evaluate(exact, fenced(ADD))  # case 1 expects "6" without the newline print() writes
    assert [c["status"] for c in result.extra_info["cases"]] == ["passed", "wrong_answer", "passed"]


def test_an_empty_reply_has_no_code(evaluator):
    result = evaluate(evaluator, "```python\n\n```")
    assert result.reward == 0.0 and result.extra_info["reason"] == "no_code"


def test_large_stdin_to_a_program_that_never_reads_it(evaluator):
    result = evaluate(evaluator, "print('done')", cases=[{"input": "x" * (4 << 20), "output": "done"}])
    assert result.reward == 1.0


@pytest.mark.parametrize("kwargs, key", [
    ({"reward_mode": "partial"}, "reward_mode"),
    ({"compare": "fuzzy"}, "compare"),
    ({"isolation": "docker"}, "isolation"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"memory_mb": -1}, "memory_mb"),
    ({"max_open_files": 4}, "max_open_files"),
    ({"timeout_s": "fast"}, "timeout_s"),
    ({"max_processes": 2.5}, "max_processes"),
    ({"memory_mb": True}, "memory_mb"),
])
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"rollout_worker.evaluator.{key}"):
        CodeSandboxEvaluator(**kwargs)


def test_namespaces_are_used_where_the_kernel_allows_them():
    if NAMESPACES:
        assert Sandbox().mode == "namespaces"
    else:
        with pytest.raises(NamespacesRefused, match="isolation: rlimits"):
            Sandbox().mode  # noqa: B018 - reading it decides (and refuses)


# ------------------------------------------------------------------------------ attack corpus
# Each attack prints what the expected output asks for only if it succeeded. It must score 0
# with the listed reason; the host-side check (if any) proves nothing happened outside.

ALL_LIMITS = {"timeout", "cpu_limit"}


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("the-secret-file-content")
    secret_file.chmod(0o644)
    keep = tmp_path / "keep.txt"
    keep.write_text("keep me")
    monkeypatch.setenv("NEXRL_SANDBOX_TEST_SECRET", "the-secret-env-value")
    return {"file": secret_file, "keep": keep, "dir": tmp_path, "marker": f"nexrl-pwned-{uuid.uuid4().hex[:8]}"}


def _attacks(s: dict) -> list[tuple[str, str, str, set[str]]]:
    """(name, code, expected stdout if the attack worked, acceptable reasons)."""
    targets = [str(s["dir"] / s["marker"]), f"/root/{s['marker']}", str(REPO / s["marker"]), f"/{s['marker']}"]
    return [
        ("write outside its directory",
         f"for p in {targets!r}:\n    open(p, 'w').write('x')\nprint('wrote')", "wrote", {"runtime_error"}),
        ("read the parent's files",
         f"print(open({str(s['file'])!r}).read())", "the-secret-file-content", {"runtime_error"}),
        ("read the repository",
         f"print(open({str(REPO / 'pyproject.toml')!r}).read()[:20])",
         (REPO / "pyproject.toml").read_text()[:20], {"runtime_error"}),
        ("read the parent's environment",
         "import os\nprint(os.environ.get('NEXRL_SANDBOX_TEST_SECRET'))", "the-secret-env-value", {"wrong_answer"}),
        ("read /proc/<parent>/environ",
         f"print(open('/proc/{os.getpid()}/environ').read())", "the-secret-env-value", {"runtime_error"}),
        ("list other users' processes",
         "import os\nprint(len(os.listdir('/proc')))", "many", {"runtime_error"}),
        ("kill its parent",
         "import os\nos.kill(os.getppid(), 9)\nprint('killed')", "killed", {"runtime_error"}),
        ("kill the trainer by pid",
         f"import os\nos.kill({os.getpid()}, 9)\nprint('killed')", "killed", {"runtime_error"}),
        ("kill -9 -1",  # the kernel reports success even when every signal was refused: look
         "import os, time\nppid = os.getppid()\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"
         "time.sleep(0.2)\ntry:\n    os.kill(ppid, 0)\n    alive = True\nexcept PermissionError:\n    alive = True\n"
         "except ProcessLookupError:\n    alive = False\nprint('parent alive' if alive else 'killed')",
         "killed", {"wrong_answer"}),
        ("kill its own process group",
         "import os\nos.killpg(0, 9)\nprint('killed')", "killed", {"crashed"}),
        ("fork bomb",
         "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
         "never", ALL_LIMITS),
        ("memory bomb",
         "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))", "never", {"memory_limit"}),
        ("one huge allocation", "x = bytearray(8 << 30)\nprint('allocated')", "allocated", {"memory_limit"}),
        ("infinite loop", "while True:\n    pass", "never", ALL_LIMITS),
        ("sleep past the wall limit", "import time\ntime.sleep(60)\nprint('woke')", "woke", {"timeout"}),
        ("flood of output", "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", "never", {"output_limit"}),
        ("huge file",
         "with open('big', 'wb') as f:\n    while True:\n        f.write(b'z' * (1 << 20))", "never",
         {"runtime_error"}),
        ("delete the parent's files",
         f"import os\nos.remove({str(s['keep'])!r})\nprint('deleted')", "deleted", {"runtime_error"}),
        ("write /dev/shm",
         f"open('/dev/shm/{s['marker']}', 'w').write('x')\nprint('wrote')", "wrote", {"runtime_error"}),
        ("thread bomb",
         "import threading, time\nfor _ in range(100000):\n"
         "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\nprint('spawned')",
         "spawned", {"runtime_error", "memory_limit"} | ALL_LIMITS),
        ("open a socket to a loopback listener",
         "import socket\ns = socket.create_connection(('127.0.0.1', PORT), timeout=2)\n"
         "s.sendall(b'stolen')\nprint('connected')", "connected", {"runtime_error"}),
        ("become root", "import os\nos.setuid(0)\nprint('root')", "root", {"runtime_error"}),
        ("modify the Python runtime",
         f"import os\nopen(os.path.join(os.path.dirname(os.__file__), '{s['marker']}.py'), 'w').write('x')\n"
         "print('planted')", "planted", {"runtime_error"}),
        ("new user namespace",
         "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "if libc.unshare(0x10000000) != 0:\n    raise OSError(ctypes.get_errno(), 'unshare')\nprint('escaped')",
         "escaped", {"runtime_error"}),
        ("inherited file descriptors",
         "import os\nleaks = []\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'x')\n"
         "        leaks.append(fd)\n    except OSError:\n        pass\nassert leaks, 'no fd'\nprint('leaked')",
         "leaked", {"runtime_error"}),
        ("crash the interpreter", "import ctypes\nctypes.string_at(0)\nprint('alive')", "alive", {"crashed"}),
        ("exhaust file descriptors",
         "fs = [open('/dev/null') for _ in range(100000)]\nprint('opened')", "opened", {"runtime_error"}),
    ]


ATTACK_NAMES = [a[0] for a in _attacks({"dir": Path("/x"), "file": Path("/x"), "keep": Path("/x"), "marker": "m"})]


def _attack(evaluator, secrets: dict, name: str) -> None:
    code, expected, reasons = next((c, e, r) for n, c, e, r in _attacks(secrets) if n == name)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        code = code.replace("PORT", str(listener.getsockname()[1]))
        result = evaluate(evaluator, fenced(code), cases=[{"input": "", "output": expected}])
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing reached the loopback listener
    info = result.extra_info
    assert result.reward == 0.0, info
    assert info["reason"] in reasons, info
    assert info["detail"].startswith("case 0: ")
    # the host is untouched
    assert secrets["keep"].read_text() == "keep me"
    stdlib = Path(os.__file__).parent
    for path in (secrets["dir"] / secrets["marker"], Path("/root") / secrets["marker"], REPO / secrets["marker"],
                 Path("/") / secrets["marker"], Path("/dev/shm") / secrets["marker"],
                 stdlib / f"{secrets['marker']}.py", Path("/usr/lib/python3.11") / f"{secrets['marker']}.py"):
        assert not path.exists(), path
    # and the evaluator still works
    assert evaluate(evaluator, fenced(ADD), cases=SUM_CASES[:1]).reward == 1.0


@needs_namespaces
@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_scores_zero_with_a_reason_and_leaves_no_trace(evaluator, secrets, name):
    _attack(evaluator, secrets, name)


# What the rlimits fallback stops as root (a uid of its own, the seccomp filter); the rest are its
# documented gaps.
FALLBACK_GAPS = {"read the repository", "list other users' processes", "write /dev/shm", "new user namespace"} | \
    (set() if seccomp_available() else {"open a socket to a loopback listener"})


def _interpreter_for_other_users() -> str | None:
    """The fallback runs the code as another uid: it needs an interpreter that uid can reach
    (this machine's own python may live under /root)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        parts = Path(real).parents
        if os.path.exists(real) and all(os.stat(p).st_mode & 0o001 for p in parts) and os.stat(real).st_mode & 0o001:
            return real
    return None


@pytest.fixture(scope="module")
def fallback_evaluator():
    python = _interpreter_for_other_users()
    if python is None:
        pytest.skip("no python interpreter here that another uid can execute")
    return CodeSandboxEvaluator(timeout_s=2.0, cpu_time_s=1.0, memory_mb=256, max_output_kb=64, isolation="rlimits",
                                python=python)


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback separates the code from the trainer only as root")
@pytest.mark.parametrize("name", [n for n in ATTACK_NAMES if n not in FALLBACK_GAPS])
def test_the_rlimits_fallback_stops_what_it_claims_to(fallback_evaluator, secrets, name):
    _attack(fallback_evaluator, secrets, name)


def test_the_fallback_warns_once_with_what_it_does_not_protect(monkeypatch):
    from loguru import logger

    import nexrl_rewards.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "_WARNED", False)
    monkeypatch.setattr(sandbox_module, "_MODES", {})
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        for _ in range(2):
            assert Sandbox(isolation="rlimits").mode == "rlimits"
    finally:
        logger.remove(sink)
    assert len(messages) == 1
    assert "does NOT protect against" in messages[0]
    docs = " ".join((REPO / "docs" / "rewards.md").read_text().split())
    gaps = (sandbox_module.FALLBACK_GAPS + sandbox_module.FALLBACK_GAPS_WITHOUT_SECCOMP
            + sandbox_module.FALLBACK_GAPS_WITHOUT_CGROUPS + sandbox_module.FALLBACK_GAPS_NOT_ROOT)
    for gap in gaps:  # the docs list every gap the warning can name
        assert gap in docs, gap
    for gap in Sandbox(isolation="rlimits").fallback_gaps():
        assert gap in messages[0]
    assert ("no network isolation" in messages[0]) != seccomp_available()


def test_a_daemonized_child_does_not_outlive_its_case(evaluator):
    marker = f"nexrl-sandbox-marker-{uuid.uuid4().hex[:8]}"
    code = f"""
    import os, sys
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
        os._exit(0)
    print("daemonized")
    """
    result = evaluate(evaluator, fenced(code), cases=[{"input": "", "output": "daemonized"}] * 2)
    assert result.reward == 1.0  # the program did what it printed; what matters is what is left
    assert not [p for p in sandbox_processes() if marker in p]


def test_a_case_sees_a_fresh_working_directory(evaluator):
    code = "import os\nprint(sorted(os.listdir('.')))\nopen('left-behind', 'w').write('x')\n"
    result = evaluate(evaluator, fenced(code), cases=[{"input": "", "output": "[]"}] * 2)
    assert result.reward == 1.0, result.extra_info


@needs_namespaces
def test_the_namespaced_view_holds_only_the_runtime(evaluator):
    code = """
    import os
    print(os.getuid(), os.getpid(), sorted(os.listdir('/')), sorted(os.listdir('/dev')), os.getcwd())
    """
    result = evaluate(evaluator, fenced(code), cases=[{"input": "", "output": ""}])
    out = result.extra_info["cases"][0]["stdout"]
    uid, pid, rest = out.split(" ", 2)
    assert (uid, pid) == ("65534", "2")  # unprivileged, and pid 2: alone in its pid namespace
    assert "'proc'" not in rest and "'etc'" not in rest and "'home'" not in rest
    assert "['null', 'random', 'urandom', 'zero']" in rest and rest.strip().endswith("/work")


def test_parallel_evaluations_do_not_interfere(evaluator):
    # 10 evaluations at once, each with its own program; some pass, some fail in different ways.
    programs = {
        i: (f"a, b = map(int, input().split())\nprint(a + b + {i % 3})\n" if i % 4 else
            "import time\nwhile True:\n    pass\n" if i == 4 else
            "a, b = map(int, input().split())\nprint(a + b)\n")
        for i in range(10)
    }
    expected = {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.0, 6: 1.0, 7: 0.0, 8: 1.0, 9: 1.0}
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = evaluate(evaluator, fenced(programs[i]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert {i: r.reward for i, r in results.items()} == expected
    assert results[4].extra_info["reason"] in ALL_LIMITS
    for i in (1, 2, 5, 7):
        assert results[i].extra_info["reason"] == "wrong_answer"


@needs_namespaces
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user for the test")
def test_namespaces_also_isolate_when_nexrl_is_not_root(tmp_path):
    """An unprivileged launcher maps only its own uid (to 65534): the runner still sees no host
    file, no network, no other process, and cannot create a user namespace."""
    import json

    python = _interpreter_for_other_users()
    if python is None or not all(os.stat(p).st_mode & 0o005 for p in (Path(LAUNCHER), *Path(LAUNCHER).parents)):
        pytest.skip("no interpreter or launcher path another user can reach")
    from nexrl_rewards.sandbox import Limits, runtime_paths

    code = textwrap.dedent("""
        import ctypes, os, socket
        print(os.getuid(), os.getpid(), sorted(os.listdir('/')))
        print(ctypes.CDLL(None, use_errno=True).unshare(0x10000000))
        try:
            socket.create_connection(('127.0.0.1', 22), timeout=1)
        except OSError as exc:
            print(exc.errno)
    """)
    request = {"mode": "namespaces", "python": python, "binds": runtime_paths(python), "code": code,
               "inputs": [""], "limits": Limits().as_request(), "uid": 65534, "gid": 65534}

    def become_nobody_else() -> None:
        os.setgroups([])
        os.setresgid(4321, 4321, 4321)
        os.setresuid(4321, 4321, 4321)

    done = subprocess.run([python, "-I", "-S", "-B", LAUNCHER], input=json.dumps(request).encode(), env={},
                          capture_output=True, preexec_fn=become_nobody_else, timeout=60, cwd=tmp_path)
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    case = next(e for e in events if e["event"] == "case")
    uid_pid, unshare, errno = case["stdout"].splitlines()
    assert uid_pid.startswith("65534 2 ") and "'proc'" not in uid_pid and "'root'" not in uid_pid
    assert unshare == "-1" and errno == "101"  # no nested user namespace; network unreachable


@pytest.mark.skipif(not Sandbox().run_cgroups, reason="this process cannot create cgroups here")
def test_memory_is_capped_for_the_whole_run_not_only_per_process():
    """Four processes of 150-200 MB each stay under the per-process limit (300 MB) but not under
    the run's cgroup (300 + 16 + 96 MB): the kernel kills the largest, the code's main process."""
    evaluator = CodeSandboxEvaluator(timeout_s=10.0, cpu_time_s=5.0, memory_mb=300, max_output_kb=64, **runnable_here())
    code = """
    import os, time
    children = [pid for pid in (os.fork() for _ in range(3)) if pid]
    if len(children) < 3:          # a child
        time.sleep(0.5)
        block = b"c" * (150 << 20)
        time.sleep(5)
        os._exit(0)
    block = b"p" * (200 << 20)
    for _ in children:
        os.wait()
    print("allocated")
    """
    result = evaluate(evaluator, fenced(code), cases=[{"input": "", "output": "allocated"}])
    assert result.reward == 0.0
    assert result.extra_info["reason"] == "memory_limit", result.extra_info
