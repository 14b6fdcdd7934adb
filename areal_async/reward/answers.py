"""Where a completion states its answer: the last ``\\boxed{...}`` or the last ``<answer>...</answer>``.

Pure string work, no imports beyond the standard library, so a reward child that only needs to
find the answer (the reasoning-gym scorers, ``gym_reward``) does not pay for math-verify / sympy.

Covered: ``extract_boxed`` (last well-formed ``\\boxed{...}`` with balanced braces, or the
``\\boxed 5`` form; a truncated final box is skipped for the last complete one) and
``final_answer`` (the last ``<answer>...</answer>``, reasoning-gym's convention, else the last box).
Not covered: any normalisation of the answer text (the scorer that reads it does that).
"""

from __future__ import annotations

__all__ = ["BOXED", "extract_boxed", "final_answer"]

BOXED = "\\boxed"
_OPEN, _CLOSE = "<answer>", "</answer>"


def extract_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` (or ``\\boxed x``) in ``text``, else None.

    A truncated final box (unbalanced braces, e.g. a generation cut at max length) is skipped in
    favour of the last complete one before it.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_boxed expects a str, got {type(text).__name__}: {text!r:.80}")
    start = text.rfind(BOXED)
    while start != -1:
        content = _boxed_content(text, start + len(BOXED))
        if content is not None:
            return content
        start = text.rfind(BOXED, 0, start)
    return None


def _boxed_content(text: str, i: int) -> str | None:
    """Argument of a ``\\boxed`` whose name ends at ``i``; None if malformed."""
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        return _balanced(text, j)
    if j == i or j >= len(text):  # "\boxedx" is another macro; "\boxed" at the end is empty
        return None
    end = j
    while end < len(text) and not text[end].isspace() and text[end] not in "$":
        end += 1
    return text[j:end] or None


def _balanced(text: str, open_idx: int) -> str | None:
    """Text between the brace at ``open_idx`` and its match; escaped ``\\{`` ``\\}`` don't count."""
    depth, k = 0, open_idx
    while k < len(text):
        c = text[k]
        if c == "\\":
            k += 2  # skip the escaped character, so "\{" / "\}" leave depth alone
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return text[open_idx + 1 : k]
        k += 1
    return None


def final_answer(text: str) -> str | None:
    """The stripped content of the last complete ``<answer>...</answer>``, else of the last
    ``\\boxed{}``; None when the completion states neither (or only an empty one)."""
    if not isinstance(text, str):
        raise TypeError(f"final_answer expects a str, got {type(text).__name__}: {text!r:.80}")
    end = text.rfind(_CLOSE)
    start = text.rfind(_OPEN, 0, end) if end != -1 else -1
    found = text[start + len(_OPEN) : end] if start != -1 else extract_boxed(text)
    found = found.strip() if found is not None else None
    return found or None
