"""``nexrl migrate --code DIR [--write]``: NexRL's imports in a user's Python files rewritten as nexrl's.

Every ``.py`` file under DIR (hidden folders, ``__pycache__`` and installed packages left out) is
parsed; each ``from nexrl... import Name`` whose name the import table
(:data:`nexrl_core.cli.migration_table.IMPORT_RULES`) maps becomes the import of nexrl's name,
bound to the name the file used (``from nexrl_core import FileDataLoader as TorchDataLoader``), so
the rest of the file is unchanged. The rewrite is shown as a unified diff on stdout; only
``--write`` changes files. What it cannot rewrite is listed for the user: a name with no
counterpart (its import is kept as it was), ``import nexrl...`` (the names used through it are
the user's to change), ``from nexrl... import *``, and files it cannot parse (named, not touched).
"""

from __future__ import annotations

import ast
import difflib
import io
import os
import re
import shutil
import tempfile
import tokenize
from dataclasses import dataclass, field

from .migration_table import IMPORT_RULES, ImportRule

_BY_PATH = {rule.seed: rule for rule in IMPORT_RULES}
_BY_NAME = {rule.seed.rsplit(".", 1)[1]: rule for rule in IMPORT_RULES}
_POINTER = "docs/migrating.md#imports-and-classes"
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "node_modules"}
_MENTIONS_NEXRL = re.compile(r"^\s*(from|import)\s+nexrl(\s|\.|$)", re.MULTILINE)
_WIDTH = 100  # a rewritten import longer than this is written one name a line


@dataclass
class FileRewrite:
    """One Python file: its text before and after (equal when nothing was rewritten), the imports
    left for the user (``line: what``), or why it was not parsed."""

    path: str
    shown: str
    encoding: str = "utf-8"
    old: str = ""
    new: str = ""
    rewritten: int = 0
    by_hand: list[str] = field(default_factory=list)
    not_parsed: str | None = None
    names_nexrl: bool = False  # it imports NexRL (or, when not parsed, seems to)

    @property
    def changed(self) -> bool:
        return self.new != self.old

    def diff(self) -> str:
        lines = difflib.unified_diff(self.old.splitlines(keepends=True), self.new.splitlines(keepends=True),
                                     f"a/{self.shown}", f"b/{self.shown}")
        return "".join(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"
                       for line in lines)


def python_files(root: str) -> list[str]:
    """The ``.py`` files under ``root`` (or ``root`` itself), in a stable order."""
    if os.path.isfile(root):
        return [root]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS
                         and not d.endswith(".egg-info"))
        found += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return found


def rewrite_file(path: str, shown: str) -> FileRewrite:
    out = FileRewrite(path, shown)
    try:
        with open(path, "rb") as f:
            data = f.read()
        out.encoding = tokenize.detect_encoding(io.BytesIO(data).readline)[0]
        out.old = out.new = data.decode(out.encoding)
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError) as exc:
        out.not_parsed = f"not read ({type(exc).__name__}: {exc})"
        return out
    try:
        out.new, out.rewritten, out.by_hand, out.names_nexrl = rewrite_source(out.old, path)
    except (SyntaxError, ValueError) as exc:
        out.not_parsed = f"not parsed ({type(exc).__name__}: {exc})"
        out.names_nexrl = bool(_MENTIONS_NEXRL.search(out.old))
    return out


def rewrite_source(source: str, filename: str = "<source>") -> tuple[str, int, list[str], bool]:
    """``source`` with its NexRL imports rewritten: (new source, imported names rewritten, what is
    left for the user as ``line: what``, whether it imports NexRL at all). Raises SyntaxError
    when ``source`` does not parse."""
    tree = ast.parse(source, filename=filename)
    lines = io.StringIO(source, newline="").readlines()
    edits: list[tuple[int, int, int, int, str]] = []
    by_hand: list[tuple[int, str]] = []
    rewritten, names_nexrl = 0, False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_nexrl(alias.name):
                    names_nexrl = True
                    by_hand.append((node.lineno, f"import {alias.name}{_as(alias)}: change what is used through it "
                                                 f"to nexrl's names ({_POINTER})"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_nexrl(node.module):
            names_nexrl = True
            statements, count, notes = _rewrite_from(node)
            by_hand += [(node.lineno, note) for note in notes]
            if count:
                rewritten += count
                edits.append(_edit(node, lines, statements))
    text = source
    if edits:
        starts = _line_starts(lines)
        for sl, sc, el, ec, new in sorted(edits, reverse=True):
            text = text[:starts[sl - 1] + sc] + new + text[starts[el - 1] + ec:]
        ast.parse(text, filename=filename)  # what it wrote parses (a bug here must not reach a file)
    return text, rewritten, [f"{line}: {what}" for line, what in sorted(by_hand)], names_nexrl


def _is_nexrl(module: str | None) -> bool:
    return bool(module) and (module == "nexrl" or str(module).startswith("nexrl."))


def _as(alias: ast.alias) -> str:
    return f" as {alias.asname}" if alias.asname else ""


def _rule(module: str, name: str) -> ImportRule | None:
    """The table's rule for ``from module import name``: by its full path, else by the name (NexRL
    exports its classes from several modules)."""
    return _BY_PATH.get(f"{module}.{name}") or _BY_NAME.get(name)


def _rewrite_from(node: ast.ImportFrom) -> tuple[list[str], int, list[str]]:
    """The statements replacing ``node`` (nexrl's imports grouped by module, then the names kept
    as they were), how many names were rewritten, and a note for each name left."""
    module = str(node.module)
    groups: dict[str, list[str]] = {}
    kept: list[str] = []
    notes: list[str] = []
    for alias in node.names:
        rule = None if alias.name == "*" else _rule(module, alias.name)
        if rule is None or rule.nexrl is None:
            kept.append(alias.name + _as(alias))
            if alias.name == "*":
                why = f"name what it uses, from nexrl's modules ({_POINTER})"
            elif rule is None:
                why = f"no counterpart known ({_POINTER})"
            else:
                why = f"no counterpart: {rule.why}"
            notes.append(f"from {module} import {alias.name}{_as(alias)}: {why}")
            continue
        new_module, new_name = rule.nexrl.rsplit(".", 1)
        bound = alias.asname or alias.name
        groups.setdefault(new_module, []).append(new_name if new_name == bound else f"{new_name} as {bound}")
    statements = [(m, names) for m, names in groups.items()] + ([(module, kept)] if kept else [])
    return [_statement(m, names) for m, names in statements], sum(len(n) for n in groups.values()), notes


def _statement(module: str, names: list[str]) -> str:
    names = list(dict.fromkeys(names))
    one = f"from {module} import {', '.join(names)}"
    if len(one) <= _WIDTH:
        return one
    return f"from {module} import (\n" + "".join(f"    {name},\n" for name in names) + ")"


def _edit(node: ast.ImportFrom, lines: list[str], statements: list[str]) -> tuple[int, int, int, int, str]:
    """(start line, start column, end line, end column, text): columns in characters (the AST's are
    UTF-8 bytes). Statements go one a line at the statement's indentation when it has its lines to
    itself, else joined by ``; `` (an import after another statement on its line)."""
    sl, el = node.lineno, int(node.end_lineno or node.lineno)
    sc = _char_col(lines[sl - 1], node.col_offset)
    ec = _char_col(lines[el - 1], int(node.end_col_offset or 0))
    before, after = lines[sl - 1][:sc], lines[el - 1][ec:]
    alone = not before.strip() and (not after.strip() or after.strip().startswith("#"))
    indent = before if alone else ""
    # a statement wrapped in parentheses carries the indentation on each of its lines
    statements = [s.replace("\n    ", "\n" + indent + "    ").replace("\n)", "\n" + indent + ")") for s in statements]
    # the comments inside a statement over several lines stay, each on a line of its own above it
    comments = _comments("".join(lines[sl - 1:el])[sc:len("".join(lines[sl - 1:el - 1])) + ec]) if el > sl else []
    head = "".join(f"{c}\n{indent}" for c in comments) if alone else ""
    return sl, sc, el, ec, head + ("\n" + indent if alone else "; ").join(statements)


def _comments(text: str) -> list[str]:
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return []


def _char_col(line: str, byte_col: int) -> int:
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))


def _line_starts(lines: list[str]) -> list[int]:
    starts, at = [], 0
    for line in lines:
        starts.append(at)
        at += len(line)
    return starts + [at]


def write(rewrite: FileRewrite) -> None:
    """The new text in place of the old (a temporary file in the same folder, then renamed: a
    failure leaves the file as it was); its permissions kept."""
    folder = os.path.dirname(os.path.abspath(rewrite.path))
    fd, tmp = tempfile.mkstemp(prefix=".nexrl-migrate-", suffix=".py", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(rewrite.new.encode(rewrite.encoding))
        shutil.copymode(rewrite.path, tmp)
        os.replace(tmp, rewrite.path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def migrate_code(root: str, apply: bool) -> tuple[list[FileRewrite], list[str], int]:
    """Rewrite (``apply``) or only plan the imports under ``root``: (the files, the report's lines,
    the exit status: 0 when nothing is left for the user, 2 when something is)."""
    if not os.path.exists(root):
        from ..errors import ConfigError

        raise ConfigError(f"--code: '{root}' does not exist")
    base = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    files = [rewrite_file(p, os.path.relpath(p, base)) for p in python_files(root)]
    ours = [f for f in files if f.names_nexrl]
    report = [f"--code {root}: {len(ours)} of {len(files)} Python file{'s' if len(files) != 1 else ''} "
              f"import NexRL"]
    changed = [f for f in ours if f.changed]
    failed: list[str] = []
    for f in changed:
        n = f"{f.rewritten} name{'s' if f.rewritten != 1 else ''}"
        if not apply:
            report.append(f"  {f.shown}: {n} to rewrite")
            continue
        try:
            write(f)
            report.append(f"  {f.shown}: {n} rewritten")
        except OSError as exc:
            failed.append(f"  {f.shown}: not written ({type(exc).__name__}: {exc})")
    by_hand = [f"  {f.shown}:{line}" for f in ours for line in f.by_hand]
    if by_hand:
        report += ["to change by hand:", *by_hand]
    not_parsed = [f for f in files if f.not_parsed]
    if not_parsed:
        report.append("not changed (cannot be parsed):")
        report += [f"  {f.shown}: {f.not_parsed}" + (" (it imports NexRL)" if f.names_nexrl else "")
                   for f in not_parsed]
    report += failed
    if changed and not apply:
        report.append("nothing written: --write applies the diff above")
    left = bool(by_hand or failed or any(f.names_nexrl for f in not_parsed))
    return files, report, 2 if left else 0
