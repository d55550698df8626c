"""Syntax trees copied without recursion: a cell nested deeper than Python's recursion limit allows
``copy.deepcopy`` (a 250-branch ``if/elif`` chain, ``abs()`` nested 190 deep) still runs, as a plain cell
does.

``copy.deepcopy`` of an AST takes several Python frames per level of nesting, so such a cell raised
``RecursionError`` under the magics that rewrite a copy of it. :func:`copy_tree` walks it with a stack of
its own instead; :func:`depth` says how deep a tree nests, the same way.

Runs in the kernel and in the workers: no IPython.
"""
from __future__ import annotations

import ast
import sys
import types
from contextlib import contextmanager

__all__ = ["copy_tree", "depth", "room_for", "MAX_DEPTH", "Flat", "shipped", "flatten", "unflatten"]

# Levels of nesting the magics take: a plain cell compiles an if/elif chain of about 1,500 branches
# (Python's compiler gives up beyond), and calls nest at most 200 deep (the parser's limit).
MAX_DEPTH = 1000
# Python frames the deepest walker of a tree here takes per level (a NodeTransformer whose visit
# calls super().visit, which calls generic_visit: 3), with one to spare.
FRAMES_PER_LEVEL = 4


def copy_tree(tree: ast.AST) -> ast.AST:
    """A deep copy of ``tree``: new nodes and lists throughout; constants, names and locations shared
    (they are immutable)."""
    root = _empty(tree)
    stack = [(tree, root)]
    while stack:
        old, new = stack.pop()
        for name in old._attributes:
            if hasattr(old, name):
                setattr(new, name, getattr(old, name))
        for name, value in ast.iter_fields(old):
            setattr(new, name, _copied(value, stack))
    return root


def _empty(node: ast.AST) -> ast.AST:
    return type(node).__new__(type(node))


def _copied(value, stack: list):
    """``value``'s copy, its nodes empty for now and put on ``stack`` to be filled."""
    if isinstance(value, ast.AST):
        new = _empty(value)
        stack.append((value, new))
        return new
    if isinstance(value, list):
        return [_copied(item, stack) for item in value]
    return value   # a constant, an identifier, None


@contextmanager
def room_for(tree: ast.AST):
    """Python's recursion limit raised, for the block, to what walking ``tree`` recursively takes
    (``ast.NodeVisitor``, ``NodeTransformer``, ``fix_missing_locations``: a few frames per level). Only
    around gpumagic's own work on the tree, never around the user's code. Python-to-Python calls take
    no C stack (3.11+), so the raised limit is safe for these walkers."""
    needed = _frames() + FRAMES_PER_LEVEL * depth(tree) + 200
    old = sys.getrecursionlimit()
    if needed <= old:
        yield
        return
    sys.setrecursionlimit(needed)
    try:
        yield
    finally:
        if sys.getrecursionlimit() == needed:   # (what the block set: put back)
            sys.setrecursionlimit(old)


def _frames() -> int:
    frame: types.FrameType | None = sys._getframe()
    count = 0
    while frame is not None:
        frame, count = frame.f_back, count + 1
    return count


def depth(tree: ast.AST) -> int:
    """How many nodes deep ``tree`` nests at its deepest."""
    deepest = 0
    stack = [(tree, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in ast.iter_child_nodes(node))
    return deepest


class Flat:
    """A syntax tree that pickles as a flat list of its nodes (pickle, too, recurses once per level of
    nesting); it unpickles as the tree itself. ``meta["tree"] = Flat(tree)`` on the way to a worker."""

    def __init__(self, tree: ast.Module):
        self.tree = tree

    def __reduce__(self):
        return unflatten, (flatten(self.tree),)


def shipped(tree) -> ast.Module:
    """In a worker: the tree as it arrived: pickled (a tree already) or as it was (a forked worker's ``Flat``)."""
    return tree.tree if isinstance(tree, Flat) else tree


def flatten(tree: ast.AST) -> list:
    """``tree``'s nodes in order, each ``(class name, attributes, fields)``; a field holding a node holds
    ``(_NODE, its index)``, one holding a list a list of such."""
    nodes = [tree]
    records = []
    index = 0
    while index < len(nodes):
        node = nodes[index]
        fields = [(name, _flat(value, nodes)) for name, value in ast.iter_fields(node)]
        attributes = [(name, getattr(node, name)) for name in node._attributes if hasattr(node, name)]
        records.append((type(node).__name__, attributes, fields))
        index += 1
    return records


_NODE, _LIST, _VALUE = 0, 1, 2


def _flat(value, nodes: list):
    if isinstance(value, ast.AST):
        nodes.append(value)
        return (_NODE, len(nodes) - 1)
    if isinstance(value, list):
        return (_LIST, [_flat(item, nodes) for item in value])
    return (_VALUE, value)


def unflatten(records: list) -> ast.AST:
    """The tree :func:`flatten` flattened."""
    nodes = [_empty_of(name) for name, _, _ in records]
    for node, (_, attributes, fields) in zip(nodes, records):
        for name, value in attributes:
            setattr(node, name, value)
        for name, value in fields:
            setattr(node, name, _unflat(value, nodes))
    return nodes[0]


def _empty_of(name: str) -> ast.AST:
    cls = getattr(ast, name)
    return cls.__new__(cls)


def _unflat(value, nodes: list):
    kind, payload = value
    if kind == _NODE:
        return nodes[payload]
    if kind == _LIST:
        return [_unflat(item, nodes) for item in payload]
    return payload
