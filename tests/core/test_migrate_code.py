"""``nexrl migrate --code DIR [--write]``: the NexRL imports of a user's Python files rewritten as
nexrl's (the import table of nexrl_core/cli/migration_table.py): a unified diff first, files
changed only with --write, a file that does not parse named and never touched."""

from __future__ import annotations

import ast
import os
import stat
import textwrap

import pytest

from nexrl_core.cli import main
from nexrl_core.cli.migrate_code import rewrite_source

WORKER = textwrap.dedent('''\
    """My task's worker, written for NexRL."""
    import os
    from nexrl import BaseRolloutWorker
    from nexrl.rollout_worker import AgentRolloutWorker, Evaluator as Ev, EvaluationRunResult
    from nexrl.trainer import (
        SelfHostedGrpoTrainer,  # the GRPO trainer
        BaseTrainer,
    )
    import nexrl.utils as nu

    try:
        from nexrl.data_loader import TorchDataLoader; LOADER = TorchDataLoader
    except ImportError:
        LOADER = None


    class MyWorker(BaseRolloutWorker):
        def helper(self):
            from nexrl.utils import execute, Unheard
            return execute, Unheard, Ev, EvaluationRunResult, os, nu
''')

REWRITTEN = textwrap.dedent('''\
    """My task's worker, written for NexRL."""
    import os
    from nexrl_core import BaseRolloutWorker
    from nexrl_core import Evaluator as Ev, EvaluationRunResult
    from nexrl.rollout_worker import AgentRolloutWorker
    # the GRPO trainer
    from nexrl_grpo.trainers import SelfHostedGrpoTrainer
    from nexrl_core import BaseTrainer
    import nexrl.utils as nu

    try:
        from nexrl_core import FileDataLoader as TorchDataLoader; LOADER = TorchDataLoader
    except ImportError:
        LOADER = None


    class MyWorker(BaseRolloutWorker):
        def helper(self):
            from nexrl_core import execute
            from nexrl.utils import Unheard
            return execute, Unheard, Ev, EvaluationRunResult, os, nu
''')


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "my_project"
    (root / "pkg").mkdir(parents=True)
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / "pkg" / "worker.py").write_text(WORKER)
    (root / "pkg" / "evaluator.py").write_text(
        "# -*- coding: latin-1 -*-\n# caf\xe9\nfrom nexrl.rollout_worker import Evaluator, BaseEvaluationTarget\n",
        encoding="latin-1")
    (root / "pkg" / "plain.py").write_text("import json\nfrom nexrl_core import Batch\n")  # nothing to do
    (root / "pkg" / "windows.py").write_bytes(b"from nexrl.nexrl_types import Trajectory\r\nX = 1\r\n")
    (root / "pkg" / "broken.py").write_text("from nexrl import NexRLController\ndef oops(:\n")
    (root / ".venv" / "lib" / "installed.py").write_text("from nexrl import NexRLController\n")  # not the user's
    os.chmod(root / "pkg" / "windows.py", 0o750)
    return root


@pytest.fixture
def cli(core_pm, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def call(*argv):
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err
    return call


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*.py"))}


def test_the_rewrite_binds_the_names_the_file_used():
    new, count, by_hand, imports = rewrite_source(WORKER)
    assert new == REWRITTEN and imports
    assert count == 7  # BaseRolloutWorker, Ev, EvaluationRunResult, the two trainers, TorchDataLoader, execute
    assert by_hand == [
        "4: from nexrl.rollout_worker import AgentRolloutWorker: no counterpart: rollout_worker.type nexau runs "
        "tool-using agents (nexrl-nexau)",
        "9: import nexrl.utils as nu: change what is used through it to nexrl's names "
        "(docs/migrating.md#imports-and-classes)",
        "19: from nexrl.utils import Unheard: no counterpart known (docs/migrating.md#imports-and-classes)",
    ]
    assert rewrite_source(new)[0] == new  # a second pass changes nothing


@pytest.mark.parametrize("source, expected", [
    # a deep NexRL module path: the class is found by its name
    ("from nexrl.rollout_worker.base_nexau_rollout_worker import BaseNexAURolloutWorker\n",
     "from nexrl_nexau import BaseNexAURolloutWorker\n"),
    # the user's alias is kept, and a renamed class is bound to the old name
    ("from nexrl.data_loader import TorchDataLoader as TDL, BaseDataLoader\n",
     "from nexrl_core import FileDataLoader as TDL, BaseDataLoader\n"),
    # after another statement on its line: joined with '; '
    ("import os; from nexrl.trainer import BaseTrainer, SelfHostedTrainer\n",
     "import os; from nexrl_core import BaseTrainer; from nexrl_grpo.trainers import SelfHostedTrainer\n"),
    # a long import is written one name a line, at the statement's indentation
    ("if True:\n    from nexrl import (NexRLController, BaseRolloutWorker, Batch, Trajectory, NexRLRole, ModelTag,"
     " Validator)\n",
     "if True:\n    from nexrl_core import (\n        NexRLController,\n        BaseRolloutWorker,\n        Batch,\n"
     "        Trajectory,\n        NexRLRole,\n        ModelTag,\n        Validator,\n    )\n"),
    # a name with no counterpart only: left as it is
    ("from nexrl.rollout_worker import MockRolloutWorker\n", "from nexrl.rollout_worker import MockRolloutWorker\n"),
    # a relative import and nexrl's own packages are not NexRL's
    ("from .nexrl import Batch\nfrom nexrl_core import Batch as B\n",
     "from .nexrl import Batch\nfrom nexrl_core import Batch as B\n"),
])
def test_each_import_shape(source, expected):
    new = rewrite_source(source)[0]
    assert new == expected
    ast.parse(new)


def test_a_star_import_is_left_for_the_user():
    new, count, by_hand, imports = rewrite_source("from nexrl import *\n")
    assert new == "from nexrl import *\n" and count == 0 and imports
    assert by_hand == ["1: from nexrl import *: name what it uses, from nexrl's modules "
                       "(docs/migrating.md#imports-and-classes)"]


def test_code_shows_a_diff_and_changes_nothing_without_write(project, cli):
    before = _snapshot(project)
    code, out, err = cli("migrate", "--code", str(project))
    assert _snapshot(project) == before  # no file touched
    assert code == 2  # an import without a counterpart, an `import nexrl`, a file that does not parse
    assert "--- a/pkg/worker.py\n+++ b/pkg/worker.py\n" in out
    assert "\n-from nexrl import BaseRolloutWorker\n" in out and "\n+from nexrl_core import BaseRolloutWorker\n" in out
    assert "-from nexrl.rollout_worker import Evaluator, BaseEvaluationTarget\n" \
           "+from nexrl_core import Evaluator, BaseEvaluationTarget\n" in out
    assert "+from nexrl_core import Trajectory\r\n" in out  # the file's line endings
    assert "plain.py" not in out and "broken.py" not in out and "installed.py" not in out
    lines = err.splitlines()
    assert lines[0] == f"--code {project}: 4 of 5 Python files import NexRL"  # .venv is not the user's code
    assert "  pkg/worker.py: 7 names to rewrite" in lines and "  pkg/windows.py: 1 name to rewrite" in lines
    assert "  pkg/worker.py:4: from nexrl.rollout_worker import AgentRolloutWorker: no counterpart: " \
           "rollout_worker.type nexau runs tool-using agents (nexrl-nexau)" in lines
    assert lines[lines.index("not changed (cannot be parsed):") + 1].startswith(
        "  pkg/broken.py: not parsed (SyntaxError: ") and lines[-2].endswith("(it imports NexRL)")
    assert lines[-1] == "nothing written: --write applies the diff above"


def test_write_applies_the_diff_and_leaves_what_it_cannot_parse(project, cli):
    broken = (project / "pkg" / "broken.py").read_bytes()
    plain = (project / "pkg" / "plain.py").read_bytes()
    code, out, err = cli("migrate", "--code", str(project), "--write")
    assert code == 2 and "  pkg/worker.py: 7 names rewritten" in err.splitlines()
    assert (project / "pkg" / "worker.py").read_text() == REWRITTEN
    evaluator = (project / "pkg" / "evaluator.py").read_bytes()
    assert evaluator.decode("latin-1") == \
        "# -*- coding: latin-1 -*-\n# caf\xe9\nfrom nexrl_core import Evaluator, BaseEvaluationTarget\n"
    assert (project / "pkg" / "windows.py").read_bytes() == b"from nexrl_core import Trajectory\r\nX = 1\r\n"
    assert stat.S_IMODE(os.stat(project / "pkg" / "windows.py").st_mode) == 0o750  # its permissions kept
    assert (project / "pkg" / "broken.py").read_bytes() == broken and (project / "pkg" / "plain.py").read_bytes() == plain
    assert (project / ".venv" / "lib" / "installed.py").read_text() == "from nexrl import NexRLController\n"
    assert not [p for p in (project / "pkg").iterdir() if p.name.startswith(".nexrl-migrate-")]  # no leftovers
    # a second run finds only what is left for the user
    code, out, err = cli("migrate", "--code", str(project / "pkg"))
    assert out == "" and "names to rewrite" not in err and code == 2


def test_a_folder_with_nothing_left_exits_0(tmp_path, cli):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "evaluator.py").write_text("from nexrl.rollout_worker import Evaluator\n")
    code, out, err = cli("migrate", "--code", str(tmp_path / "src"), "--write")
    assert code == 0 and (tmp_path / "src" / "evaluator.py").read_text() == "from nexrl_core import Evaluator\n"
    assert err.splitlines() == [f"--code {tmp_path / 'src'}: 1 of 1 Python file import NexRL",
                                "  evaluator.py: 1 name rewritten"]
    code, out, err = cli("migrate", "--code", str(tmp_path / "src" / "evaluator.py"))  # one file; nothing to do
    assert code == 0 and out == ""


@pytest.mark.parametrize("argv, expected", [
    (["migrate"], "error: migrate: name a recipe (nexrl migrate RECIPE.yaml) or a folder of Python files"),
    (["migrate", "--code", "nowhere"], "error: --code: 'nowhere' does not exist"),
    (["migrate", "--write", "r.yaml"], "error: --write: applies the rewrite of --code DIR"),
    (["migrate", "r.yaml", "--code", "."], "error: --code: stdout holds the diff of the Python files; write the "
                                           "recipe with -o"),
])
def test_code_refuses_what_it_cannot_do(argv, expected, cli):
    code, out, err = cli(*argv)
    assert code == 2 and err.startswith(expected), err
