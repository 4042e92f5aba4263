"""``nexrl migrate OLD.yaml [-o NEW.yaml]``: a NexRL (or ROLL) recipe rewritten as a nexrl recipe.

The rewrite follows :mod:`nexrl_core.cli.migration_table` (also the source of docs/migrating.md):

1. the recipe's defaults list is composed, as ``nexrl run`` composes it (numbers NexRL's loader
   reads from ``1e-6`` become numbers);
2. NexRL 1.x's named train services (``service.train_service.main_actor``, ``.student``,
   ``.teacher``) become the train service and, for a teacher, the reference service;
3. keys move to nexrl's (``dataloader`` -> ``data``, ``max_steps`` -> ``trainer.total_train_steps``
   ...), then seed values become nexrl's (``data.type: torch`` -> ``file``), then the weight-sync
   backend is chosen (NexRL's ``weight.sync_method``), then the keys whose value needs converting
   (``evaluator_module_path: file.py:Class``, ROLL's ``rollout_batch_size`` ...);
4. what the rest of the recipe decides is filled in (the model named once, the Tinker model and
   tokenizer, the math evaluator of NexRL's math agent);
5. ``${...}`` references follow the keys they name (``${oc.env:...}`` is kept as written);
6. every key nexrl still rejects is taken out and listed with the reason, and a value nexrl
   refuses is replaced by the nearest it accepts (migration_table.ADJUSTMENTS), said in one line;
7. relative paths are rewritten for the new file's folder (the NexAU worker's agent YAML and
   workspace, which it reads from the current folder, as ``${recipe_dir}/...``); NexRL's
   ``environment.setup_script`` is named with what it exports.

The result is then checked as ``nexrl validate`` checks it (:func:`check_migrated`): problems only
the machine that runs it can settle (environment variables, data files, model folders, keys) are
listed apart and do not fail the command. The Python files it names are searched for the seed's
imports (listed with nexrl's); ``--code DIR`` rewrites them (:mod:`.migrate_code`: a diff, then
``--write``).
"""

from __future__ import annotations

import ast
import copy
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .migration_table import (
    ADJUSTMENTS,
    IMPORT_RULES,
    KEY_RULES,
    NEXRL_ANSWER,
    SCORINGS,
    VALUE_RULES,
    WEIGHT_BACKENDS,
    Context,
    KeyRule,
    get_key,
    rule_for,
)

_REJECTED = re.compile(r"^(?P<key>[^\s:]+): (?P<why>unknown key.*|no longer a recipe key: .*"
                       r"|expected a mapping, got null.*|does nothing without .*)$")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${a.b}: a key; ${oc.env:X} (a resolver) is left alone
_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_]\w*)\}")  # an environment variable without a default
# What NexRL's loader (OmegaConf's) reads as a number and PyYAML as a string: 1e-6, 2E5, 1.0e-8
_EXPONENT = re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$")


@dataclass
class Change:
    """One line of the report: ``seed`` became ``nexrl`` (``kind`` moved, value or set), or was
    dropped with ``why``."""

    kind: str
    seed: str
    nexrl: str | None = None
    why: str = ""

    def text(self) -> str:
        if self.kind == "dropped":
            return f"{self.seed}: {self.why}"
        arrow = f"{self.seed} -> {self.nexrl}" if self.nexrl is not None else self.seed
        return f"{arrow} ({self.why})" if self.why else arrow


@dataclass
class WorkspaceCopy:
    """The folders (and files) next to the seed recipe whose Python files import NexRL, to be
    copied under ``folder`` (next to the new recipe) with their imports rewritten; the originals
    are left as they are. ``units``: (original, copy), absolute paths."""

    folder: str
    units: list[tuple[str, str]]


@dataclass
class Migration:
    """The nexrl recipe and what happened on the way."""

    recipe: dict[str, Any]
    changes: list[Change] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)

    notes: list[str] = field(default_factory=list)       # for the machine that runs it (env scripts)
    import_files: set[str] = field(default_factory=set)  # the named Python files that import NexRL
    copy: WorkspaceCopy | None = None  # those files' folders, to be copied next to the new recipe
    code_left: list[str] = field(default_factory=list)  # what is left to rewrite (commands, lines by hand)

    def of_kind(self, *kinds: str) -> list[Change]:
        return [c for c in self.changes if c.kind in kinds]

    def dropped(self) -> dict[str, str]:
        """seed key -> why it was not carried over."""
        return {c.seed: c.why for c in self.changes if c.kind == "dropped"}


class _Context(Context):
    def __init__(self, pm: Any, current: dict[str, Any]):
        self.pm = pm
        self.current = current

    def declares(self, kind: str, name: str, *keys: str) -> bool:
        from ..launch.recipe import declared_options

        registered = self.pm.components(kind).get(name)
        if registered is None:
            return False
        own = declared_options(kind, registered.cls)
        return own is None or all(k in own for k in keys)

    def registered(self, kind: str, name: str) -> bool:
        return name in self.pm.components(kind)

    def pushes_weights(self, trainer: str) -> bool:
        from ..config.options import component_capabilities

        registered = self.pm.components("trainer").get(trainer)
        return registered is not None and \
            "weight_sync:state_dict" in component_capabilities(registered.cls).requires


# -- dotted access ---------------------------------------------------------------------------------

def _has(values: Any, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    node = get_key(values, ".".join(parents)) if parents else values
    return isinstance(node, Mapping) and leaf in node


def _pop(values: dict[str, Any], dotted: str) -> Any:
    """Take ``dotted`` out; a section left empty by it goes too."""
    *parents, leaf = dotted.split(".")
    chain = [values]
    for part in parents:
        chain.append(chain[-1][part])
    value = chain[-1].pop(leaf)
    for node, part in zip(reversed(chain[:-1]), reversed(parents)):
        if node[part] == {}:
            del node[part]
        else:
            break
    return value


def _clash(values: Any, dotted: str, value: Any) -> str | None:
    """Why ``value`` cannot go to ``dotted`` (None: it can): a different value is already there
    (the recipe wrote nexrl's key itself, and that one wins). Mappings merge."""
    *parents, leaf = dotted.split(".")
    node = values
    for i, part in enumerate(parents):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return None
        node = node[part]
        if not isinstance(node, Mapping):
            return f"{'.'.join(parents[:i + 1])} is already {node!r}"
    current = node.get(leaf) if isinstance(node, Mapping) else None
    if current is None or current == value:
        return None
    if isinstance(current, Mapping) and isinstance(value, Mapping):
        for key, item in value.items():
            inner = _clash(current, str(key), item)
            if inner is not None:
                return f"{dotted}.{inner}"
        return None
    return f"{dotted} is already {current!r}"


def _put(values: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted`` (after :func:`_clash` said it may); mappings merge into one already there."""
    *parents, leaf = dotted.split(".")
    node = values
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(node.get(leaf), dict) and isinstance(value, dict):
        for key, item in value.items():
            _put(node[leaf], str(key), item)
    else:
        node[leaf] = value


def _leaves(value: Any, prefix: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    return [prefix]


# -- the rewrite -------------------------------------------------------------------------------------

def migrate_recipe(seed: Mapping[str, Any], pm: Any) -> Migration:
    """The nexrl recipe for a composed seed recipe (no defaults list), with every change listed.
    Paths are left as written (:func:`migrate_file` places them)."""
    recipe: dict[str, Any] = _numbers(copy.deepcopy(dict(seed)))
    out = Migration(recipe)
    ctx = _Context(pm, recipe)
    moved: dict[str, str] = {}      # seed key -> nexrl key, for ${...} references
    dropped: dict[str, Any] = {}    # seed key -> value, for ${...} references to it
    _train_service_groups(recipe, out, moved)
    original = copy.deepcopy(recipe)  # the seed, its train services named as nexrl's (what conversions read)

    def move(rule: KeyRule, targets: dict[str, Any]) -> None:
        value = _pop(recipe, rule.seed)
        if rule.convert is None:
            targets = {str(rule.nexrl): value}
        for key in targets:  # nexrl's key referring to the seed's (weight.validate_freq: ${validate.eval...})
            current = get_key(recipe, key)
            ref = _REFERENCE.fullmatch(current) if isinstance(current, str) else None
            if (ref and (_target(ref.group(1), moved) or ref.group(1)) == rule.seed) or \
                    (key in rule.replaces and _has(recipe, key)):
                _pop(recipe, key)
        clashes = [c for key, item in targets.items() if (c := _clash(recipe, key, item)) is not None]
        if clashes:
            out.changes.append(Change("dropped", rule.seed, why=f"{'; '.join(clashes)} (kept)"))
            dropped[rule.seed] = value
            return
        for key, item in targets.items():
            _put(recipe, key, item)
        shown = [key for key in targets if key != rule.seed]  # data_config keeps what does not move up
        if shown or not targets:
            out.changes.append(Change("moved", rule.seed, ", ".join(shown) or rule.nexrl, rule.why))
        if len(shown) == 1:
            moved[rule.seed] = shown[0]

    for rule in KEY_RULES:  # plain moves: sections first, in table order
        if rule.convert is None and rule.nexrl is not None and _has(recipe, rule.seed):
            move(rule, {})
    for vrule in VALUE_RULES:
        if _has(recipe, vrule.key) and get_key(recipe, vrule.key) == vrule.seed and \
                (vrule.when is None or vrule.when(original, ctx)):
            _put(recipe, vrule.key, vrule.nexrl)
            out.changes.append(Change("value", f"{vrule.key}: {vrule.seed}", str(vrule.nexrl), vrule.why))
    _weight_backend(recipe, original, out, ctx, moved)
    for rule in KEY_RULES:  # values that need converting
        if rule.convert is None or not _has(recipe, rule.seed):
            continue
        result = rule.convert(_deref(get_key(recipe, rule.seed), original), original, ctx)
        if isinstance(result, str):
            dropped[rule.seed] = _pop(recipe, rule.seed)
            out.changes.append(Change("dropped", rule.seed, why=result))
        else:
            move(rule, result)
    _derive(recipe, original, out, ctx, moved)
    _follow_references(recipe, moved, dropped)
    for _ in range(3):  # a reference to a key dropped as unknown takes its value: check again
        newly = _drop_rejected(recipe, out, pm, moved, original)
        if not newly:
            break
        dropped.update(newly)
        _follow_references(recipe, moved, dropped)
    _break_loops(recipe, out)
    _settle_moves(recipe, out)
    _adjust(recipe, out, pm)
    _order(recipe)
    return out


def _settle_moves(recipe: dict[str, Any], out: Migration) -> None:
    """A seed key moved to several nexrl keys that were all taken out again is listed as not
    carried over, with their reason."""
    dropped = [c for c in out.changes if c.kind == "dropped"]
    for change in [c for c in out.changes if c.kind == "moved" and c.nexrl and ", " in c.nexrl]:
        targets = change.nexrl.split(", ") if change.nexrl else []
        if not all(re.fullmatch(r"[\w.]+", t) and not _has(recipe, t) for t in targets):
            continue
        why = next((d.why for t in targets for d in dropped if d.seed == t or d.seed.endswith(f"(as {t})")),
                   "the keys it became were taken out")
        out.changes[out.changes.index(change)] = Change("dropped", f"{change.seed} (as {change.nexrl})", why=why)


def _numbers(value: Any) -> Any:
    """Strings NexRL's loader (OmegaConf's) reads as numbers, as numbers: ``lr: 2e-6``."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, str) and _EXPONENT.match(value):
        return float(value.replace("_", ""))
    return value


def _deref(value: Any, seed: Mapping[str, Any]) -> Any:
    """A value that is only a reference to another key of the seed (``${trainer.x}``), as that
    key's value (what a conversion reads); anything else as it is."""
    for _ in range(5):
        whole = _REFERENCE.fullmatch(value) if isinstance(value, str) else None
        if whole is None or not _has(seed, whole.group(1)):
            return value
        value = get_key(seed, whole.group(1))
    return value


def _train_service_groups(recipe: dict[str, Any], out: Migration, moved: dict[str, str]) -> None:
    """NexRL 1.x names each train service (``service.train_service.main_actor``, ``.student``,
    ``.teacher``, each with a ``role``): the one with role actor becomes the train service, one with
    role teacher the reference service (the teacher of on-policy distillation)."""
    train = get_key(recipe, "service.train_service")
    if not isinstance(train, dict):
        return
    groups = {name: body for name, body in train.items() if isinstance(body, dict) and
              ("role" in body or ("identifier" in body and ("actor" in body or "config" in body)))}
    policy = None
    for name, body in groups.items():
        del train[name]
        role = body.get("role", "actor")
        if role == "teacher":
            model = body.get("model_path") or get_key(body, "actor.model.path")
            rest = [leaf for leaf in _leaves(body, "") if leaf.lstrip(".") != "model_path"]
            reference = {"backend": "hf", "model_path": model}
            _put(recipe, "service.reference_service", reference)
            moved[f"service.train_service.{name}.model_path"] = "service.reference_service.model_path"
            out.changes.append(Change("moved", f"service.train_service.{name} (role teacher)",
                                      "service.reference_service: {backend: hf, model_path}",
                                      "the teacher only scores the student's tokens: an inference backend of its "
                                      "own (hf: in this process)"))
            shown = ", ".join(leaf.lstrip(".") for leaf in rest[:6]) + (", ..." if len(rest) > 6 else "")
            out.changes.append(Change("dropped", f"service.train_service.{name} ({shown})",
                                      why="the teacher's train service settings: it is not trained"))
            continue
        if role != "actor" or policy:
            out.changes.append(Change("dropped", f"service.train_service.{name}",
                                      why=f"role {role!r}: one policy per run (the train service with role actor)"))
            continue
        policy = name
        for key, value in body.items():
            if key in train and train[key] != value:
                out.changes.append(Change("dropped", f"service.train_service.{name}.{key}",
                                          why=f"service.train_service.{key} is already {train[key]!r} (kept)"))
            else:
                train[key] = value
        moved[f"service.train_service.{name}"] = "service.train_service"
        out.changes.append(Change("moved", f"service.train_service.{name}", "service.train_service",
                                  "NexRL 1.x names each train service; the one with role actor trains the policy"))


def _weight_backend(recipe: dict[str, Any], original: Mapping[str, Any], out: Migration, ctx: _Context,
                    moved: dict[str, str]) -> None:
    """weight.backend from the inference backend (NexRL's weight.sync_method is read no further);
    an inference service for a trainer that pushes weights and has none; vLLM's url for SGLang's
    base_url."""
    trainer = str(get_key(recipe, "trainer.type"))
    if ctx.pushes_weights(trainer) and not isinstance(get_key(recipe, "service.inference_service"), Mapping) \
            and ctx.registered("inference_backend", "hf"):
        if not isinstance(recipe.get("service"), dict):
            recipe["service"] = {}
        recipe["service"]["inference_service"] = {"backend": "hf", "model_path": "${service.train_service.model_path}"}
        out.changes.append(Change(
            "set", "service.inference_service", "{backend: hf, model_path: ${service.train_service.model_path}}",
            f"trainer {trainer} pushes the trained weights to an inference service, which NexRL's recipe has none "
            f"of (its worker samples nothing): the in-process engine takes them"))
    backend = get_key(recipe, "service.inference_service.backend")
    if backend == "vllm" and get_key(original, "service.inference_service.backend") == "sglang" and \
            _has(recipe, "service.inference_service.base_url") and \
            get_key(recipe, "service.inference_service.url") is None:
        _put(recipe, "service.inference_service.url", _pop(recipe, "service.inference_service.base_url"))
        moved["service.inference_service.base_url"] = "service.inference_service.url"
        out.changes.append(Change("moved", "service.inference_service.base_url", "service.inference_service.url",
                                  "the vLLM server nexrl attaches to (it must be vLLM, with its weight routes: "
                                  "docs/vllm.md)"))
    weight = WEIGHT_BACKENDS.get(str(backend))
    method = get_key(recipe, "weight.sync_method")
    if get_key(recipe, "weight.backend") is not None or not weight or \
            weight not in ctx.pm.components("weight_sync_backend"):
        return
    _put(recipe, "weight.backend", weight)
    if method is None:
        out.changes.append(Change("set", "weight.backend", weight, f"inference backend {backend}"))
        return
    _pop(recipe, "weight.sync_method")
    why = {("disk", "vllm_disk"): "the trainer writes the weights to weight.sync_dir and the server reloads them, "
                                  "as NexRL's disk sync did",
           ("network", "vllm_disk"): "NexRL's network sync needs its internal north_checkpoint package; its disk "
                                     "sync is the open-source counterpart",
           ("tinker", "tinker"): "the trainer hands the rollouts a sampler of the new weights"}.get(
        (str(method), weight), f"inference backend {backend}" + (": no files are written" if weight == "in_process"
                                                                 else ""))
    out.changes.append(Change("moved", f"weight.sync_method: {method}", f"weight.backend: {weight}", why))


def _scoring(recipe: dict[str, Any], original: Mapping[str, Any], out: Migration, ctx: _Context) -> None:
    """Where the recipe names no evaluator and NexRL's built-in worker scored the responses itself
    (migration_table.SCORINGS): the evaluator that scores them the same way on NexRL's rows."""
    seed_type = get_key(original, "rollout_worker.type")
    agent = seed_type == "agent" and get_key(original, "rollout_worker.agent_cls") in (None, "single_turn_math")
    kind = "single_turn_math" if agent else seed_type
    scoring = next((s for s in SCORINGS if s.worker == kind), None)
    if scoring is None or get_key(recipe, "rollout_worker.evaluator") is not None or \
            get_key(recipe, "rollout_worker.type") != "simple":
        return
    seed = "rollout_worker.agent_cls single_turn_math" if agent else f"rollout_worker.type {seed_type}"
    name = str(scoring.nexrl["type"])
    options = {k: v for k, v in scoring.nexrl.items() if k != "type"}
    if scoring.cut_off is not None and get_key(recipe, "algorithm.reward_processing.overlong") is None and \
            _algorithm_declares(recipe, ctx, "reward_processing"):
        _put(recipe, "algorithm.reward_processing.overlong", "score")
        _put(recipe, "algorithm.reward_processing.overlong_reward", scoring.cut_off)
        out.changes.append(Change("set", "algorithm.reward_processing.overlong", f"score, overlong_reward "
                                  f"{scoring.cut_off:g}", f"{seed}: NexRL gave a response cut off at max_tokens "
                                                          f"(finish_reason length) {scoring.cut_off:g}, whatever it "
                                                          f"answered"))
    if ctx.declares("evaluator", name, *options):
        _put(recipe, "rollout_worker.evaluator", copy.deepcopy(scoring.nexrl))
        shown = ", ".join(f"{k} {_shown_value(v)}" for k, v in options.items())
        out.changes.append(Change("set", "rollout_worker.evaluator", f"{name}, {shown}",
                                  f"{seed}: NexRL scored {scoring.how}; the rows stay as they are"))
    elif scoring.worker == "single_turn_math" and ctx.declares("evaluator", "numeric_answer", "answer_key"):
        _put(recipe, "rollout_worker.evaluator", {"type": "numeric_answer", "answer_key": NEXRL_ANSWER})
        out.changes.append(Change("set", "rollout_worker.evaluator", f"numeric_answer, answer_key {NEXRL_ANSWER}",
                                  f"{seed}: the reply's last number, not NexRL's scoring ({scoring.how}), which "
                                  f"math_rule of nexrl-rewards does (pip install nexrl-rewards, migrate again)"))
    else:
        out.changes.append(Change("dropped", f"{seed} (its scoring)",
                                  why=f"NexRL scored {scoring.how}; no evaluator here does (evaluator {name} with "
                                      f"{', '.join(options)}): set rollout_worker.evaluator"))


def _shown_value(value: Any) -> str:
    """A value as the recipe's YAML writes it, in a report line (a list: its items)."""
    if isinstance(value, list):
        return " ".join(_shown_value(v) for v in value)
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _algorithm_declares(recipe: Mapping[str, Any], ctx: _Context, key: str) -> bool:
    """The recipe's trainer (with the functions its algorithm section selects) reads ``algorithm.<key>``."""
    from ..algorithms.registry import algorithm_keys

    name = get_key(recipe, "trainer.type")
    registered = ctx.pm.components("trainer").get(str(name))
    if registered is None:
        return False
    section = get_key(recipe, "algorithm")
    declared, _ = algorithm_keys(registered.cls, section if isinstance(section, Mapping) else {}, ctx.pm, str(name))
    return key in declared


def _derive(recipe: dict[str, Any], original: Mapping[str, Any], out: Migration, ctx: _Context,
            moved: dict[str, str]) -> None:
    """The nexrl keys the seed's recipe leaves to the rest of it (migration_table.DERIVED)."""
    _model_named_once(recipe, out, ctx, moved)
    if get_key(recipe, "service.inference_service.backend") == "tinker":
        _tinker_services(recipe, original, out, ctx, moved)
    _scoring(recipe, original, out, ctx)
    prompt_key = get_key(recipe, "data.prompt_key")
    worker = get_key(recipe, "rollout_worker.type") or "simple"
    if isinstance(prompt_key, str) and prompt_key != "prompt" and \
            get_key(recipe, "rollout_worker.prompt_key") is None and \
            ctx.registered("rollout_worker", str(worker)) and ctx.declares("rollout_worker", str(worker), "prompt_key"):
        _put(recipe, "rollout_worker.prompt_key", prompt_key)
        out.changes.append(Change("set", "rollout_worker.prompt_key", prompt_key,
                                  "data.prompt_key: the worker reads the prompt from that field"))
    if worker == "pig_latin" and get_key(recipe, "rollout_worker.target_key") is None and \
            ctx.declares("rollout_worker", "pig_latin", "target_key"):
        _put(recipe, "rollout_worker.target_key", "output")
        out.changes.append(Change("set", "rollout_worker.target_key", "output",
                                  "NexRL's pig_latin worker trains on each row's output field"))


def _train_service_name(recipe: Mapping[str, Any], ctx: _Context) -> str | None:
    trainer = ctx.pm.components("trainer").get(str(get_key(recipe, "trainer.type")))
    name = get_key(recipe, "service.train_service.backend") or \
        (getattr(trainer.cls, "TRAIN_SERVICE_DEFAULT", None) if trainer is not None else None)
    return str(name) if name else None


def _model_named_once(recipe: dict[str, Any], out: Migration, ctx: _Context, moved: dict[str, str]) -> None:
    """NexRL names the model for its server (service.inference_service.model_path) and points its
    trainer there: nexrl's recipe names it once too."""
    inference = "${service.inference_service.model_path}"
    model = get_key(recipe, "service.inference_service.model_path")
    service = _train_service_name(recipe, ctx)
    if not model or not service or not ctx.declares("train_service", service, "model_path"):
        return
    train = get_key(recipe, "service.train_service.model_path")
    if train not in (None, inference, model):
        return  # two models: both kept as written
    backend = str(get_key(recipe, "service.inference_service.backend"))
    loads = ctx.declares("inference_backend", backend, "model_path") and \
        get_key(recipe, "service.inference_service.url") is None
    if loads:  # the engine loads the model itself: the train service names it by reference
        if train != inference:
            _put(recipe, "service.train_service.model_path", inference)
            out.changes.append(Change("set", "service.train_service.model_path", inference,
                                      "the model is named once (service.inference_service.model_path)"))
        return
    _put(recipe, "service.train_service.model_path", _pop(recipe, "service.inference_service.model_path"))
    moved["service.inference_service.model_path"] = "service.train_service.model_path"
    out.changes.append(Change("moved", "service.inference_service.model_path", "service.train_service.model_path",
                              f"the model is named once, where it trains: the {backend} server serves it "
                              f"(service.inference_service.model names it there)"))


def _tinker_services(recipe: dict[str, Any], original: Mapping[str, Any], out: Migration, ctx: _Context,
                     moved: dict[str, str]) -> None:
    """NexRL's Tinker layout names the model in service.inference_service.model and the tokenizer
    by that name; nexrl's trains base_model and tokenizes from a local folder."""
    service = _train_service_name(recipe, ctx)
    model = get_key(recipe, "service.inference_service.model")
    if service == "tinker" and model and get_key(recipe, "service.train_service.base_model") is None and \
            not ctx.declares("inference_backend", "tinker", "model"):
        _put(recipe, "service.train_service.base_model", _pop(recipe, "service.inference_service.model"))
        moved["service.inference_service.model"] = "service.train_service.base_model"
        out.changes.append(Change("moved", "service.inference_service.model", "service.train_service.base_model",
                                  "the Tinker model is named once, where it trains (the tinker weight sync hands "
                                  "the rollouts its sampler)"))
    if get_key(recipe, "service.inference_service.tokenizer_path") is None and \
            get_key(recipe, "service.inference_service.model_path") is None:
        named = next((v for key in ("data.tokenizer_path", "rollout_worker.tokenizer", "service.inference_service.tokenizer")
                      if isinstance(v := _deref(get_key(original, key), original), str) and v), None)
        local = named if named and (os.path.isabs(named) or named.startswith(".") or _ENV.search(named)) else None
        _put(recipe, "service.inference_service.tokenizer_path", local or "???")
        why = (f"from {named}" if local else
               f"nexrl tokenizes prompts here, from a local folder with {named or 'the model'}'s tokenizer (NexRL "
               f"fetched it by name): set it, e.g. service.inference_service.tokenizer_path=/path on the command line")
        out.changes.append(Change("set", "service.inference_service.tokenizer_path", local or "???", why))
    for key in ("api_key", "base_url"):
        if get_key(recipe, f"service.train_service.{key}") is not None and \
                get_key(recipe, f"service.inference_service.{key}") is None:
            _put(recipe, f"service.inference_service.{key}", "${service.train_service." + key + "}")
            out.changes.append(Change("set", f"service.inference_service.{key}",
                                      "${service.train_service." + key + "}",
                                      "the rollouts' sampling client and the train service share it"))


def _follow_references(recipe: dict[str, Any], moved: dict[str, str], dropped: dict[str, Any]) -> None:
    """In place: ``${old.key}`` -> ``${new.key}``; a value that is only a reference to a dropped
    key becomes that key's value. ``${oc.env:...}`` and other resolvers are left alone."""

    def target(key: str) -> str | None:
        return _target(key, moved)

    def dropped_value(name: str) -> tuple[bool, Any]:
        """(found, value) of a key taken out, itself or inside a section taken out."""
        for key in sorted(dropped, key=len, reverse=True):
            if name == key:
                return True, dropped[key]
            if name.startswith(key + ".") and _has(dropped[key], name[len(key) + 1:]):
                return True, get_key(dropped[key], name[len(key) + 1:])
        return False, None

    def rewrite(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: rewrite(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rewrite(v) for v in value]
        for _ in range(5):  # a dropped value may itself be a reference
            if not isinstance(value, str) or "${" not in value:
                return value
            whole = _REFERENCE.fullmatch(value)
            name = (target(whole.group(1)) or whole.group(1)) if whole else ""
            if whole and not _has(recipe, name):
                found, taken = dropped_value(name)
                if not found and name != whole.group(1):
                    found, taken = dropped_value(whole.group(1))
                if found:
                    value = taken
                    continue
            return _REFERENCE.sub(lambda m: "${" + (target(m.group(1)) or m.group(1)) + "}", value)
        return value

    recipe.update(rewrite(recipe))


def _target(key: str, moved: Mapping[str, str]) -> str | None:
    """Where a seed key went (None: it did not move); a key may have moved twice (a train service's
    section, then its key)."""
    found = None
    for _ in range(5):
        for seed, nexrl in sorted(moved.items(), key=lambda kv: -len(kv[0])):
            if key == seed or key.startswith(seed + "."):
                key = found = nexrl + key[len(seed):]
                break
        else:
            break
    return found


def _break_loops(recipe: dict[str, Any], out: Migration) -> None:
    """Take out each key whose value is only a reference that leads back to itself (a loop NexRL's
    own recipe holds and never resolves, e.g. two max_prompt_length naming each other)."""
    for key in _leaves(recipe, "")[:]:
        key = key.lstrip(".")
        seen = [key]
        value = get_key(recipe, key)
        while isinstance(value, str) and (whole := _REFERENCE.fullmatch(value)) and whole.group(1) not in seen:
            seen.append(whole.group(1))
            value = get_key(recipe, whole.group(1))
        if isinstance(value, str) and (whole := _REFERENCE.fullmatch(value)) and whole.group(1) in seen and \
                _has(recipe, key):
            _pop(recipe, key)
            out.changes.append(Change("dropped", key, why=f"a reference loop ({' -> '.join(seen + [whole.group(1)])}): "
                                                          f"it has no value"))


def _drop_rejected(recipe: dict[str, Any], out: Migration, pm: Any, moved: Mapping[str, str],
                   original: Mapping[str, Any]) -> dict[str, Any]:
    """Take out every key ``nexrl validate`` rejects as unknown (or no longer read), each listed
    with the table's reason, else the check's words (a key moved here is listed under its seed
    name, and no longer as carried over). Returns the keys taken out and their values."""
    from ..launch.recipe import check_config

    taken: dict[str, Any] = {}
    for _ in range(8):  # a key taken out can change what its section's component accepts
        rejected = [(m["key"], m["why"]) for p in check_config(_checked_as(recipe, original, pm), pm)
                    if (m := _REJECTED.match(p))]
        rejected = [(k, w) for k, w in rejected if _has(recipe, k)]
        if not rejected:
            break
        for key, check_why in rejected:
            taken[key] = value = _pop(recipe, key)
            origin = next((seed for seed, nexrl in moved.items() if nexrl == key), None)
            inner = {nexrl: seed for seed, nexrl in moved.items() if nexrl.startswith(key + ".")}
            gone = {origin} if origin is not None else set(inner.values())
            out.changes = [c for c in out.changes if not (c.kind == "moved" and c.seed in gone)]
            if origin is None and inner and isinstance(value, dict):  # keys moved into a rejected section
                value = copy.deepcopy(value)
                why = _reasons(key, None, check_why)[0][1]
                for leaf, seed in inner.items():
                    if _has(value, leaf[len(key) + 1:]):
                        _pop(value, leaf[len(key) + 1:])
                        out.changes.append(Change("dropped", f"{seed} (as {leaf})", why=why))
                if not value:
                    continue
            for leaf, why in _reasons(key, value, check_why):
                out.changes.append(Change("dropped", f"{origin} (as {leaf})" if origin else leaf, why=why))
    return taken


def _checked_as(recipe: dict[str, Any], original: Mapping[str, Any], pm: Any) -> dict[str, Any]:
    """The recipe as its keys are checked: a worker class of the seed's own (``type: python``)
    that does not load here (it still imports NexRL) is checked as the worker it extends, the
    seed's ``rollout_worker.type``, so the keys that worker rejects are found."""
    worker = recipe.get("rollout_worker")
    base = get_key(original, "rollout_worker.type")
    if not isinstance(worker, dict) or worker.get("type") != "python" or base not in pm.components("rollout_worker"):
        return recipe
    try:
        pm.resolve_section("rollout_worker", worker, "rollout_worker")
        return recipe  # it loads: its own declarations decide
    except Exception:  # noqa: BLE001 - any failure to load the class: check it as the worker it extends
        view = dict(recipe)
        view["rollout_worker"] = {k: v for k, v in worker.items() if k not in ("path", "class")} | {"type": base}
        return view


def _adjust(recipe: dict[str, Any], out: Migration, pm: Any) -> None:
    """A value nexrl refuses becomes the nearest one it accepts (migration_table.ADJUSTMENTS), with
    one line saying what changed and why."""
    from ..launch.recipe import check_config

    problems = check_config(recipe, pm)
    for rule in ADJUSTMENTS:
        if _has(recipe, rule.key) and any(re.search(rule.problem, p) for p in problems):
            old = _pop(recipe, rule.key)
            _put(recipe, rule.key, rule.nexrl)
            out.changes.append(Change("changed", f"{rule.key}: {old}", str(rule.nexrl), rule.why))


def _reasons(key: str, value: Any, check_why: str) -> list[tuple[str, str]]:
    """One line per rejected key: the table's reason for it, else per inner key the table knows,
    else the check's words."""
    rule = rule_for(key)
    if rule is not None and rule.nexrl is None:
        inner = [leaf[len(key) + 1:] for leaf in _leaves(value, key) if leaf != key]
        return [(f"{key} ({', '.join(inner[:6])}{', ...' if len(inner) > 6 else ''})" if inner else key, rule.why)]
    if isinstance(value, dict) and any(r.seed.startswith(key + ".") for r in KEY_RULES):
        # the inner keys the table has no rule for share the section's reason (a known section nexrl
        # refuses, e.g. kl_ctrl without use_kl_in_reward, is not an unknown key)
        return [pair for k, v in value.items() for pair in _reasons(f"{key}.{k}", v, check_why)]
    why = check_why.split(" (nexrl migrate")[0]
    if why.startswith("expected a mapping, got null"):
        return [(key, "null: nexrl's defaults apply")]
    if why.startswith("unknown key"):
        why = "unknown key in nexrl" + why[len("unknown key"):].split("; a NexRL")[0].split("; a ROLL")[0]
    return [(key, why)]


def _order(recipe: dict[str, Any]) -> None:
    """Top-level keys in the order of nexrl's reference (docs/recipe.md)."""
    from ..config.schema import CORE_OPTIONS

    rank = {key: i for i, key in enumerate(CORE_OPTIONS)}
    items = sorted(recipe.items(), key=lambda kv: rank.get(str(kv[0]), len(rank)))
    recipe.clear()
    recipe.update(items)


# -- files -------------------------------------------------------------------------------------------

def compose_file(path: str) -> dict[str, Any]:
    """The recipe file with its defaults list merged in (as ``nexrl run`` composes it)."""
    from ..errors import ConfigError
    from ..launch.compose import Composer, deep_merge, read_yaml_file

    if not os.path.isfile(path):
        raise ConfigError(f"{path}: recipe file not found")
    raw = read_yaml_file(path)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: a recipe must be a mapping of keys")
    recipe: Any = {}
    for layer in Composer(path, []).layers(raw):
        recipe = deep_merge(recipe, layer)
    return recipe


def migrate_file(path: str, out_path: str, pm: Any, copy_code: bool = True) -> Migration:
    """:func:`migrate_recipe` of the file, with relative paths that name files next to it (or under
    ``$NEXRL_PATH``, where NexRL looked) rewritten for ``out_path``'s folder, and its Python files'
    imports of NexRL listed."""
    seed = compose_file(path)
    migration = migrate_recipe(seed, pm)
    seed_dir = os.path.dirname(os.path.abspath(path))
    out_dir = os.path.dirname(os.path.abspath(out_path))
    roots = [seed_dir, os.environ.get("NEXRL_PATH") or ""]
    found = _place_paths(migration.recipe, roots, out_dir, pm)
    for file in _python_files(found):
        lines = import_lines(file, out_dir)
        migration.imports += lines
        if any(": from nexrl" in line or ": import nexrl" in line for line in lines):
            migration.import_files.add(os.path.abspath(file))
    migration.notes += _setup_script(seed, roots, out_dir)
    _plan_copy(migration, seed_dir, out_path, copy_code)
    return migration


# -- the workspace's Python files --------------------------------------------------------------------

COPY_MARKER = ".nexrl-migrate"  # in a copy folder nexrl migrate wrote (and may replace with --force)
_COPY_LIMITS = (2000, 64 << 20)  # files, bytes: a larger workspace is left for --code DIR --write
_SKIPPED = shutil.ignore_patterns(".*", "__pycache__", "*.pyc")


def _plan_copy(migration: Migration, seed_dir: str, out_path: str, copy_code: bool) -> None:
    """Which folders next to the seed recipe the new recipe should use copies of: each top-level
    folder holding a named Python file that imports NexRL (the NexAU ``agent_workspace/``, whole:
    its YAML files name each other by relative paths), and the ``.py`` files beside the recipe
    when one of those does. A file elsewhere is left for ``nexrl migrate --code``."""
    if not migration.import_files:
        return
    units: dict[str, None] = {}
    outside: dict[str, None] = {}
    for file in sorted(migration.import_files):
        rel = os.path.relpath(file, seed_dir)
        if rel.startswith(os.pardir + os.sep):
            outside[os.path.dirname(file)] = None
        elif os.sep not in rel:  # beside the recipe: with the modules it may import from there
            units.update((os.path.join(seed_dir, n), None) for n in sorted(os.listdir(seed_dir)) if n.endswith(".py"))
        else:
            units[os.path.join(seed_dir, rel.split(os.sep)[0])] = None
    out_dir = os.path.dirname(os.path.abspath(out_path))
    stem = os.path.splitext(os.path.basename(out_path))[0]
    folder = os.path.join(out_dir, f"{stem}_workspace")
    migration.code_left += [f"nexrl migrate --code {os.path.relpath(d)} --write  (rewrites the files there in "
                            f"place; they are not beside the recipe, so no copy is made)" for d in outside]
    if not units:
        return
    files = size = 0
    for unit in units:
        for where, dirs, names in os.walk(unit) if os.path.isdir(unit) else [("", [], [unit])]:
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            files += len(names)
            size += sum(os.path.getsize(os.path.join(where, n)) for n in names)
    too_large = f"{files} files, {size >> 20} MiB" if files > _COPY_LIMITS[0] or size > _COPY_LIMITS[1] else ""
    if copy_code and not too_large:
        migration.copy = WorkspaceCopy(folder, [(u, os.path.join(folder, os.path.basename(u))) for u in units])
        return
    where = " ".join(os.path.relpath(u) for u in units)
    why = f"the workspace is too large to copy ({too_large})" if too_large else \
        "the recipe goes to stdout (with -o NEW.yaml, migrate copies them next to it with the imports rewritten)"
    migration.code_left.append(f"nexrl migrate --code {where} --write  (rewrites the originals in place; {why})")


def write_copy(migration: Migration, out_path: str, force: bool) -> list[str]:
    """Copy :attr:`Migration.copy`'s folders next to the new recipe, rewrite the NexRL imports of
    the copies (:mod:`.migrate_code`), point the recipe at them. Returns the report's lines. A
    folder of that name is replaced only with ``force`` and only when nexrl migrate wrote it."""
    from ..errors import ConfigError
    from .migrate_code import migrate_code

    plan = migration.copy
    if plan is None:
        return []
    shown = os.path.relpath(plan.folder)
    if os.path.lexists(plan.folder):
        if not os.path.isfile(os.path.join(plan.folder, COPY_MARKER)):
            raise ConfigError(f"-o: the copy of the workspace goes to '{shown}', which exists and was not written "
                              f"by nexrl migrate; move it, or write the recipe elsewhere")
        if not force:
            raise ConfigError(f"-o: '{shown}' (the copy of the workspace) exists (--force replaces it)")
    out_dir = os.path.dirname(plan.folder)
    os.makedirs(out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".nexrl-migrate-", dir=out_dir)
    staging = os.path.join(scratch, "copy")  # made by mkdir: the umask's permissions, not mkdtemp's 0700
    try:
        os.mkdir(staging)
        for original, copy_ in plan.units:
            target = os.path.join(staging, os.path.basename(copy_))
            if os.path.isdir(original):
                shutil.copytree(original, target, ignore=_SKIPPED, symlinks=True)
            else:
                shutil.copy2(original, target)
        with open(os.path.join(staging, COPY_MARKER), "w", encoding="utf-8") as f:
            f.write("written by nexrl migrate: copies of the NexRL recipe's workspace, imports rewritten for "
                    "nexrl; nexrl migrate --force replaces this folder\n")
        files, _, _ = migrate_code(staging, apply=True)
        if os.path.lexists(plan.folder):
            shutil.rmtree(plan.folder)
        os.replace(staging, plan.folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _repoint(migration.recipe, out_dir, plan.units)
    migration.import_files = {os.path.join(plan.folder, r.shown) for r in files
                              if r.names_nexrl and (r.by_hand or r.not_parsed)}
    lines = [f"{os.path.relpath(o)} -> {os.path.relpath(c)}" for o, c in plan.units]
    for rewrite in files:
        where = os.path.join(shown, rewrite.shown)
        if rewrite.rewritten:
            lines.append(f"{where}: {rewrite.rewritten} imported name{'s' if rewrite.rewritten != 1 else ''} "
                         f"rewritten")
        migration.code_left += [f"{where}:{item}" for item in rewrite.by_hand]
        if rewrite.not_parsed and rewrite.names_nexrl:
            migration.code_left.append(f"{where}: {rewrite.not_parsed}; it imports NexRL: change its imports by hand")
    return lines


def _repoint(recipe: dict[str, Any], out_dir: str, units: list[tuple[str, str]]) -> None:
    """In place: each path of the recipe (relative to ``out_dir``, or ``${recipe_dir}/...``) that
    names a file inside an original of ``units`` names its copy instead."""
    prefix = "${recipe_dir}/"

    def moved(value: str) -> str:
        head = prefix if value.startswith(prefix) else ""
        rest = value[len(head):]
        if not rest or "${" in rest or "://" in rest:
            return value
        full = os.path.normpath(rest if os.path.isabs(rest) else os.path.join(out_dir, rest))
        for original, copy_ in units:
            if full == original or full.startswith(original + os.sep):
                new = copy_ + full[len(original):]
                return head + (new if os.path.isabs(rest) else os.path.relpath(new, out_dir))
        return value

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return moved(node) if isinstance(node, str) else node

    recipe.update(walk(recipe))


_EXPORT = re.compile(r"^\s*export\s+([A-Za-z_]\w*)=", re.MULTILINE)


def _setup_script(seed: Mapping[str, Any], roots: list[str], out_dir: str) -> list[str]:
    """NexRL's ``environment.setup_script`` (``self_hosted.env.sh``): sourced by NexRL's launcher
    before the run; nexrl reads the environment it is started in, so the user sources it."""
    script = get_key(seed, "environment.setup_script")
    if not isinstance(script, str) or not script:
        return []
    where = next((os.path.join(root, script) for root in [*roots, os.getcwd()]
                  if root and os.path.isfile(os.path.join(root, script))), None)
    if where is None:
        return [f"before nexrl run, set what NexRL's environment.setup_script {script} set (not found next to the "
                f"recipe)"]
    with open(where, encoding="utf-8", errors="replace") as f:
        names = list(dict.fromkeys(_EXPORT.findall(f.read())))
    exports = f" (it exports {', '.join(names)})" if names else ""
    return [f"before nexrl run, source {os.path.relpath(where, out_dir)}{exports}: NexRL's launcher sourced this "
            f"environment.setup_script; nexrl reads the environment it is started in"]


def _place_paths(recipe: dict[str, Any], roots: list[str], out_dir: str, pm: Any) -> list[str]:
    """In place: each relative path found under one of ``roots`` becomes relative to ``out_dir``.
    Returns the Python files the recipe names and the NexAU workspace folder (absolute)."""
    from ..launch.recipe import resolve_recipe_paths

    resolved = copy.deepcopy(recipe)
    for root in roots:
        if root:
            resolve_recipe_paths(resolved, root, pm=pm)
    _nexau_paths(resolved, roots)
    found: list[str] = []

    def walk(node: Any, done: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, done.get(k) if isinstance(done, dict) else None) for k, v in node.items()}
        if isinstance(node, list):
            items = done if isinstance(done, list) and len(done) == len(node) else [None] * len(node)
            return [walk(v, d) for v, d in zip(node, items)]
        if isinstance(node, str) and isinstance(done, str) and done != node and os.path.isabs(done):
            found.append(done)
            return os.path.relpath(done, out_dir)
        if isinstance(node, str) and node.endswith(".py") and os.path.isfile(node):
            found.append(os.path.abspath(node))
        return node

    recipe.update(walk(recipe, resolved))
    worker = recipe.get("rollout_worker")
    for key in _NEXAU_PATHS:
        done = get_key(resolved, f"rollout_worker.{key}")
        if not isinstance(worker, dict):
            break
        if isinstance(done, str) and os.path.isabs(done) and worker.get(key) == os.path.relpath(done, out_dir):
            # the worker reads them as given (from the current folder): next to the recipe, by ${recipe_dir}
            worker[key] = "${recipe_dir}/" + worker[key]
    workspace = get_key(resolved, "rollout_worker.nexau_agent_workspace")
    return [p for p in found if p.endswith(".py")] + ([workspace] if isinstance(workspace, str) else [])


_NEXAU_PATHS = ("nexau_agent_config_path", "nexau_agent_workspace")


def _nexau_paths(resolved: dict[str, Any], roots: list[str]) -> None:
    """The NexAU worker's files (its agent YAML, its workspace), as NexRL resolved them."""
    worker = resolved.get("rollout_worker")
    if not isinstance(worker, dict):
        return
    for key in _NEXAU_PATHS:
        value = worker.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value) and "${" not in value:
            for root in roots:
                if root and os.path.exists(os.path.join(root, value)):
                    worker[key] = os.path.normpath(os.path.join(root, value))
                    break


def _python_files(paths: list[str], limit: int = 500) -> list[str]:
    """The Python files among ``paths`` and in the folders among them (the NexAU workspace)."""
    files: list[str] = []
    for path in dict.fromkeys(paths):
        if os.path.isfile(path) and path.endswith(".py"):
            files.append(path)
        elif os.path.isdir(path):
            for folder, _, names in os.walk(path):
                files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
                if len(files) >= limit:
                    break
    return list(dict.fromkeys(files))[:limit]


_IMPORTS = {rule.seed.rsplit(".", 1)[1]: rule for rule in IMPORT_RULES}


def import_lines(path: str, relative_to: str = "") -> list[str]:
    """``file:line: from nexrl.x import Name -> from nexrl_core import Name`` for each import of
    NexRL's package in a Python file (migration_table.IMPORT_RULES)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
        return [f"{path}: not read ({type(exc).__name__}: {exc})"]
    shown = os.path.relpath(path, relative_to) if relative_to else path
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "nexrl" or node.module.startswith("nexrl.")):
            for alias in node.names:
                lines.append(f"{shown}:{node.lineno}: from {node.module} import {alias.name} -> "
                             f"{_replacement(alias.name)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "nexrl" or alias.name.startswith("nexrl."):
                    lines.append(f"{shown}:{node.lineno}: import {alias.name} -> the names it uses, from "
                                 f"nexrl_core (docs/migrating.md#imports-and-classes)")
    return sorted(lines, key=lambda line: int(line.split(":")[1]))


def _replacement(name: str) -> str:
    rule = _IMPORTS.get(name)
    if rule is None:
        return "no counterpart known (docs/migrating.md#imports-and-classes)"
    if rule.nexrl is None:
        return f"none: {rule.why}"
    module, new = rule.nexrl.rsplit(".", 1)
    text = f"from {module} import {new}" if new == name else f"from {module} import {new} as {name}"
    return f"{text} ({rule.why})" if rule.why else text


# -- output ----------------------------------------------------------------------------------------

def to_yaml(recipe: Mapping[str, Any], source: str, notes: list[str] | tuple[str, ...] = ()) -> str:
    import yaml

    head = f"# migrated from {source} by nexrl migrate (docs/migrating.md)\n"
    head += "".join(f"# {note}\n" for note in notes)
    return head + yaml.safe_dump(dict(recipe), sort_keys=False, allow_unicode=True, width=100)


def report(migration: Migration, copied: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The report's lines: what moved, what was set, what nexrl refused and what it became, what
    was dropped and why, the imports of NexRL (and ``copied``: the workspace copies whose imports
    were rewritten, :func:`write_copy`), what is left to rewrite, what the machine that runs it
    must do."""
    lines: list[str] = []
    sections = (("carried over", ("moved", "value")), ("set from the rest of the recipe", ("set",)),
                ("changed to a value nexrl accepts", ("changed",)), ("not carried over", ("dropped",)))
    for title, kinds in sections:
        changes = migration.of_kind(*kinds)
        if changes:
            lines.append(f"{title}:")
            lines += [f"  {c.text()}" for c in changes]
    if migration.imports:
        lines.append("imports of NexRL in the files the recipe names, and nexrl's:" if copied else
                     "imports of NexRL to change in the files the recipe names:")
        lines += [f"  {line}" for line in migration.imports]
        if not copied and not migration.code_left:
            lines.append("  (nexrl migrate --code FOLDER shows them rewritten as a diff; --write applies it)")
    if copied:
        lines.append("copied next to the new recipe, which uses the copies (the originals are unchanged):")
        lines += [f"  {line}" for line in copied]
    if migration.code_left:
        lines.append("left to rewrite:")
        lines += [f"  {line}" for line in migration.code_left]
    if migration.notes:
        lines.append("for the machine that runs it:")
        lines += [f"  {note}" for note in migration.notes]
    return lines


# -- the check ---------------------------------------------------------------------------------------

_UNSET = "/nexrl-migrate-unset"  # an unset ${oc.env:NAME} stands for itself as /nexrl-migrate-unset/NAME
_REQUIRED = f"{_UNSET}/???"  # and a '???' as this
# Problems only the machine that runs the recipe settles: its files, models and keys.
_MACHINE = (
    re.compile(r"^(validate\.)?data\.\S*: .*data file not found"),
    re.compile(r"^\S*(model_path|tokenizer_path)\S*: .*(is not a model folder|is not a folder|not found)"),
    re.compile(r"\bAPI key\b"),
    re.compile(r"a value is required here \(the recipe has '\?\?\?'\)"),
    re.compile(r"cannot resolve interpolation \(MissingMandatoryValue"),  # a reference to such a '???'
    re.compile(r"Environment variable '\w+' not found"),
)
_MISSING_MODULE = re.compile(r"importing (\S+) raised ModuleNotFoundError: No module named '([\w.]+)'")


def check_migrated(migration: Migration, placed: str, pm: Any) -> tuple[list[str], list[str]]:
    """``nexrl validate`` of the migrated recipe (written at ``placed``): (its problems, the problems
    only the machine that runs it settles). An unset ``${oc.env:NAME}`` stands for itself while it
    is checked, so the rest of the recipe is checked past it; the data files, model folders, keys
    and third-party packages the recipe needs and this machine lacks are listed apart (the files
    are checked even then, as long as only such problems were found in the keys)."""
    from ..errors import NexRLError
    from ..launch.preflight import check_files
    from ..launch.recipe import check_config, load_recipe

    unset = sorted({name for text in _strings(migration.recipe) for name in _ENV.findall(text)
                    if name not in os.environ})
    saved = {name: os.environ.get(name) for name in unset}
    os.environ.update({name: f"{_UNSET}/{name}" for name in unset})
    # a '???' (the user sets it) stands for itself too: a reference to it would stop the whole check
    required = [key for key in (leaf.lstrip(".") for leaf in _leaves(migration.recipe, "")) if
                get_key(migration.recipe, key) == "???"]
    raw = copy.deepcopy(migration.recipe)
    for key in required:
        _put(raw, key, _REQUIRED)
    try:
        cfg = load_recipe(placed, [], raw=raw)
        problems = check_config(cfg, pm)
        if all(_machine_only(p, migration) for p in problems):  # the files too, unless already said
            problems += [p for p in check_files(cfg, pm)
                         if not any(f"'{p.rsplit(': ', 1)[0]}'" in q for q in problems)]
    except NexRLError as exc:
        problems = list(getattr(exc, "problems", None) or [str(exc)])
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    machine = [f"{key}: a value is required here (the recipe has '???')" for key in required]
    machine += [_shown(p) for p in problems if _machine_only(p, migration) and _REQUIRED not in p]
    if unset:
        machine.insert(0, f"environment variables {', '.join(unset)}: not set here (the recipe reads them with "
                          f"${{oc.env:...}}; shown as $NAME below)")
    return [p for p in problems if not _machine_only(p, migration)], machine


def _machine_only(problem: str, migration: Migration) -> bool:
    if _UNSET in problem or any(pattern.search(problem) for pattern in _MACHINE):
        return True
    missing = _MISSING_MODULE.search(problem)  # a package the recipe's files import (not NexRL's, which changes)
    return missing is not None and missing.group(2).split(".")[0] != "nexrl" and \
        os.path.abspath(missing.group(1)) not in migration.import_files


def _shown(problem: str) -> str:
    return re.sub(re.escape(_UNSET) + r"/(\w+)", r"$\1", problem)


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def command(args: Any) -> int:
    """``nexrl migrate RECIPE [-o OUT] [--force]``: write the nexrl recipe (always), report, check.
    Exit 0 when the result passes ``nexrl validate`` up to what only the machine that runs it
    supplies (listed), 2 with the problems otherwise. ``--code DIR [--write]`` (with or without a
    recipe): the imports of the Python files under DIR (:mod:`.migrate_code`); exit 2 when some
    are left to change by hand."""
    from ..errors import ConfigError

    code_dir, write = getattr(args, "code", None), bool(getattr(args, "write", False))
    if args.recipe is None and code_dir is None:
        raise ConfigError("migrate: name a recipe (nexrl migrate RECIPE.yaml) or a folder of Python files "
                          "(nexrl migrate --code DIR)")
    if write and code_dir is None:
        raise ConfigError("--write: applies the rewrite of --code DIR; name the folder with --code")
    if args.recipe is not None and code_dir is not None and args.out is None:
        raise ConfigError("--code: stdout holds the diff of the Python files; write the recipe with -o")
    if args.recipe is not None:
        _check_out(args)
    status = _code_command(code_dir, write) if code_dir is not None else 0
    if args.recipe is not None:  # after --code --write: files rewritten in place need no copy
        status = max(status, _recipe_command(args))
    return status


def _check_out(args: Any) -> None:
    from ..errors import ConfigError

    out = args.out
    if out is not None:
        if os.path.abspath(out) == os.path.abspath(args.recipe):
            raise ConfigError(f"-o: '{out}' is the recipe being migrated; write the nexrl recipe to a new file")
        if os.path.exists(out) and not args.force:
            raise ConfigError(f"-o: '{out}' exists (--force replaces it)")


def _code_command(code_dir: str, write: bool) -> int:
    import sys

    from .migrate_code import migrate_code

    files, lines, status = migrate_code(code_dir, write)
    for f in files:
        if f.changed:
            sys.stdout.write(f.diff())
    for line in lines:
        print(line, file=sys.stderr)
    return status


def _recipe_command(args: Any) -> int:
    import sys

    from ..plugins import get_plugin_manager
    from ..redaction import scrub

    out = args.out
    _check_out(args)
    pm = get_plugin_manager()
    placed = out if out is not None else os.path.join(os.getcwd(), "migrated.yaml")
    migration = migrate_file(args.recipe, placed, pm, copy_code=out is not None)
    copied = write_copy(migration, placed, args.force)  # before the recipe, which then names the copies
    text = to_yaml(migration.recipe, os.path.basename(args.recipe), migration.notes)
    if out is None:
        sys.stdout.write(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    for line in [f"{args.recipe} -> {out or 'stdout'}", *report(migration, copied)]:
        print(line, file=sys.stderr)
    problems, machine = check_migrated(migration, placed, pm)
    name = out or "the result"
    if machine:
        print(f"nexrl validate {name}: {'ok, ' if not problems else ''}up to what only the machine that runs it "
              f"supplies:", file=sys.stderr)
        for line in machine:
            print(scrub(f"  {line}"), file=sys.stderr)
    if problems:
        print(f"nexrl validate {name}: {len(problems)} problem{'s' if len(problems) > 1 else ''}:", file=sys.stderr)
        for problem in problems:
            print(scrub(f"error: {problem}"), file=sys.stderr)
        return 2
    if not machine:
        print(f"nexrl validate {name}: ok", file=sys.stderr)
    return 0
