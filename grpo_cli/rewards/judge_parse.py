"""Turn a judge's answer into a score: a regex whose one group holds the number, or a user function (imported by
`rewards.resolve`, like a reward function)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable



def regex_parser(pattern: str) -> Callable[[str], float | None]:
    """The group of the last match of `pattern` as a float (judges reason first and give the verdict last); None
    when nothing matches or the group is not a finite number."""
    compiled = re.compile(pattern)

    def parse(text: str) -> float | None:
        matches = list(compiled.finditer(text))
        if not matches:
            return None
        try:
            value = float(matches[-1].group(1))
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    return parse


def parsed_score(parser: Callable[[str], float | None], text: str) -> float | None:
    """`parser(text)` as a finite float, or None when it returns None, something else, or raises (a parser's
    failure costs that completion's score, never the run)."""
    try:
        value = parser(text)
    except Exception:  # noqa: BLE001 - user code: a failed parse is a missing score
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
