"""What a ``%%dataparallel`` cell trains and reads from the notebook, found in the kernel before anything starts
(:func:`survey_cell`): its modules, their optimizers, the DataLoaders split across the ranks, schedulers and
other objects with a state dict, and what rank 0 watches for the way back (:mod:`..sync`).

A cell that uses no module, or a loader that cannot be split, is a ``UsageError`` naming what would work;
a write the cell makes that the way back cannot bring (an item of a list too long to compare, an attribute
of an object of a library's class held in a list) is named in the cell's note (:func:`item_notes`).

In a notebook::

    survey = survey_cell(ast.parse(cell), Notebook.of(get_ipython()), models=None)
    survey.modules, survey.loaders
"""
from __future__ import annotations

import ast
import logging
import types
import warnings
from dataclasses import dataclass, field

from ...cell.names import (
    attributes_assigned,
    calls_assigned,
    items_assigned,
    names_assigned,
    names_deleted,
    names_tree,
    notebook_names,
    used_names,
)
from ...cell.values import find_loaders, find_modules, find_optimizers, is_stateful
from ...errors import usage_error
from ..protocol import Roles, Watch
from ..rank.devices import CUDA_STRING
from ..sync.paths import text
from ..sync.reach import UNKNOWN, comes_back, is_array

__all__ = ["CellSurvey", "survey_cell", "read_names", "warn_in_cell", "item_notes"]

logger = logging.getLogger(__name__)

_CODE = (types.ModuleType, type, types.FunctionType)


@dataclass
class CellSurvey:
    """What a cell trains and reads from the notebook, found before anything starts."""
    used: list                  # notebook names the cell (and the notebook functions it calls) reads
    modules: dict
    optimizers: dict
    loaders: dict               # name -> DataLoader: those split across the ranks
    read_loaders: dict          # every loader it reads (launch mode splits none)
    stateful: list              # schedulers and other objects with a state_dict
    assigned: list
    device_strings: list        # names holding 'cuda' or 'cuda:k': the rank's own device in the cell
    roots: list = field(default_factory=list)          # what rank 0 watches: the names it reads, untrained
    filled: list = field(default_factory=list)         # notebook tensors and arrays whose items the cell sets
    set_attributes: dict = field(default_factory=dict)  # path -> attributes the cell sets on that object
    notes: list = field(default_factory=list)          # writes that do not come back, for the note

    def roles(self) -> Roles:
        return Roles(tuple(self.modules), tuple(self.optimizers), tuple(self.loaders), tuple(self.stateful),
                     tuple(self.device_strings))

    def watch(self, tree) -> Watch:
        return Watch(tuple(self.roots), tuple(self.assigned), tuple(names_deleted(tree)),
                     tuple((p, tuple(attrs)) for p, attrs in self.set_attributes.items()), tuple(self.filled))


def read_names(tree, notebook) -> list[str]:
    """The notebook names the cell reads, and those the notebook functions it calls read."""
    ns = notebook.ns
    return notebook_names(used_names(tree, ns), ns, notebook.hidden)


def warn_in_cell(text: str, filename: str) -> None:
    """A warning shown against the cell (``filename``, line 1), not gpumagic's own line, each time."""
    warnings.warn_explicit(text, UserWarning, filename, 1)


def _modules_built(tree, ns: dict) -> list[str]:
    """Names the cell binds to a new ``torch.nn.Module`` (``net = nn.Sequential(...)``, ``model = Net()``)."""
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


def _split_loaders(tree, read_loaders: dict, splits: bool, filename: str) -> dict:
    """The loaders split across the ranks (none where the cell's framework splits them), with warnings where
    the ranks would repeat each other's work."""
    import torch
    for name, loader in read_loaders.items():
        if loader.batch_sampler is None and splits:
            raise usage_error(f"DataLoader {name!r} has batch_size=None: it cannot be split into per-rank batches; "
                              "give it a batch_size")
    if not splits:
        return {}   # the framework splits them; the notebook's stay as they are
    if not read_loaders:
        built = _loaders_built(tree)
        warn_in_cell(f"the cell builds its DataLoader itself ({', '.join(built)}), so it is not split: every rank "
                     "reads all of it and repeats the others' work (no speed-up). Build the DataLoader in an earlier "
                     "cell and iterate it here, so each rank gets its share of every batch." if built else
                     "the cell reads no DataLoader from the notebook: every rank sees the same data, so the ranks "
                     "repeat each other's work (same result, no speed-up). Iterate a torch.utils.data.DataLoader "
                     "made in an earlier cell to split each batch across the ranks.", filename)
    loaders = {}
    for n, loader in read_loaders.items():
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            warn_in_cell(f"DataLoader {n!r} reads an IterableDataset: every rank reads all of it; shard it inside "
                         "the dataset with torch.distributed.get_rank()", filename)
        else:
            loaders[n] = loader
    return loaders


def survey_cell(tree, notebook, models: list[str] | None = None, splits: bool = True, used: list[str] | None = None,
                filename: str = "<cell>") -> CellSurvey:
    """Find what the cell trains; ``UsageError`` before anything starts when it cannot run.

    ``splits``: gpumagic wraps the models and splits the loaders (False in launch mode, where the cell's
    framework does, and the model may be made in the cell). ``used``: the cell's :func:`read_names`, where the
    caller has them already; ``filename``: the cell's, for warnings.
    """
    import torch
    ns = notebook.ns
    used = read_names(tree, notebook) if used is None else used
    probe = names_tree(used)
    built = _modules_built(tree, ns)
    hint = (f" (the cell builds {', '.join(built)} itself: every rank would start from other weights, and nothing "
            "would come back into the notebook; build it in an earlier cell and train it here)" if built else "")
    modules = find_modules(probe if not models else tree, ns, models, required=splits,
                           hint=hint + "; or, where the cell trains through a framework that reading it did not "
                                       "show (a Trainer, Accelerator or Fabric behind a call), run it with --launch")
    optimizers = find_optimizers(probe, ns, modules)
    read_loaders = find_loaders(probe, ns)
    loaders = _split_loaders(tree, read_loaders, splits, filename)
    names = list(dict.fromkeys(list(modules) + used))
    stateful = [n for n in used if n not in modules and is_stateful(ns[n])]
    trained = set(modules) | set(optimizers) | set(read_loaders)
    roots = [n for n in names if n not in trained and not isinstance(ns[n], (*_CODE, torch.nn.Module))]
    items = {root: targets for root, targets in items_assigned(tree).items() if root in roots}
    filled = [root for root in items if is_array(ns[root])]
    survey = CellSurvey(
        used=names, modules=modules, optimizers=optimizers, loaders=loaders, read_loaders=read_loaders,
        stateful=stateful, assigned=names_assigned(tree),
        device_strings=[n for n in names if isinstance(ns[n], str) and CUDA_STRING.match(ns[n])],
        roots=roots, filled=filled,
        set_attributes={p: attrs for p, attrs in attributes_assigned(tree).items() if p.split(".")[0] in roots})
    ids = {id(sub) for m in modules.values() for sub in m.modules()}
    survey.notes = item_notes(ns, {r: t for r, t in items.items() if r not in filled}, ids)
    return survey


def _steps(target: str) -> tuple[str, list]:
    """``rec.outs[0].x`` as ``("rec", [("attr", "outs"), ("item", 0), ("attr", "x")])``; an item key the code
    computes is :data:`~..sync.reach.UNKNOWN`."""
    node = ast.parse(target, mode="eval").body
    steps: list = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
        else:
            key = node.slice
            steps.append(("item", key.value if isinstance(key, ast.Constant) else UNKNOWN))
        node = node.value
    return (node.id if isinstance(node, ast.Name) else ""), steps[::-1]


def item_notes(ns: dict, items: dict, trained: set[int]) -> list[str]:
    """The note's entries for what the cell sets through items of the notebook's objects (``{root: targets}``)
    that the way back does not bring (:func:`~..sync.reach.comes_back`)."""
    notes = []
    for root, targets in items.items():
        for target in targets:
            try:
                name, steps = _steps(target)
            except SyntaxError:   # (unparsed from the cell's own tree: not expected)
                logger.debug("%s: not read as a target", target, exc_info=True)
                continue
            if name != root or not steps or comes_back(ns, root, steps, trained):
                continue
            cut = next((i for i, (kind, _) in enumerate(steps) if kind == "item"), len(steps))
            holder = text((root, *steps[:cut]))
            if steps[-1][0] == "attr" and cut < len(steps) - 1:
                notes.append(f"{target} (set on an object held in {holder}, which does not come back; set it in a "
                             "plain cell)")
            else:
                value = ns.get(root)
                for _, key in steps[:cut]:
                    value = getattr(value, key, None)
                notes.append(f"{target} (set through an item of {holder}, a {type(value).__name__} that does not "
                             "come back; set it in a plain cell)")
    return notes
