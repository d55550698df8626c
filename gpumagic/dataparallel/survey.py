"""What a ``%%dataparallel`` cell trains and reads from the notebook, found in the kernel before anything
starts (:func:`survey_cell`): its modules, their optimizers, the DataLoaders split across the ranks,
stateful objects, the values that come back, and the notebook objects rank 0 compares after the cell.
"""
from __future__ import annotations

import ast
import logging
import types
import warnings
from dataclasses import dataclass, field

from ..cell.names import (
    attributes_assigned,
    calls_assigned,
    items_assigned,
    names_assigned,
    names_tree,
    notebook_names,
    used_names,
)
from ..cell.values import find_loaders, find_modules, find_optimizers, is_plain_value, is_stateful
from ..errors import usage_error
from .containers import LONG_ITEMS, holds_containers, is_container
from .plan import Plan
from .returnable import WATCHED_ITEMS, follow_path, is_compared, watched_paths
from .touched import is_array
from .wrapping import CUDA_STRING

__all__ = ["CellSurvey", "survey_cell", "read_names", "warn_in_cell", "item_notes"]

logger = logging.getLogger(__name__)


@dataclass
class CellSurvey:
    """What a cell trains and reads from the notebook, found before anything starts."""
    used: list            # notebook names the cell (and the notebook functions it calls) reads
    modules: dict
    optimizers: dict
    loaders: dict         # name -> DataLoader, those split across the ranks
    stateful: list        # schedulers and other objects with a state_dict
    assigned: list
    return_names: list    # names whose plain values come back
    watched: list         # notebook objects of notebook classes (and those they hold, as "cfg.optim"):
                          # their changed plain attributes come back
    set_attributes: dict  # name or path -> attributes the cell sets on that notebook object
    device_strings: list  # names holding 'cuda' or 'cuda:k': the rank's own device in the cell
    watched_if_kept: list = field(default_factory=list)   # names in ``watched`` the cell binds: theirs come back
                                                          # only where the cell left them on the same object
    filled: list = field(default_factory=list)         # notebook tensors and arrays whose items the cell sets
    arrays: list = field(default_factory=list)         # the others it reaches: compared on rank 0 (touched.py)
    containers: list = field(default_factory=list)     # dicts and lists holding objects: compared on rank 0
    # what the cell sets through items and does not come back: (holder, whether they are set on objects it
    # holds, the holder coming back) -> (its type's name, targets)
    item_targets: dict = field(default_factory=dict)


def read_names(tree, shell) -> list[str]:
    """The notebook names the cell reads, and those the notebook functions it calls read."""
    ns = shell.user_ns
    return notebook_names(used_names(tree, ns), ns, getattr(shell, "user_ns_hidden", {}))


def warn_in_cell(text: str, filename: str) -> None:
    """A warning shown against the cell (``filename``, line 1), not gpumagic's own line, each time."""
    warnings.warn_explicit(text, UserWarning, filename, 1)


def survey_cell(tree, shell, plan: Plan, launch: bool = False, used: list[str] | None = None,
                filename: str = "<cell>") -> CellSurvey:
    """Find what the cell trains; ``UsageError`` before anything starts when it cannot run.

    In launch mode the cell's framework splits the data, and the model may be made in the cell.
    ``used``: the cell's :func:`read_names`, where the caller has them already; ``filename``: the
    cell's, for warnings.
    """
    import torch
    ns = shell.user_ns
    used = read_names(tree, shell) if used is None else used
    probe = names_tree(used)
    built = _modules_built(tree, ns)
    hint = (f" (the cell builds {', '.join(built)} itself: every rank would start from other weights, and nothing "
            "would come back into the notebook; build it in an earlier cell and train it here)" if built else "")
    modules = find_modules(probe if not plan.models else tree, ns, plan.models, required=not launch,
                           hint=hint + "; or, where the cell trains through a framework that reading it did not "
                                       "show (a Trainer, Accelerator or Fabric behind a call), run it with --launch")
    optimizers = find_optimizers(probe, ns, modules)
    read_loaders = find_loaders(probe, ns)
    for name, loader in read_loaders.items():
        if loader.batch_sampler is None and not launch:
            raise usage_error(f"DataLoader {name!r} has batch_size=None: it cannot be split into per-rank "
                              "batches; give it a batch_size")
    if launch:
        read_loaders = {}   # the framework splits them; the notebook's stay as they are
    elif not read_loaders:
        built = _loaders_built(tree)
        if built:
            warn_in_cell(f"the cell builds its DataLoader itself ({', '.join(built)}), so it is not split: every "
                         "rank reads all of it and repeats the others' work (no speed-up). Build the DataLoader in "
                         "an earlier cell and iterate it here, so each rank gets its share of every batch.", filename)
        else:
            warn_in_cell("the cell reads no DataLoader from the notebook: every rank sees the same data, so the "
                         "ranks repeat each other's work (same result, no speed-up). Iterate a "
                         "torch.utils.data.DataLoader made in an earlier cell to split each batch across the ranks.",
                         filename)
    loaders = {}   # the ones split across the ranks
    for n, loader in read_loaders.items():
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            warn_in_cell(f"DataLoader {n!r} reads an IterableDataset: every rank reads all of it; shard it "
                         "inside the dataset with torch.distributed.get_rank()", filename)
        else:
            loaders[n] = loader
    stateful = [n for n in used if n not in modules and is_stateful(ns[n])]
    assigned = names_assigned(tree)
    names = list(dict.fromkeys(list(modules) + used))
    plain_read = [n for n in names if n not in modules and is_plain_value(ns[n])]
    trained = set(modules) | set(optimizers) | set(read_loaders)
    others = [n for n in names if n not in trained and n not in stateful and n not in assigned
              and not isinstance(ns[n], (types.ModuleType, type, types.FunctionType, torch.nn.Module))]
    items = {root: targets for root, targets in items_assigned(tree).items()
             if root in others and root not in plain_read}
    # ``preds[idx] = out.argmax(1)`` on a notebook tensor or array: it comes back, filled in place
    filled = [root for root in items if is_array(ns[root])]
    # names the cell binds that may stay on the notebook's object (``ev = ev or Evaluator(model)``): watched
    # too, their changes coming back where the name does stay there (rank_state)
    rebindable = [n for n in names if n in assigned and n not in trained and n not in stateful
                  and not isinstance(ns[n], (types.ModuleType, type, types.FunctionType, torch.nn.Module))]
    watched = watched_paths(ns, others + stateful + rebindable)
    # (long ones too, their items compared by identity; plain ones holding lists and dicts, item by item, so
    # those stay the notebook's: ``train_loss = logs["train"]["loss"]`` keeps seeing the cell's appends)
    containers = [n for n in others if n not in plain_read and is_container(ns[n], LONG_ITEMS)
                  or n in plain_read and holds_containers(ns[n], WATCHED_ITEMS)]
    return CellSurvey(
        used=names, modules=modules, optimizers=optimizers, loaders=loaders, stateful=stateful,
        assigned=assigned,
        # the notebook's other objects: instances of its own classes (a LightningDataModule whose setup()
        # sets num_classes too, though its state_dict comes back), and what the cell sets on them
        watched=watched, watched_if_kept=rebindable,
        set_attributes={p: attrs for p, attrs in attributes_assigned(tree).items() if p.split(".")[0] in others},
        # (a plain one rank 0 compares item by item comes back through ``containers``: listed here for fsdp,
        # which makes its sharded tensors whole first, ``clip_grad_norm_``'s norms appended to it)
        return_names=[n for n in dict.fromkeys(assigned + plain_read + filled)
                      if n not in trained and n not in stateful],
        device_strings=[n for n in names if isinstance(ns[n], str) and CUDA_STRING.match(ns[n])],
        filled=filled,
        # set by a notebook function the cell calls (``def fill(i): preds[i] = ...``), or in place
        arrays=[n for n in others if n not in filled and n not in plain_read and is_array(ns[n])],
        # dicts and lists holding objects: rank 0 compares their items (containers.py)
        containers=containers,
        # ``cfgs[0].lr = 0.5``: set through an item on what may not come back (item_notes)
        item_targets=_not_coming_back(ns, {r: t for r, t in items.items() if r not in filled}, set(containers),
                                      set(watched), {id(m) for m in modules.values()}))


def _modules_built(tree, ns: dict) -> list[str]:
    """Names the cell binds to a new ``torch.nn.Module`` (``net = nn.Sequential(...)``, ``model = Net()``),
    where the class is the notebook's or torch's."""
    import torch
    built = []
    for names, chain in calls_assigned(tree):
        cls = ns.get(chain[0]) if chain else None
        for attr in (chain or [])[1:]:
            cls = getattr(cls, attr, None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            built += names
    return built


def _loaders_built(tree) -> list[str]:
    """Names the cell binds to a ``...DataLoader(...)`` call (``loader = DataLoader(ds, ...)``)."""
    return [n for names, chain in calls_assigned(tree) if chain and chain[-1].endswith("DataLoader") for n in names]


def _steps(target: str) -> list[str | None]:
    """``rec.outs[0].x`` as ``["outs", None, "x"]``: its attributes, and None for each item, root first."""
    node = ast.parse(target, mode="eval").body
    steps: list[str | None] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        steps.append(node.attr if isinstance(node, ast.Attribute) else None)
        node = node.value
    return steps[::-1]


def _not_coming_back(ns: dict, items: dict, containers: set, watched: set, trained: set[int]) -> dict:
    """Of ``items`` (``{root: targets set through items}``), what does not come back, as
    :attr:`CellSurvey.item_targets` holds it. What the cell sets through an item of a list or dict rank 0
    compares comes back: a notebook container (``held["n"] = 2``), or an attribute of a watched object
    holding one (``rec.outs[0] = t``: :mod:`.returnable`, which names one that does not); lists and dicts
    inside them too (``held["outs"][0] = t``), but not attributes set on the objects they hold
    (``held["box"].size = 3``: the box stays the notebook's). A trained module's layers (``trainer.model[2]
    = ...``) come back with it (``trained``: their ids)."""
    out: dict = {}
    for root, targets in items.items():
        for target in targets:
            try:
                steps = _steps(target)
            except SyntaxError:   # (unparsed from the cell's own tree: not expected)
                logger.debug("%s: not read as a target", target, exc_info=True)
                steps = [None]
            first = steps.index(None) if None in steps else len(steps)
            attrs = [str(a) for a in steps[:first]]
            holder = ".".join([root, *attrs])
            if id(follow_path(ns, holder)) in trained:
                continue
            owner = ".".join([root, *attrs[:-1]])
            compared = root in containers if not attrs else owner in watched and is_compared(
                getattr(follow_path(ns, owner), attrs[-1], None))   # (one the cell adds: compared as new)
            on_held = compared and any(s is not None for s in steps[first + 1:])
            if not compared or on_held:
                value = follow_path(ns, holder)
                if value is None and attrs:   # (an attribute the cell adds to an object that does not come back)
                    holder, value = root, ns[root]
                out.setdefault((holder, on_held), (type(value).__name__, []))[1].append(target)
    return out


def item_notes(item_targets: dict) -> list[str]:
    """The note's entries for :attr:`CellSurvey.item_targets`: what the cell set through items of notebook
    objects that do not come back, and attributes set on objects held in those that do."""
    notes = []
    for (holder, on_held), (kind, targets) in item_targets.items():
        many = len(targets) > 1
        if on_held:
            notes.append(f"{', '.join(targets)} (set on {'objects' if many else 'an object'} held in {holder}, "
                         f"which does not come back; set {'them' if many else 'it'} in a plain cell)")
        else:
            notes.append(f"{', '.join(targets)} (set through {'items' if many else 'an item'} of {holder}, a "
                         f"{kind} that does not come back; set {'them' if many else 'it'} in a plain cell)")
    return notes
