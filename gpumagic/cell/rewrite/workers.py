"""A cell written for ``.cuda()`` run by worker processes on the CPU, as ``%%ondevice cpu`` runs it.

The kernel rewrites the cell's tree (:func:`rewrite_for_cpu_workers`) and tells
the workers the helper's name; each worker binds that name to its own
:class:`~.placement.Placement` before the cell runs (:func:`bind_placement`).
Used by ``%%dataparallel``'s CPU ranks and ``%%sharedtrain``'s CPU workers.
"""
from __future__ import annotations

import ast

from ..trees import copy_tree

__all__ = ["rewrite_for_cpu_workers", "bind_placement"]


def rewrite_for_cpu_workers(tree: ast.Module, namespace: dict) -> tuple[ast.Module, str | None]:
    """``(tree rewritten, helper name)``; ``(tree, None)`` as given where nothing needed rewriting."""
    from .helper import HELPER, rewrite_placement
    rewritten, rewriter = rewrite_placement(copy_tree(tree), namespace)
    return (rewritten, HELPER) if rewriter.rewrites else (tree, None)


def bind_placement(ns: dict, name: str | None, device) -> None:
    """In a worker: bind ``name`` (from :func:`rewrite_for_cpu_workers`; None: nothing) to a placement
    for ``device``, so the rewritten cell's ``.cuda()`` calls land there."""
    if not name:
        return
    import torch

    from .helper import Placement, install_passthrough
    install_passthrough()
    ns[name] = Placement(torch.device(device))
