"""Which parts of a model ``--strategy fsdp`` shards as units, and the cell's mixed precision.

FSDP gathers one unit's parameters at a time, so peak memory is the shards
plus the largest unit. The natural units are a model's repeated blocks: the
elements of an ``nn.ModuleList`` or ``nn.Sequential`` that repeat a class
(a transformer's layers, a ResNet's bottlenecks). :func:`choose_blocks`
finds them, or checks the classes ``--wrap`` names, raising ``UsageError``
that lists the model's candidate classes before anything starts.

In a notebook::

    choose_blocks(nn.TransformerEncoder(layer, 6))     # ['TransformerEncoderLayer']
"""
from __future__ import annotations

import ast
from collections import Counter
from typing import Any

__all__ = ["choose_blocks", "candidate_blocks", "block_instances", "autocast_dtype"]


def _holds_parameters(module) -> bool:
    return next(module.parameters(), None) is not None


def _repeated_children(module) -> list[type]:
    """Classes repeated among the elements of ``module``'s containers, outermost first."""
    import torch.nn as nn
    found: list[type] = []
    for sub in module.modules():
        if not isinstance(sub, (nn.ModuleList, nn.Sequential)):
            continue
        counts = Counter(type(c) for c in sub.children() if _holds_parameters(c))
        found += [cls for cls, n in counts.items() if n >= 2 and cls not in found]
    return found


def _nested_in(module: Any, inner: type, outer: type) -> bool:
    """Whether some ``outer`` submodule of ``module`` contains an ``inner`` one."""
    return any(kind is outer and any(type(sub) is inner for sub in list(block.modules())[1:])
               for block, kind in ((m, type(m)) for m in module.modules()))


def candidate_blocks(module) -> list[str]:
    """Class names that could be FSDP units: repeated in a container, or holding parameters twice or more."""
    names = [c.__name__ for c in _repeated_children(module)]
    counts = Counter(type(m) for m in module.modules() if m is not module and _holds_parameters(m))
    names += sorted(c.__name__ for c, n in counts.items() if n >= 2 and c.__name__ not in names)
    return names


def block_instances(module, class_names: list[str]) -> list:
    """The submodules of ``module`` of the named classes, outermost only (a block inside a block is
    part of it), in ``module.modules()`` order."""
    wanted = set(class_names)
    chosen: list = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside or m is module:
            continue
        if type(m).__name__ in wanted:
            chosen.append(m)
            inside.update(id(s) for s in m.modules())
    return chosen


def choose_blocks(module, wrap: list[str] | None = None, name: str = "model") -> list[str]:
    """The class names sharded as units: ``wrap`` (checked), else the repeated blocks; ``UsageError``
    when ``wrap`` names a class the model lacks or blocks that share parameters with the rest."""
    candidates = candidate_blocks(module)
    if wrap:
        present = {type(m).__name__ for m in module.modules() if m is not module}
        missing = [w for w in wrap if w not in present]
        if missing:
            from ...errors import usage_error  # here, not at the top: ranks import this module, and no IPython
            raise usage_error(f"--wrap {','.join(missing)}: {name} ({type(module).__name__}) has no such "
                              "submodule class; its candidate block classes are "
                              f"{', '.join(candidates) or '(none: it has no repeated blocks)'}",
                              [f"--wrap {c}" for c in candidates] or ["drop --wrap"])
        chosen = list(wrap)
    else:
        repeated = _repeated_children(module)
        # A repeated class inside another repeated block (an MLP's Linears in a transformer layer) is
        # part of that block's unit.
        outer = [c for c in repeated if not any(o is not c and _nested_in(module, c, o) for o in repeated)]
        # Unasked, a class whose blocks share weights with the rest is simply not a unit.
        chosen = [c.__name__ for c in outer if _shares_parameters(module, [c.__name__]) is None]
    shared = _shares_parameters(module, chosen)
    if shared is not None:
        from ...errors import usage_error
        others = [c for c in candidates if c != shared]
        raise usage_error(f"--strategy fsdp cannot shard {name} with {shared} as a unit: a parameter of a {shared} "
                          "is also used outside it (tied weights), and FSDP shards each parameter in one unit only; "
                          "name other block classes with --wrap",
                          [f"--wrap {c}" for c in others] or ["--strategy fsdp without --wrap"])
    return chosen


def _shares_parameters(module, chosen: list[str]) -> str | None:
    """The first unit class one of whose parameters another unit or the rest of the model also uses
    (tied weights: FSDP would shard it twice), or None."""
    blocks = block_instances(module, chosen)
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            if owner.setdefault(id(p), i) != i:
                return type(block).__name__
    in_blocks = {id(s) for b in blocks for s in b.modules()}
    for m in module.modules():
        if id(m) in in_blocks:
            continue
        for p in m.parameters(recurse=False):
            if id(p) in owner:
                return type(blocks[owner[id(p)]]).__name__
    return None


_DEFAULT_AUTOCAST = {"cuda": "float16", "cpu": "bfloat16"}


def autocast_dtype(tree: ast.AST, namespace: dict | None = None) -> str | None:
    """The dtype of the first ``torch.autocast(...)`` / ``torch.amp.autocast(...)`` the cell enters,
    as a torch dtype name (``"bfloat16"``), or None: no autocast, ``enabled=False``, or a dtype or
    ``enabled`` the notebook's names do not settle (then FSDP gathers in fp32: slower, not wrong).
    Without ``dtype=`` it is the device type's default."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        for item in node.items:
            call = item.context_expr
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "autocast":
                continue
            keywords = {kw.arg: kw.value for kw in call.keywords}
            if "enabled" in keywords and _value(keywords["enabled"], namespace) is not True:
                return None
            if "dtype" in keywords:
                dtype = _value(keywords["dtype"], namespace)
                return str(dtype).removeprefix("torch.") if type(dtype).__name__ == "dtype" else None
            first = call.args[0] if call.args else keywords.get("device_type")
            device = _value(first, namespace) if first is not None else None
            if ast.unparse(func).startswith(("torch.cuda.amp", "cuda.amp")):
                device = "cuda"
            return _DEFAULT_AUTOCAST.get(device if isinstance(device, str) else "cuda")
    return None


_UNKNOWN = object()


def _value(node: ast.expr, namespace: dict | None):
    """A constant, or a name or attribute chain (``torch.bfloat16``, ``DTYPE``, ``cfg.dtype``) read
    from the notebook; ``_UNKNOWN`` for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return _UNKNOWN
    import builtins
    if node.id == "torch" and (namespace is None or "torch" not in namespace):
        import torch
        value: object = torch
    elif namespace is not None and node.id in namespace:
        value = namespace[node.id]
    elif hasattr(builtins, node.id):
        value = getattr(builtins, node.id)
    else:
        return _UNKNOWN
    for attr in reversed(chain):
        try:
            value = getattr(value, attr)
        except Exception:  # noqa: BLE001 - any attribute may raise: not settled
            return _UNKNOWN
    return value
