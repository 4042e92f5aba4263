"""Answer extraction from a model's reply: ``\\boxed{...}``, "final answer" phrases, the last number.

Pure string functions (no sympy): the evaluator runs them in the rollout thread and sends only
the extracted text to the math-verify worker process.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# The longest answer text kept from a "final answer" phrase: a phrase with more is prose, not an answer.
_MAX_PHRASE_ANSWER = 200

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "The final answer is X", "Final answer: X", "the answer is X", "Answer: X", GSM8K's "#### X".
_ANSWER_PHRASE = re.compile(r"(?i)(?:\bfinal\s+answer\b|\bthe\s+answer\b|\banswer\b)\s*(?:is\b|:|=)\s*:?[ \t]*|^[ \t]*####[ \t]*",
                            re.MULTILINE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_MINERVA_TAIL = re.compile(r"(?i)\.?\s*I hope it is correct\.?\s*$")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?(?:\s*\\?%)?|(?<![\w.])-?\.\d+")
_NUMBER_WITH_UNIT = re.compile(r"([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s+([A-Za-z][A-Za-z ]*)")
_DELIMITED = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included; None if
    there is none or its braces never close."""
    found = None
    for match in _BOXED.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            ch = text[i]
            if ch == "\\" and i + 1 < len(text):  # an escaped brace (\{ \}) does not nest
                i += 2
                continue
            depth += ch == "{"
            depth -= ch == "}"
            i += 1
        if depth == 0:
            found = text[match.end():i - 1]
    return found.strip() if found is not None else None


def final_answer_phrase(text: str) -> str | None:
    """What follows the last "final answer is / answer: / ####" in the reply, to the end of its line."""
    matches = list(_ANSWER_PHRASE.finditer(text))
    for match in reversed(matches):
        rest = text[match.end():]
        inner = _leading_math(rest)
        # The answer ends with its line or its sentence ("is 7. Check: ..." answers 7; 3.5 stays whole).
        answer = inner if inner is not None else _SENTENCE_END.split(rest.split("\n", 1)[0], 1)[0]
        answer = _MINERVA_TAIL.sub("", answer).strip().rstrip(".").strip().strip("*`").strip()
        boxed = last_boxed(answer)
        if boxed:
            return boxed
        if answer and len(answer) <= _MAX_PHRASE_ANSWER:
            return answer
    return None


def last_number(text: str) -> str | None:
    """The last number in the reply ("1,000", "-2.5", "3/4", "75%" count as one number)."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": last_boxed,
    "final_answer": final_answer_phrase,
    "last_number": last_number,
}


def extract_answer(text: str, order: list[str]) -> tuple[str | None, str | None]:
    """(answer, name of the extractor that found it): the first extractor in ``order`` that finds a
    non-empty answer."""
    for name in order:
        answer = EXTRACTORS[name](text)
        if answer:
            return answer, name
    return None, None


def as_math(answer: str) -> str:
    """The answer as a math-verify input: inside ``$...$``, with a trailing percent sign outside
    (math-verify reads ``$75$%`` as 0.75 but drops the sign inside the delimiters)."""
    text = answer.strip()
    inner = _leading_math(text)
    if inner is not None and _leading_math_end(text) == len(text.rstrip().rstrip(".")):
        text = inner
    text = text.strip().rstrip(".").strip()
    if text.count("$") == 1:  # a currency sign ("$18"), not a math delimiter
        text = text.replace("\\$", "$").replace("$", "").strip()
    worded = _NUMBER_WITH_UNIT.fullmatch(text)
    if worded:  # "18 dollars": math-verify drops a unit written as \text{...}
        text = f"{worded.group(1)}\\text{{ {worded.group(2)}}}"
    percent = re.fullmatch(r"(?s)(.*?)\s*(\\?%|\\text\{\s*\\?%\s*\})", text)
    if percent:
        return f"${percent.group(1)}$%"
    return f"${text}$"


def _leading_math(text: str) -> str | None:
    """The content of a math span that opens ``text`` (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``)."""
    end = _leading_math_end(text)
    if end is None:
        return None
    stripped = text.lstrip()
    for open_, close in _DELIMITED:
        if stripped.startswith(open_):
            return stripped[len(open_):stripped.index(close, len(open_))].strip()
    return None


def _leading_math_end(text: str) -> int | None:
    stripped = text.lstrip()
    offset = len(text) - len(stripped)
    for open_, close in _DELIMITED:
        if stripped.startswith(open_):
            end = stripped.find(close, len(open_))
            if end > len(open_):
                return offset + end + len(close)
            return None
    return None
