"""``instruction_following``: the reply checked against the data item's verifiable instructions.

The instructions are IFEval's kinds of verifiable constraint ("answer in fewer than 100 words",
"wrap your answer in JSON", "end with 'Any other questions?'"); each kind is a rule written here
(no model, no network). A data item lists its instructions in one of three layouts:

- nexrl's: ``instructions: [{type: number_words, relation: at least, num_words: 100}, {type: no_comma}]``
  (a kind's name alone is enough when it takes no parameters: ``instructions: [no_comma, title]``);
- IFEval's rows: ``instruction_id_list: ["length_constraints:number_words", ...]`` with the
  matching ``kwargs: [{relation: ..., num_words: ...}, ...]`` (keys whose value is None ignored);
- ROLL's (open-instruct's) ``ground_truth``: ``{"func_name": "validate_word_constraint", "N": 100,
  "quantifier": "at least"}`` (a JSON string too), with ``instructions_key: ground_truth``.

An instruction is followed *strictly* when the reply as written follows it, and *loosely* when
the reply does after a common harmless change (IFEval's loose check: without its first line,
without its last line, or both, each with and without markdown ``*``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nexrl_core import BaseEvaluationTarget, ConfigError, EvaluationRunResult, Evaluator, row_field

from .options import KEY, choice

MODES = ("strict", "loose")
REWARD_MODES = ("fraction", "all_or_nothing")

# -- counting ------------------------------------------------------------------------------------

_WORD = re.compile(r"\w+(?:['’-]\w+)*")
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s|$)")
# a period after these (or after a single capital, an initial) does not end a sentence
_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e", "fig", "approx", "dept",
                  "mt", "inc", "ltd", "cf", "al"}
_DIVIDER = re.compile(r"^[ \t]*\*[ \t]*\*[ \t]*\*[ \t]*$", re.MULTILINE)  # *** or * * * on a line of its own
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]*\S[^\[\]\n]*\]")
_BULLET = re.compile(r"^[ \t]*(?:\*(?![*\s]*$)(?!\*)|-(?![-\s]*$))[ \t]+\S", re.MULTILINE)
# *text* or **text**, markdown's emphasis: no space just inside the stars
_HIGHLIGHT = re.compile(r"\*\*(?=\S)([^\n*]+?)(?<=\S)\*\*|\*(?=\S)([^\n*]+?)(?<=\S)\*")
_TITLE = re.compile(r"<<[^\n<>]*\S[^\n<>]*>>")
_FENCED = re.compile(r"^```[ \t]*(?:json)?[ \t]*\n(.*)\n[ \t]*```$", re.DOTALL | re.IGNORECASE)


def words(text: str) -> list[str]:
    """The reply's words: runs of letters and digits, with inner apostrophes and hyphens (``don't``,
    ``well-known``: one word each)."""
    return _WORD.findall(text)


def sentences(text: str) -> list[str]:
    """The reply's sentences: ended by ``.``, ``!``, ``?`` or ``…`` before a space or the end (a lone
    ``.`` not after a common abbreviation or an initial, nor before a lowercase word), or by a blank
    line; those with no word left out."""
    out = []
    for block in _BLANK_LINE.split(text):
        start = 0
        for m in _SENTENCE_END.finditer(block):
            before = block[start:m.start()]
            last = re.search(r"([\w.]+)$", before)
            token = last.group(1).lower() if last else ""
            following = block[m.end():].lstrip()[:1]
            if m.group().startswith(".") and len(m.group().rstrip("\"'”’)]")) == 1 and (following.islower() or (
                    last and (token in _ABBREVIATIONS or (len(token) == 1 and last.group(1).isupper())))):
                continue
            out.append(block[start:m.end()])
            start = m.end()
        out.append(block[start:])
    return [s.strip() for s in out if _WORD.search(s)]


def divided_paragraphs(text: str) -> list[str] | None:
    """Paragraphs separated by a markdown divider line (``***`` or ``* * *``); None when one between
    two dividers is empty (an empty first or last part is not a paragraph)."""
    parts = [p.strip() for p in _DIVIDER.split(text)]
    while parts and not parts[0]:
        parts.pop(0)
    while parts and not parts[-1]:
        parts.pop()
    return None if any(not p for p in parts) else parts


def blank_line_paragraphs(text: str) -> list[str]:
    return [p.strip() for p in _BLANK_LINE.split(text.strip()) if p.strip()]


# -- relations -------------------------------------------------------------------------------------

def _around(actual: int, n: int) -> bool:
    return abs(actual - n) <= max(1, round(n * 0.1))


RELATIONS: dict[str, Callable[[int, int], bool]] = {
    "less than": lambda a, n: a < n, "at most": lambda a, n: a <= n, "exactly": lambda a, n: a == n,
    "at least": lambda a, n: a >= n, "more than": lambda a, n: a > n, "around": _around,
}


def _compare(what: str, actual: int, relation: str, n: int) -> tuple[bool, str]:
    ok = RELATIONS[relation](actual, n)
    return ok, f"{actual} {what}, {relation} {n} asked"


# -- the kinds -------------------------------------------------------------------------------------

REQUIRED = object()


@dataclass(frozen=True)
class Kind:
    """One kind of instruction: its IFEval id, its parameters (name -> (type, default)) and its
    check, ``check(reply, params, data) -> (followed, what was found)``."""

    name: str
    ifeval: str
    params: Mapping[str, tuple[str, Any]]
    check: Callable[[str, dict[str, Any], Mapping[str, Any]], tuple[bool, str]]
    words: str  # what it asks, for the docs


def _keywords(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    missing = [k for k in p["keywords"] if not re.search(re.escape(k), reply, re.IGNORECASE)]
    return not missing, f"missing {', '.join(map(repr, missing))}" if missing else "all present"


def _keyword_frequency(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    found = len(re.findall(re.escape(p["keyword"]), reply, re.IGNORECASE))
    return _compare(f"× {p['keyword']!r}", found, p["relation"], p["frequency"])


def _forbidden_words(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    used = [w for w in p["forbidden_words"] if re.search(rf"(?<!\w){re.escape(w)}(?!\w)", reply, re.IGNORECASE)]
    return not used, f"uses {', '.join(map(repr, used))}" if used else "none used"


def _letter_frequency(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    return _compare(f"× {p['letter']!r}", reply.lower().count(p["letter"].lower()), p["let_relation"],
                    p["let_frequency"])


def _number_sentences(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    return _compare("sentences", len(sentences(reply)), p["relation"], p["num_sentences"])


def _number_paragraphs(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    parts = divided_paragraphs(reply)
    if parts is None:
        return False, "an empty paragraph between two *** dividers"
    return _compare("paragraphs", len(parts), "exactly", p["num_paragraphs"])


def _number_words(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    return _compare("words", len(words(reply)), p["relation"], p["num_words"])


def _nth_paragraph_first_word(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    parts = blank_line_paragraphs(reply)
    if len(parts) != p["num_paragraphs"]:
        return False, f"{len(parts)} paragraphs, exactly {p['num_paragraphs']} asked"
    nth = p["nth_paragraph"]
    if not 1 <= nth <= len(parts):
        return False, f"no paragraph {nth}"
    first = re.match(r"[^\w]*(\w+(?:['’-]\w+)*)", parts[nth - 1])
    word = first.group(1) if first else ""
    ok = word.lower() == p["first_word"].lower()
    return ok, f"paragraph {nth} starts with {word!r}, {p['first_word']!r} asked"


def _number_placeholders(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    return _compare("[placeholders]", len(_PLACEHOLDER.findall(reply)), "at least", p["num_placeholders"])


def _postscript(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    marker = re.sub(r"\s+", "", p["postscript_marker"]).lower().rstrip(".:")
    for line in reply.splitlines():
        squeezed = re.sub(r"\s+", "", line).lower().lstrip("*_>")
        if squeezed.startswith(marker) and squeezed[len(marker):].lstrip(".:").strip():
            return True, "found"
    return False, f"no line starts with {p['postscript_marker']!r} followed by text"


def _number_bullet_lists(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    return _compare("bullet points", len(_BULLET.findall(reply)), "exactly", p["num_bullets"])


_YES_NO_MAYBE = ["My answer is yes.", "My answer is no.", "My answer is maybe."]


def _constrained_response(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    options = p["options"] or _YES_NO_MAYBE
    ok = any(option in reply.strip() for option in options)
    return ok, "one of the options given" if ok else f"none of {options}"


def _number_highlighted_sections(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    found = sum(1 for m in _HIGHLIGHT.finditer(reply) if (m.group(1) or m.group(2) or "").strip())
    return _compare("*highlighted* sections", found, "at least", p["num_highlights"])


def _multiple_sections(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    marker = re.compile(rf"^[ \t#*_]*{re.escape(p['section_spliter'].strip())}[ \t]+\d+", re.MULTILINE)
    return _compare(f"'{p['section_spliter'].strip()} N' sections", len(marker.findall(reply)), p["relation"],
                    p["num_sections"])


def _json_format(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    text = reply.strip()
    fenced = _FENCED.match(text)
    try:
        json.loads(fenced.group(1) if fenced else text)
    except ValueError as exc:
        return False, f"not JSON ({exc})"
    return True, "JSON"


def _title(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    ok = _TITLE.search(reply) is not None
    return ok, "found" if ok else "no <<title>>"


def _two_responses(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    parts = [part.strip() for part in reply.split("******")]
    if len(parts) != 2 or not all(parts):
        return False, f"{len(parts)} parts around ******, 2 non-empty asked"
    return parts[0] != parts[1], "two different responses" if parts[0] != parts[1] else "the same response twice"


def _repeat_prompt(reply: str, p: dict[str, Any], data: Mapping[str, Any]) -> tuple[bool, str]:
    prompt = p["prompt_to_repeat"] if p["prompt_to_repeat"] is not None else data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("repeat_prompt: no prompt_to_repeat and no prompt text in the data item")
    ok = reply.strip().lower().startswith(prompt.strip().lower())
    return ok, "starts with the prompt" if ok else "does not start with the prompt"


def _end_checker(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    ok = reply.strip().lower().endswith(p["end_phrase"].strip().lower())
    return ok, "ends with it" if ok else f"does not end with {p['end_phrase']!r}"


def _quotation(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    text = reply.strip()
    ok = len(text) > 1 and ((text[0] == '"' and text[-1] == '"') or (text[0] == "“" and text[-1] == "”"))
    return ok, "wrapped in double quotes" if ok else "not wrapped in double quotes"


def _capital_word_frequency(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    capitals = [w for w in words(reply) if w.isupper()]
    return _compare("all-capital words", len(capitals), p["capital_relation"], p["capital_frequency"])


def _english_capital(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    ok = reply == reply.upper() and any(c.isalpha() for c in reply)
    return ok, "all capitals" if ok else "has lowercase letters (or none at all)"


def _english_lowercase(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    ok = reply == reply.lower() and any(c.isalpha() for c in reply)
    return ok, "all lowercase" if ok else "has capital letters (or no letters at all)"


def _no_comma(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    found = reply.count(",") + reply.count("，")
    return not found, f"{found} commas" if found else "no commas"


def _response_language(reply: str, p: dict[str, Any], _: Any) -> tuple[bool, str]:
    raise ValueError("response_language: nexrl-rewards cannot check a reply's language (no language detector is "
                     "installed); leave these instructions out with rollout_worker.evaluator.ignore_kinds: "
                     "[response_language]")


_REL = ("relation", "at least")
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("keywords", "keywords:existence", {"keywords": ("strings", REQUIRED)}, _keywords,
         "each of the keywords appears (case-insensitive)"),
    Kind("keyword_frequency", "keywords:frequency",
         {"keyword": ("string", REQUIRED), "frequency": ("count", REQUIRED), "relation": _REL},
         _keyword_frequency, "the keyword appears `relation` `frequency` times (case-insensitive)"),
    Kind("forbidden_words", "keywords:forbidden_words", {"forbidden_words": ("strings", REQUIRED)},
         _forbidden_words, "none of the words appears as a word (case-insensitive)"),
    Kind("letter_frequency", "keywords:letter_frequency",
         {"letter": ("letter", REQUIRED), "let_frequency": ("count", REQUIRED), "let_relation": _REL},
         _letter_frequency, "the letter appears `let_relation` `let_frequency` times (case-insensitive)"),
    Kind("response_language", "language:response_language", {"language": ("string", REQUIRED)},
         _response_language, "not checked: no language detector is installed (a data item asking for it fails; "
                              "`ignore_kinds: [response_language]` leaves it out)"),
    Kind("number_sentences", "length_constraints:number_sentences",
         {"num_sentences": ("count", REQUIRED), "relation": _REL}, _number_sentences,
         "`relation` `num_sentences` sentences"),
    Kind("number_paragraphs", "length_constraints:number_paragraphs", {"num_paragraphs": ("count", REQUIRED)},
         _number_paragraphs, "exactly `num_paragraphs` paragraphs separated by a `***` (or `* * *`) line, none empty"),
    Kind("number_words", "length_constraints:number_words", {"num_words": ("count", REQUIRED), "relation": _REL},
         _number_words, "`relation` `num_words` words"),
    Kind("nth_paragraph_first_word", "length_constraints:nth_paragraph_first_word",
         {"num_paragraphs": ("count", REQUIRED), "nth_paragraph": ("count", REQUIRED),
          "first_word": ("string", REQUIRED)}, _nth_paragraph_first_word,
         "exactly `num_paragraphs` paragraphs separated by blank lines, paragraph `nth_paragraph` (from 1) starting "
         "with `first_word` (case-insensitive)"),
    Kind("number_placeholders", "detectable_content:number_placeholders",
         {"num_placeholders": ("count", REQUIRED)}, _number_placeholders,
         "at least `num_placeholders` placeholders in square brackets, `[address]`"),
    Kind("postscript", "detectable_content:postscript", {"postscript_marker": ("string", REQUIRED)}, _postscript,
         "a line starting with `postscript_marker` (`P.S.`, `P.P.S`; case and spaces aside) followed by text"),
    Kind("number_bullet_lists", "detectable_format:number_bullet_lists", {"num_bullets": ("count", REQUIRED)},
         _number_bullet_lists, "exactly `num_bullets` markdown bullet points (lines starting with `* ` or `- `)"),
    Kind("constrained_response", "detectable_format:constrained_response", {"options": ("strings", ())},
         _constrained_response, "contains one of `options` (default: My answer is yes. / no. / maybe.)"),
    Kind("number_highlighted_sections", "detectable_format:number_highlighted_sections",
         {"num_highlights": ("count", REQUIRED)}, _number_highlighted_sections,
         "at least `num_highlights` `*highlighted*` (or `**bold**`) non-empty sections"),
    Kind("multiple_sections", "detectable_format:multiple_sections",
         {"section_spliter": ("string", REQUIRED), "num_sections": ("count", REQUIRED), "relation": _REL},
         _multiple_sections, "`relation` `num_sections` sections, each starting a line with `section_spliter` and "
                             "its number (`SECTION 1`)"),
    Kind("json_format", "detectable_format:json_format", {}, _json_format,
         "the whole reply is JSON (a ```` ```json ```` fence around it allowed)"),
    Kind("title", "detectable_format:title", {}, _title, "a title in double angular brackets, `<<poem of joy>>`"),
    Kind("two_responses", "combination:two_responses", {}, _two_responses,
         "two different non-empty responses separated by `******`"),
    Kind("repeat_prompt", "combination:repeat_prompt", {"prompt_to_repeat": ("string", None)}, _repeat_prompt,
         "starts with `prompt_to_repeat` (default: the data item's prompt; case-insensitive)"),
    Kind("end_checker", "startend:end_checker", {"end_phrase": ("string", REQUIRED)}, _end_checker,
         "ends with `end_phrase` (case-insensitive; nothing after it)"),
    Kind("quotation", "startend:quotation", {}, _quotation, "wrapped in double quotation marks"),
    Kind("capital_word_frequency", "change_case:capital_word_frequency",
         {"capital_frequency": ("count", REQUIRED), "capital_relation": _REL}, _capital_word_frequency,
         "`capital_relation` `capital_frequency` words in capitals"),
    Kind("english_capital", "change_case:english_capital", {}, _english_capital,
         "no lowercase letter (and some letter)"),
    Kind("english_lowercase", "change_case:english_lowercase", {}, _english_lowercase,
         "no capital letter (and some letter)"),
    Kind("no_comma", "punctuation:no_comma", {}, _no_comma, "no comma (`,` nor the full-width `，`)"),
)}

_IFEVAL = {k.ifeval: k.name for k in KINDS.values()}
_SHORT = {"uppercase": "english_capital", "lowercase": "english_lowercase"}
# names the parameters of several kinds also go by
_PARAM_ALIASES = {"letter_frequency": {"frequency": "let_frequency", "relation": "let_relation"},
                  "capital_word_frequency": {"frequency": "capital_frequency", "relation": "capital_relation"},
                  "multiple_sections": {"section_splitter": "section_spliter"}}
# ROLL's ifeval reward worker (open-instruct's functions): name -> (kind, its parameter names, fixed values)
_ROLL: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {
    "verify_keywords": ("keywords", {"keyword_list": "keywords"}, {}),
    "verify_keyword_frequency": ("keyword_frequency", {"word": "keyword", "N": "frequency"}, {"relation": "exactly"}),
    "validate_forbidden_words": ("forbidden_words", {}, {}),
    "verify_letter_frequency": ("letter_frequency", {"N": "let_frequency"}, {"let_relation": "exactly"}),
    "validate_response_language": ("response_language", {}, {}),
    "verify_paragraph_count": ("number_paragraphs", {"N": "num_paragraphs"}, {}),
    "validate_word_constraint": ("number_words", {"N": "num_words", "quantifier": "relation"}, {}),
    "verify_sentence_constraint": ("number_sentences", {"N": "num_sentences", "quantifier": "relation"}, {}),
    "validate_paragraphs": ("nth_paragraph_first_word", {"N": "num_paragraphs", "i": "nth_paragraph"}, {}),
    "verify_postscript": ("postscript", {}, {}),
    "validate_placeholders": ("number_placeholders", {"N": "num_placeholders"}, {}),
    "verify_bullet_points": ("number_bullet_lists", {"N": "num_bullets"}, {}),
    "validate_title": ("title", {}, {}),
    "validate_choice": ("constrained_response", {}, {}),
    "validate_highlighted_sections": ("number_highlighted_sections", {"N": "num_highlights"}, {}),
    "validate_sections": ("multiple_sections", {"N": "num_sections", "section_splitter": "section_spliter"},
                          {"relation": "exactly"}),
    "validate_json_format": ("json_format", {}, {}),
    "validate_repeat_prompt": ("repeat_prompt", {"original_prompt": "prompt_to_repeat"}, {}),
    "validate_two_responses": ("two_responses", {}, {}),
    "validate_uppercase": ("english_capital", {}, {}),
    "validate_lowercase": ("english_lowercase", {}, {}),
    "validate_frequency_capital_words": ("capital_word_frequency",
                                         {"N": "capital_frequency", "quantifier": "capital_relation"}, {}),
    "validate_end": ("end_checker", {}, {}),
    "validate_quotation": ("quotation", {}, {}),
    "validate_no_commas": ("no_comma", {}, {}),
}


def kind_name(name: Any) -> str | None:
    """nexrl's name of an instruction kind given by its own name, its IFEval id or ROLL's function name."""
    if not isinstance(name, str):
        return None
    name = name.strip()
    if name in KINDS:
        return name
    return _IFEVAL.get(name) or _SHORT.get(name) or (_ROLL[name][0] if name in _ROLL else None)


@dataclass(frozen=True)
class Instruction:
    kind: Kind
    params: dict[str, Any]

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if v is not None and v != ())
        return f"{self.kind.name}({shown})" if shown else self.kind.name


def parse_instruction(spec: Any, where: str) -> Instruction:
    """One instruction from a mapping (``type``/``id``/``instruction_id``/``func_name`` naming its
    kind, the rest its parameters) or a kind's name; ValueError naming ``where`` when it is not one."""
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: {spec!r} is not an instruction (a mapping with its type, or a type's name)")
    values = {str(k): v for k, v in spec.items() if v is not None}
    named = [k for k in ("type", "id", "instruction_id", "func_name") if k in values]
    if len(named) != 1:
        raise ValueError(f"{where}: name the instruction's kind with one of type, id, instruction_id or func_name "
                         f"(got {sorted(values)})")
    given = values.pop(named[0])
    name = kind_name(given)
    if name is None:
        raise ValueError(f"{where}: unknown instruction kind {given!r} (known: {', '.join(KINDS)}; IFEval's ids and "
                         f"ROLL's function names too)")
    kind = KINDS[name]
    if isinstance(given, str) and given.strip() in _ROLL:
        _, renames, fixed = _ROLL[given.strip()]
        values = {**fixed, **{renames.get(k, k): v for k, v in values.items()}}
    aliases = _PARAM_ALIASES.get(name, {})
    values = {aliases.get(k, k): v for k, v in values.items()}
    unknown = sorted(set(values) - set(kind.params))
    if unknown:
        raise ValueError(f"{where}: {name} takes {', '.join(kind.params) or 'no parameters'}, not "
                         f"{', '.join(unknown)}")
    params = {}
    for param, (kind_of, default) in kind.params.items():
        if param not in values:
            if default is REQUIRED:
                raise ValueError(f"{where}: {name} needs {param}")
            params[param] = default
            continue
        params[param] = _value(values[param], kind_of, f"{where}: {name}.{param}")
    return Instruction(kind, params)


def _value(value: Any, kind_of: str, where: str) -> Any:
    if kind_of == "count":
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or float(value) != int(value):
            raise ValueError(f"{where}: {value!r} is not a whole number >= 0")
        return int(value)
    if kind_of == "strings":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v for v in items):
            raise ValueError(f"{where}: {value!r} is not a list of words")
        return tuple(items)
    if kind_of == "letter":
        if not isinstance(value, str) or len(value) != 1 or not value.isalpha():
            raise ValueError(f"{where}: {value!r} is not one letter")
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {value!r} is not a text")
    if kind_of == "relation":
        relation = value.strip().lower()
        if relation not in RELATIONS:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(RELATIONS)}")
        return relation
    return value


def loose_variants(reply: str) -> list[str]:
    """The reply after each of IFEval's loose changes: without its first line, its last line or
    both, each with and without markdown ``*`` (the reply itself first)."""
    lines = reply.split("\n")
    cut = [reply, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [v for text in cut for v in (text, text.replace("*", "")) if v.strip()]


# -- the evaluator ---------------------------------------------------------------------------------

class InstructionFollowingEvaluator(Evaluator):
    """IFEval-style verifiable instructions (docs/rewards.md lists the kinds and their parameters).
    Reward: the share of the data item's instructions the reply follows (``reward_mode:
    fraction``), or 1 only when it follows all (``all_or_nothing``), strictly or loosely
    (``mode``). Metrics (every sample reports all): ``accuracy`` (all followed, by ``mode``),
    ``instruction_accuracy`` (the share followed, by ``mode``), ``strict_accuracy`` and
    ``loose_accuracy`` (all followed, each way), ``num_instructions``, and with ``kind_metrics``
    ``<kind>_total`` and ``<kind>_followed`` for every kind (their ratio over a validation is the
    kind's instruction-level accuracy). ``extra_info``: ``reason`` (None or ``not_followed``),
    ``not_followed`` (the kinds broken), ``instructions`` (per instruction: ``kind``, ``params``,
    ``strict``, ``loose``, ``detail``), ``checked`` (``reply`` or ``after_thinking``). A data item
    without instructions, or with one that is malformed or of an unknown kind, fails the sample.
    """

    # sample data for the conformance check (nexrl plugins check) and the docs
    EXAMPLES = [
        {"data": {"prompt": "Describe the sea in fewer than 10 words, without commas.",
                  "instructions": [{"type": "number_words", "relation": "less than", "num_words": 10},
                                   {"type": "no_comma"}]},
         "response": "Blue and endless and always moving.", "reward": 1.0},
        {"data": {"prompt": "Describe the sea in fewer than 10 words, without commas.",
                  "instructions": [{"type": "number_words", "relation": "less than", "num_words": 10},
                                   {"type": "no_comma"}]},
         "response": "Blue, endless, always moving.", "reward": 0.5},
        {"data": {"prompt": "Give a title in <<>> and end with 'Any questions?'",
                  "instruction_id_list": ["detectable_format:title", "startend:end_checker"],
                  "kwargs": [{}, {"end_phrase": "Any questions?"}]},
         "response": "<<The Sea>>\nIt is wide. Any questions?", "reward": 1.0},
    ]

    def __init__(self,
                 instructions_key: str = "instructions",
                 mode: str = "strict",
                 reward_mode: str = "fraction",
                 kind_metrics: bool = True,
                 ignore_kinds: Sequence[str] = (),
                 after_thinking: bool = True):
        """Where the instructions are and how the reply is scored (see docs/rewards.md).

        :param instructions_key: data field with the list of instructions; a dotted path reads a nested field
            (rows with IFEval's instruction_id_list and kwargs are read without it)
        :param mode: strict: the reply as written; loose: also after IFEval's loose changes (first or last line
            dropped, markdown * removed)
        :param reward_mode: fraction: the share of instructions followed; all_or_nothing: 1 only when all are
        :param kind_metrics: report <kind>_total and <kind>_followed for every instruction kind
        :param ignore_kinds: instruction kinds left out of every data item (response_language: no language
            detector is installed)
        :param after_thinking: check only the text after the reply's last </think> (its reasoning is not the reply)
        """
        self.instructions_key = instructions_key
        self.mode = choice(mode, "mode", MODES)
        self.reward_mode = choice(reward_mode, "reward_mode", REWARD_MODES)
        self.kind_metrics = bool(kind_metrics)
        ignored = [ignore_kinds] if isinstance(ignore_kinds, str) else list(ignore_kinds)
        unknown = [k for k in ignored if kind_name(k) is None]
        if unknown:
            raise ConfigError(f"{KEY}.ignore_kinds: unknown instruction kind {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(KINDS)})")
        self.ignore_kinds = {str(kind_name(k)) for k in ignored}
        self.after_thinking = bool(after_thinking)

    def instructions(self, data: Mapping[str, Any]) -> list[Instruction]:
        """The data item's instructions (those of ``ignore_kinds`` left out); ValueError when it has
        none to check or one is malformed."""
        uid = data.get("uid")
        specs = row_field(data, self.instructions_key)
        if specs is not None:
            where = f"data item {uid!r} '{self.instructions_key}'"
            if isinstance(specs, str):
                try:
                    specs = json.loads(specs)
                except ValueError:
                    specs = [specs]  # one kind's name
            if isinstance(specs, Mapping):
                specs = [specs]
        elif data.get("instruction_id_list") is not None:
            ids, kwargs = data["instruction_id_list"], data.get("kwargs")
            where = f"data item {uid!r} 'instruction_id_list'"
            if isinstance(kwargs, str):
                kwargs = json.loads(kwargs)
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"{where}: {ids!r} is not a list of instruction ids")
            kwargs = list(kwargs) if isinstance(kwargs, (list, tuple)) else [{}] * len(ids)
            if len(kwargs) != len(ids):
                raise ValueError(f"{where}: {len(ids)} instruction ids but {len(kwargs)} kwargs")
            specs = [{"id": i, **(k or {})} for i, k in zip(ids, kwargs)]
        else:
            raise ValueError(f"data item {uid!r} has no '{self.instructions_key}' (rollout_worker.evaluator."
                             f"instructions_key) and no IFEval 'instruction_id_list'")
        if not isinstance(specs, (list, tuple)):
            raise ValueError(f"{where}: {specs!r} is not a list of instructions")
        parsed = [parse_instruction(s, f"{where}[{i}]") for i, s in enumerate(specs)]
        kept = [ins for ins in parsed if ins.kind.name not in self.ignore_kinds]
        if not kept:
            left = " (all of its kinds are in ignore_kinds)" if parsed else ""
            raise ValueError(f"{where}: no instruction to check{left}")
        return kept

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        instructions = self.instructions(data)
        reply, checked = evaluation_target.final_answer, "reply"
        if self.after_thinking and "</think>" in reply:
            reply, checked = reply.rsplit("</think>", 1)[1], "after_thinking"
        variants = loose_variants(reply)[1:]
        results: list[dict[str, Any]] = []
        for ins in instructions:
            strict, detail = ins.kind.check(reply, ins.params, data)
            loose = strict or any(ins.kind.check(v, ins.params, data)[0] for v in variants)
            results.append({"kind": ins.kind.name, "params": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in ins.params.items()},
                            "strict": strict, "loose": loose, "detail": detail})
        followed = [r[self.mode] for r in results]
        share = sum(followed) / len(followed)
        every = all(followed)
        metrics = {"accuracy": float(every), "instruction_accuracy": share,
                   "strict_accuracy": float(all(r["strict"] for r in results)),
                   "loose_accuracy": float(all(r["loose"] for r in results)),
                   "num_instructions": float(len(results))}
        if self.kind_metrics:
            for name in KINDS:
                mine = [r for r in results if r["kind"] == name]
                metrics[f"{name}_total"] = float(len(mine))
                metrics[f"{name}_followed"] = float(sum(r[self.mode] for r in mine))
        broken = [r["kind"] for r in results if not r[self.mode]]
        return EvaluationRunResult(
            reward=share if self.reward_mode == "fraction" else float(every),
            ground_truth="; ".join(ins.describe() for ins in instructions),
            metrics=metrics,
            extra_info={"reason": "not_followed" if broken else None, "not_followed": broken,
                        "instructions": results, "checked": checked})
