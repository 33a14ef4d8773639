"""Tensor names of a checkpoint format -> ours, by a table of (regex, our name with {} per group)."""

import re


def rename(table: list[tuple[str, str]], name: str) -> str | None:
    """Our parameter name for ``name``, or None when no model of ours has such a tensor."""
    for pattern, ours in table:
        if m := re.fullmatch(pattern, name):
            return ours.format(*m.groups())
    return None
