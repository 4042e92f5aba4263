"""Reference pages generated from the code, so they cannot drift from it: the hook reference
(from the hook specs' docstrings), the recipe reference (every key with its type, default and
meaning, from :mod:`nexrl_core.config.schema` and each component's declared options) and the migration
page (from :mod:`nexrl_core.cli.migration_table`).

``scripts/gen_docs.py`` writes the repository's ``docs/hooks.md``, ``docs/recipe.md`` and ``docs/migrating.md`` with
these functions; a plugin author can render the options of their own components the same way
(:func:`options_table`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..config.options import Option, describe_type, param_docs
from ..launch.recipe import KIND_WORDS, declared_options

# -- hooks -------------------------------------------------------------------------------------------

def hook_specs() -> list[Any]:
    """Every hook spec of :mod:`nexrl_core.hookspecs`, in source order."""
    from .. import hookspecs

    specs = [f for _, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if f.__module__ == hookspecs.__name__ and hasattr(f, "nexrl_spec")]
    return sorted(specs, key=lambda f: f.__code__.co_firstlineno)


def hook_reference() -> str:
    """Markdown: every hook with its signature, what it is for, its parameters and return value."""
    from .. import hookspecs
    from ..plugins import KINDS

    hook_kind = {hook: kind for kind, (hook, _) in KINDS.items()}
    out = ["# Hook reference", "",
           "Generated from the docstrings of `nexrl_core/hookspecs.py` by `python scripts/gen_docs.py`; "
           "`tests/docs/test_reference_docs.py` fails when this page is out of date. How to write, test and "
           "publish a plugin: [plugins.md](plugins.md).", "",
           _rst_to_md(inspect.getdoc(hookspecs) or ""), ""]
    out += ["| hook | what it is for |", "|---|---|"]
    for spec in hook_specs():
        out.append(f"| [`{spec.__name__}`](#{spec.__name__}) | {_cell(_first_paragraph(spec))} |")
    for spec in hook_specs():
        doc = inspect.getdoc(spec) or ""
        body, params, returns = _split_fields(doc)
        sig = str(inspect.signature(spec)).replace("'", "")
        out += ["", f"## {spec.__name__}", "", "```python", "@hookimpl", f"def {spec.__name__}{sig}: ...", "```",
                "", _rst_to_md(body)]
        if spec.__name__ in hook_kind:
            out += ["", f"Registers components of kind `{hook_kind[spec.__name__]}` (`nexrl plugins` lists them)."]
        if params:
            out += ["", "Parameters:", ""] + [f"- `{name}`: {_rst_to_md(text)}" for name, text in params]
        if returns:
            out += ["", f"Returns: {_rst_to_md(returns)}"]
    return "\n".join(out).rstrip() + "\n"


def _first_paragraph(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring, without a last sentence that introduces what follows (':')."""
    text = " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`])", text)
    while len(sentences) > 1 and sentences[-1].endswith(":"):
        sentences.pop()
    return _rst_to_md(" ".join(sentences))


def _split_fields(doc: str) -> tuple[str, list[tuple[str, str]], str]:
    """(body, [(param, text)], return text) of a docstring with ``:param x:`` / ``:return:`` fields."""
    lines = doc.splitlines()
    first = next((i for i, line in enumerate(lines) if re.match(r"\s*:(param|returns?)\b", line)), len(lines))
    returns = re.search(r"(?ms)^\s*:returns?:\s*(.*?)(?=^\s*:\w|\Z)", doc)
    text = " ".join(returns.group(1).split()) if returns else ""
    return "\n".join(lines[:first]).strip(), list(param_docs(doc).items()), text


def _rst_to_md(text: str) -> str:
    text = re.sub(r":(?:class|func|meth|mod|data|attr):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    text = re.sub(r"(?m)^(.*)::[ \t]*$", r"\1:", text)  # reST literal-block marker
    return text


# -- options ----------------------------------------------------------------------------------------------

def flatten_options(options: Mapping[str, Option] | None, prefix: str = "") -> list[tuple[str, Option]]:
    """``(dotted key, option)`` for every key of ``options``, nested mappings expanded (removed keys left out)."""
    rows: list[tuple[str, Option]] = []
    for key, opt in (options or {}).items():
        if opt.removed is not None:
            continue
        full = f"{prefix}{key}"
        rows.append((full, opt))
        if opt.options is not None:  # a section: its keys follow it
            rows.extend(flatten_options(opt.options, f"{full}."))
        if opt.values is not None:  # entries the recipe names (domains): one row stands for each
            rows.append((f"{full}.<name>", opt.values))
            rows.extend(flatten_options(opt.values.options, f"{full}.<name>."))
    return rows


def format_default(opt: Option) -> str:
    if opt.required:
        return "required"
    if opt.options is not None and opt.default_value() not in (None, {}):
        return "(its keys)"  # a section: the defaults are on its keys' rows
    return f"`{_yaml(opt.default_value())}`"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and value.strip() == value else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _meaning(opt: Option) -> str:
    parts = [_rst_to_md(opt.help).rstrip(".")] if opt.help else []
    if opt.choices:
        parts.append("one of " + ", ".join(f"`{_yaml(c)}`" for c in opt.choices))
    if opt.component is not None:
        parts.append(f"`{opt.selector}` names the {KIND_WORDS.get(opt.component, opt.component)}, whose own keys "
                     f"go here too")
    bounds = [f"{sym} {bound:g}" for sym, bound in (("≥", opt.ge), (">", opt.gt), ("≤", opt.le), ("<", opt.lt))
              if bound is not None]
    if bounds:
        parts.append(" and ".join(bounds))
    if opt.secret:
        parts.append("secret: `***` in every file and on the console")
    return "; ".join(parts)


def options_table(options: Mapping[str, Option] | None, prefix: str = "") -> list[str]:
    """Markdown table rows (header included) of ``options``; empty when there are none."""
    rows = flatten_options(options, prefix)
    if not rows:
        return []
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, opt in rows:
        out.append(f"| `{key}` | {_cell(describe_type(opt))} | {_cell(format_default(opt))} | {_cell(_meaning(opt))} |")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the recipe reference -----------------------------------------------------------------------------------

#: where a component's own keys go in a recipe, and the key that selects it
SECTIONS: dict[str, tuple[str, str]] = {
    "dataloader": ("data", "data.type / validate.data.type"),
    "rollout_worker": ("rollout_worker", "rollout_worker.type"),
    "evaluator": ("rollout_worker.evaluator", "rollout_worker.evaluator.type"),
    "trainer": ("trainer", "trainer.type"),
    "train_service": ("service.train_service", "service.train_service.backend"),
    "weight_sync_backend": ("weight", "weight.backend"),
    "inference_backend": ("service.inference_service", "service.inference_service.backend"),
    "metrics_sink": ("logger.<name>", "logger.backend"),
}

def recipe_reference(pm: Any, distributions: Iterable[str] | None = None) -> str:
    """Markdown: the core's keys (``nexrl_core.config.schema``), then the options of every component ``pm``
    knows (only those of ``distributions`` when given), by kind."""
    from ..config.options import component_options
    from ..config.schema import CORE_OPTIONS

    wanted = set(distributions) if distributions is not None else None
    out = ["# Recipe reference", "",
           "Every key a recipe may hold, with its type, default and meaning. Generated from the declarations in the "
           "code (`nexrl_core/config/schema.py` for the core's keys, each component's `OPTIONS`) by "
           "`python scripts/gen_docs.py`; `tests/docs/test_reference_docs.py` fails when this page is out of date. "
           "`nexrl validate` checks a recipe against the same declarations.", "",
           "A section that selects a component (`data`, `rollout_worker`, `rollout_worker.evaluator`, `trainer`, "
           "`service.train_service`, `weight`, `service.inference_service`, `service.reference_service`, "
           "`validate.data`) also takes the chosen "
           "component's own keys: "
           "see [Components](#components). `${key}` in a default is an interpolation of another key.", "",
           "## Core keys", ""]
    core = {k: v for k, v in CORE_OPTIONS.items() if k != "recipe_dir"}
    out += options_table(core)
    out += ["", "## Components", ""]
    for kind, (section, selector) in SECTIONS.items():
        regs = sorted((name, reg) for name, reg in pm.components(kind).items()
                      if wanted is None or reg.distribution in wanted)
        if not regs:
            continue
        out += [f"### {KIND_WORDS[kind].capitalize()}s", "", f"Selected with `{selector}`; their keys go in `{section}`.", ""]
        for name, reg in regs:
            doc = inspect.getdoc(reg.cls)
            out += [f"#### `{name}` ({reg.distribution})", ""]
            if doc and doc is not inspect.getdoc(reg.cls.__mro__[1]):  # not the docstring it inherits
                out += [_first_paragraph(reg.cls), ""]
            own = declared_options(kind, reg.cls)
            place = section.replace("<name>", name)
            if own is None:
                out += ["Takes any keys (its constructor has `**kwargs`).", ""]
            else:
                table = options_table(own, f"{place}.")
                out += (table or ["No keys of its own."]) + [""]
            if kind == "trainer":
                for attr, where in (("ALGORITHM_OPTIONS", "algorithm"), ("TRAIN_SERVICE_OPTIONS", "service.train_service")):
                    table = options_table(component_options(reg.cls, attr), f"{where}.")
                    if table:
                        out += [f"`{where}` with this trainer:", ""] + table + [""]
                for need, options in (getattr(reg.cls, "ALGORITHM_INPUTS", None) or {}).items():
                    # Accepted only when a selected estimator or loss requires the input (e.g. a critic's values).
                    table = options_table(options, "algorithm.")
                    if table:
                        out += [f"`algorithm` with this trainer when a selected function requires `{need}`:",
                                ""] + table + [""]
    out += _algorithm_functions(pm, wanted)
    return "\n".join(out).rstrip() + "\n"


_ALGORITHM_TITLES = {"advantage_estimator": "Advantage estimators", "policy_loss": "Policy losses"}


def _algorithm_functions(pm: Any, wanted: set[str] | None) -> list[str]:
    """The registered RL functions (advantage estimators, policy losses) and the ``algorithm.*``
    keys each reads (its keyword-only parameters)."""
    from ..algorithms.registry import ALGORITHM_KINDS, AlgorithmRegistry

    registry = AlgorithmRegistry.from_plugin_manager(pm)
    out = ["### Algorithm functions", "",
           "Selected by name in the `algorithm` section of a trainer that uses the core's registry "
           "(`algorithm.type`: the advantage estimator, `algorithm.policy_loss`: the policy loss, with "
           "`self_hosted_grpo`); the keys each reads go in `algorithm` too. See [algorithms.md](algorithms.md).", ""]
    for kind, hook in ALGORITHM_KINDS.items():
        names = [n for n in registry.names(kind)
                 if wanted is None or registry.get(kind, n, "").distribution in wanted]
        if not names:
            continue
        out += [f"#### {_ALGORITHM_TITLES.get(kind, kind)} (`{hook}`)", ""]
        for name in names:
            fn = registry.get(kind, name, "")
            out += [f"`{name}` ({fn.distribution}): {_first_paragraph(fn.fn)}", ""]
            table = options_table(fn.declared(), "algorithm.")
            out += (table or ["No keys of its own."]) + [""]
    return out



# -- migration -----------------------------------------------------------------------------------------

def migration_reference() -> str:
    """Markdown: the NexRL / ROLL -> nexrl table that ``nexrl migrate`` follows and ``nexrl validate``
    quotes (:mod:`nexrl_core.cli.migration_table`), its tables filled into the prose of ``migrating.md``
    beside this module (each ``{{name}}`` line)."""
    from . import migration_table as t

    def code(text: Any) -> str:
        return "—" if text is None else f"`{_yaml(text) if not isinstance(text, str) else text}`"

    def table(header: str, rows: Iterable[str]) -> str:
        columns = header.count("|") - 1
        return "\n".join([header, "|" + "---|" * columns, *rows])

    def keys(source: str) -> str:
        return table(f"| {source} key | nexrl key | note |",
                     (f"| `{r.seed}` | {code(r.nexrl)} | {_cell(r.why)} |" for r in t.KEY_RULES if r.source == source))

    blocks = {
        "hints": "\n".join(f"error: {key}: {t.seed_key_hint(key)}" for key in ("dataloader", "adv_estimator")),
        "keys_NexRL": keys("NexRL"), "keys_ROLL": keys("ROLL"),
        "same_keys": "These keys mean the same in nexrl: " + ", ".join(f"`{k}`" for k in t.SAME_KEYS) + ".",
        "derived": table("| nexrl key | set to |", (f"| `{key}` | {_cell(text)} |" for key, text in t.DERIVED)),
        "values": table("| key | NexRL value | nexrl value | note |",
                        (f"| `{r.key}` | {code(r.seed)} | {code(r.nexrl)} | {_cell(r.why)} |" for r in t.VALUE_RULES)),
        "adjustments": table("| key | nexrl writes | why |",
                             (f"| `{r.key}` | {code(r.nexrl)} | {_cell(r.why)} |" for r in t.ADJUSTMENTS)),
        "layouts": table("| layout | NexRL | nexrl |",
                         (f"| {_cell(r.name)} | {_cell(r.shape)} | {_cell(r.becomes)} |" for r in t.LAYOUTS)),
        "imports": table("| NexRL | nexrl | note |",
                         (f"| `{r.seed}` | {code(r.nexrl)} | {_cell(r.why)} |" for r in t.IMPORT_RULES)),
        "metrics": table("| NexRL / ROLL | nexrl | note |",
                         (f"| `{r.seed}`{' (ROLL)' if r.source == 'ROLL' else ''} | {code(r.nexrl)} | {_cell(r.why)} |"
                          for r in t.METRIC_RULES)),
    }
    prose = (Path(__file__).parent / "migrating.md").read_text(encoding="utf-8")
    return re.sub(r"(?m)^\{\{(\w+)\}\}$", lambda match: blocks[match.group(1)], prose).rstrip() + "\n"
