"""Answer extraction: the one place that reads a final answer out of a response.

``extract(text, mode)`` with ``mode`` one of ``EXTRACTION_MODES``:
  answer_tag   the content of the last ``<answer>...</answer>`` (reasoning-gym's own
               convention), stripped
  boxed        the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), balanced
               braces
  last_number  the last number in the text -- the last number on the last line that
               has one. Thousands separators are dropped and integral decimals
               shortened ("1,200.00" -> "1200"), since verifiers compare strings; a
               minus sign counts only when it is not a binary minus ("7-3" gives "3",
               "is -4" gives "-4"); the Unicode minus reads as "-".
  last_line    the last non-empty line, stripped
  auto         answer_tag, else boxed, else last_number
None means the text gives no answer under that mode.

``normalize_number`` and ``normalize_exact`` are the string normalisations the
verifiers compare with.
"""

from __future__ import annotations

import re

__all__ = ["EXTRACTION_MODES", "extract", "normalize_number", "normalize_exact"]

EXTRACTION_MODES = ("auto", "answer_tag", "boxed", "last_number", "last_line")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number, optionally signed; the sign must not follow a word character or ")"
# (then it is a binary minus). Thousands groups and a fraction part are allowed.
_NUMBER = re.compile(r"(?:(?<![\w)])[-\u2212])?\d+(?:,\d{3})*(?:\.\d+)?")


def normalize_number(raw: str) -> str:
    """ "−1,200.00" -> "-1200"; non-integral decimals keep their digits ("2.50")."""
    number = raw.replace("\u2212", "-").replace(",", "")
    if "." in number:
        whole, frac = number.split(".", 1)
        if frac.strip("0") == "":
            number = whole
    if number == "-0":
        number = "0"
    return number


def normalize_exact(text: str) -> str:
    """Stripped, lower-cased, whitespace collapsed; a lone number normalised."""
    s = " ".join(text.strip().split()).lower()
    if _NUMBER.fullmatch(s):
        s = normalize_number(s)
        if re.fullmatch(r"-?\d+\.\d+", s):  # "0.50" -> "0.5"
            s = s.rstrip("0")
    return s


def _answer_tag(text: str) -> str | None:
    tags = _ANSWER_TAG.findall(text)
    return tags[-1].strip() if tags else None


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        # unbalanced: try an earlier one
    return None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def _last_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else None


_EXTRACTORS = {"answer_tag": _answer_tag, "boxed": _last_boxed,
               "last_number": _last_number, "last_line": _last_line}


def extract(text: str, mode: str = "auto") -> str | None:
    """The answer ``text`` gives under extraction ``mode`` (see the module docstring).

    Raises:
        ValueError: an unknown ``mode``; the message lists the valid ones.
    """
    if mode == "auto":
        for fn in (_answer_tag, _last_boxed, _last_number):
            found = fn(text)
            if found is not None:
                return found
        return None
    fn = _EXTRACTORS.get(mode)
    if fn is None:
        raise ValueError(f"unknown answer extraction {mode!r}; choose one of "
                         f"{', '.join(EXTRACTION_MODES)}")
    return fn(text)
