"""Cells nested deeper than ``copy.deepcopy`` of their syntax tree can go: a plain cell runs them."""
from __future__ import annotations


def elif_chain(n: int, pick: int, then: str = "") -> str:
    """``if x == 0: ... elif x == 1: ...`` with ``n`` branches; ``r`` is ``pick`` afterwards."""
    lines = [f"x = {pick}", "if x == 0:\n    r = 0"] + [f"elif x == {i}:\n    r = {i}" for i in range(1, n)]
    return "\n".join(lines) + "\n" + then


def nested_abs(n: int, then: str = "") -> str:
    """``v = abs(abs(...abs(-1)...))``, ``n`` deep: ``v`` is 1."""
    return "v = " + "abs(" * n + "-1" + ")" * n + "\n" + then
