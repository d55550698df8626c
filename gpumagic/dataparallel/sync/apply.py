"""In the kernel: what a ``%%dataparallel`` cell changed (:class:`~gpumagic.dataparallel.protocol.Changes`), made
to the notebook's own objects, as a plain cell would have made it.

Every object the changes name is found first, at the path it had as the cell started, and every new value
is unpickled (the notebook's objects in place of their refs) before anything is written: one list under
two names, or refilled while another holds its items, is built from the notebook's objects as they were.
Then tensors and arrays take their new contents in place (only the items that differ, so two views of one
tensor keep each other's), lists and dicts are refilled in place (keeping their type and key order), and
attributes and names are set. The cell's functions and classes are defined again once its names are bound;
what holds instances of those classes is unpickled after that. A value that cannot be unpickled here is
named, and left as it was; a name the cell bound that did not come back is unbound (not left holding an
earlier cell's object).

In a notebook (what the magic does with rank 0's answer)::

    applied = apply_changes(get_ipython().user_ns, returned.changes, define, assigned)
"""
from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...cell.values import is_stateful
from ..protocol import Blob, Changes, RemoteRepr
from .paths import MISSING, follow, owner_text, text
from .pickler import loaded

logger = logging.getLogger(__name__)

__all__ = ["Applied", "apply_changes", "refill", "fill_mask"]


@dataclass
class Applied:
    """What :func:`apply_changes` did."""
    bound: list[str] = field(default_factory=list)        # names, and where objects changed ("args.epochs")
    not_returned: list[str] = field(default_factory=list)  # the note's entries: rank 0's, and what could not be
                                                           # unpickled here
    defined: list[str] = field(default_factory=list)
    not_defined: list[str] = field(default_factory=list)
    made: list = field(default_factory=list)              # the models the cell made, as the notebook holds them
    made_names: list[str] = field(default_factory=list)   # the names bound to them
    value: Any = None                                     # the cell's last expression, as the notebook has it


def refill(container, keep: int, tail) -> bool:
    """The notebook's list or dict keeps its first ``keep`` items and takes ``tail`` after them (a list's
    items, a dict's ``(key, value)`` pairs), staying the same object of the same type; False where it is not
    a list or dict."""
    if isinstance(container, list):
        container[keep:] = tail
    elif isinstance(container, dict):
        items = list(container.items())[:keep] + list(tail)
        container.clear()
        container.update(items)
    else:
        return False
    return True


def _same_kind(old, value) -> str | None:
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
            and old.shape == value.shape and old.dtype == value.dtype:
        return "tensor"
    if numpy is not None and isinstance(old, numpy.ndarray) and isinstance(value, numpy.ndarray) and \
            old.shape == value.shape and old.dtype == value.dtype and old.flags.writeable:
        return "array"
    return None


def fill_mask(old, value):
    """Where ``value`` differs from the notebook's tensor or array ``old`` of its shape (a mask), or None
    (copied whole)."""
    kind = _same_kind(old, value)
    try:
        mask = old.ne(value.to(old.device)) if kind == "tensor" else old != value if kind == "array" else None
    except Exception:  # a kind without elementwise comparison: copied whole
        logger.debug("no elementwise comparison of a %s: copied whole", type(old).__name__, exc_info=True)
        return None
    return mask if getattr(mask, "shape", None) == getattr(old, "shape", ()) and \
        str(getattr(mask, "dtype", "")) in ("bool", "torch.bool") else None


def _fill(old, value, mask) -> bool:
    """The notebook's tensor or array ``old`` takes ``value``'s contents (where ``mask``); False where their
    shapes or dtypes differ."""
    kind = _same_kind(old, value)
    if kind == "tensor":
        import torch
        with torch.no_grad():
            if mask is None:
                old.copy_(value)
            else:
                old[mask] = value.to(old.device)[mask]
    elif kind == "array":
        if mask is None:
            old[...] = value
        else:
            old[mask] = value[mask]
    else:
        return False
    return True


def _set_at(ns: dict, path: tuple, value) -> None:
    """Put ``value`` where ``path`` is: a name, an attribute, an item."""
    if len(path) == 1:
        ns[path[0]] = value
        return
    parent = follow(ns, path[:-1])
    kind, key = path[-1]
    if kind == "attr":
        setattr(parent, key, value)
    elif kind == "item" and isinstance(parent, (list, dict)):
        parent[key] = value


class _Apply:
    def __init__(self, ns: dict, changes: Changes):
        self.ns, self.changes = ns, changes
        self.out = Applied()
        # The models the cell made: copies, since their tensors are views of a buffer the next cell reuses.
        made = {key: copy.deepcopy(model) for key, model in changes.made.items()}
        self.out.made = list(made.values())
        self.objects: dict = {("made", key): model for key, model in made.items()}
        self.values: dict = {}   # (kind, where) -> unpickled value

    def blobs(self) -> list[tuple[tuple, Blob]]:
        c = self.changes
        found: list[tuple[tuple, Blob]] = [(("name", n), b) for n, b in c.names.items()]
        found += [(("attr", (p, k)), b) for p, attrs in c.attributes.items() for k, b in attrs.items()]
        found += [(("refill", p), r.tail) for p, r in c.refills.items()]
        return found

    def resolve(self, blobs: list) -> None:
        """Every path the changes name, found in the notebook before anything is written."""
        refs = {ref for _, blob in blobs for ref in blob.refs if ref[0] == "path"}
        refs |= {("path", p) for p in [*self.changes.fills, *self.changes.refills, *self.changes.attributes,
                                       *self.changes.deleted_attributes]}
        for ref in refs:
            found = follow(self.ns, ref[1])
            if found is not MISSING:
                self.objects[ref] = found

    def load(self, blobs: list) -> None:
        """Unpickle each blob once (names pickled together share what they hold); each entry takes its own."""
        loaded_: dict = {}
        for where, blob in blobs:
            if id(blob) not in loaded_:
                loaded_[id(blob)] = self._loaded(blob)
            got = loaded_[id(blob)]
            if isinstance(got, str):
                self.out.not_returned.append(f"{_where_text(where)} ({got})")
            elif where[0] in ("name", "attr"):
                self.values[where] = got[where[1] if where[0] == "name" else where[1][1]]
            else:
                self.values[where] = got

    def _loaded(self, blob: Blob):
        """What ``blob`` holds, or why it cannot be unpickled here (a str)."""
        # (a model the cell made that could not travel: what holds it cannot come back either)
        failed = [self.changes.made_failed[r[1]] for r in blob.refs
                  if r[0] == "made" and r[1] in self.changes.made_failed]
        if failed:
            return failed[0]
        try:
            return loaded(blob, self.objects)
        except Exception as exc:  # named in the cell's note, with the reason
            logger.debug("a blob could not be unpickled in the kernel", exc_info=True)
            return f"{type(exc).__name__}: {exc}"

    def fills(self) -> None:
        masks = {p: fill_mask(self.objects.get(("path", p)), v) for p, v in self.changes.fills.items()}
        for path, value in self.changes.fills.items():
            if not _fill(self.objects.get(("path", path)), value, masks[path]):
                logger.debug("%s changed shape or dtype in place: set to rank 0's", text(path))
                # (a copy: what arrived is a view of a buffer the next cell reuses)
                _set_at(self.ns, path, value.clone() if hasattr(value, "clone") else value)
            self.out.bound.append(owner_text(path))

    def write(self, blobs: list) -> None:
        """The unpickled values of ``blobs`` where they go."""
        for where, _ in blobs:
            if where not in self.values:
                continue
            value = self.values[where]
            kind, at = where
            if kind == "name":
                self.ns[at] = value
                made = any(value is m for m in self.out.made)
                (self.out.made_names if made else self.out.bound).append(at)
            elif kind == "value":
                self.out.value = value
            elif kind == "attr":
                setattr(self.objects[("path", at[0])], at[1], value)
                self.out.bound.append(f"{text(at[0])}.{at[1]}")
            elif refill(self.objects.get(("path", at)), self.changes.refills[at].keep, value):
                self.out.bound.append(owner_text(at))

    def deletions(self) -> None:
        for path, attrs in self.changes.deleted_attributes.items():
            target = self.objects.get(("path", path))
            for attr in attrs:
                if attr in getattr(target, "__dict__", {}):
                    delattr(target, attr)
        for name in self.changes.deleted:   # unbound by the cell's ``del``, as after a plain cell
            self.ns.pop(name, None)


def _where_text(where: tuple) -> str:
    kind, at = where
    if kind == "value":
        return "the last expression"
    return at if kind == "name" else f"{text(at[0])}.{at[1]}" if kind == "attr" else owner_text(at)


def apply_changes(ns: dict, changes: Changes, define: Callable | None = None, assigned=(), value=None) -> Applied:
    """Make ``changes`` to the notebook ``ns`` (see the module's docstring). ``define(names)`` runs the cell's
    ``def``, ``class`` and ``import`` statements again (:func:`~gpumagic.cell.definitions.define_in_notebook`);
    ``assigned``: the names the cell binds, those that did not come back being unbound; ``value``: the cell's
    last expression as it travelled (a blob, or its repr)."""
    work = _Apply(ns, changes)
    work.out.not_returned = list(changes.not_returned)
    blobs = work.blobs()
    if isinstance(value, Blob):
        blobs.append((("value", None), value))
    work.resolve(blobs)
    early = [(w, b) for w, b in blobs if not any(r[0] == "late" for r in b.refs)]
    late = [(w, b) for w, b in blobs if any(r[0] == "late" for r in b.refs)]
    work.load(early)
    work.fills()
    work.write(early)
    work.deletions()
    defined, not_defined = define(changes.defined) if define is not None and changes.defined else ([], [])
    work.out.defined, work.out.not_defined = defined, not_defined
    work.objects.update({("late", name): ns[name] for name in defined})
    work.load(late)
    work.write(late)
    if isinstance(value, RemoteRepr):
        work.out.value = value
    _adopt_cell_classes(work.out.made, {(c.__module__, c.__qualname__): c for c in (ns.get(n) for n in defined)
                                        if isinstance(c, type)})
    _unbind_not_returned(ns, assigned, work.out.not_returned)
    work.out.bound = list(dict.fromkeys(work.out.bound))
    return work.out


def _adopt_cell_classes(made: list, classes: dict) -> None:
    """Models the cell built from classes it defined arrive as instances of copies of those classes: they
    become instances of the classes the notebook now holds (``classes``, by module and qualified name), so
    that ``isinstance(head, Head)`` holds and ``torch.save(head)`` finds the class, as after a plain cell."""
    for model in made if classes else []:
        for sub in model.modules():
            cls = classes.get((type(sub).__module__, type(sub).__qualname__))
            if cls is not None and cls is not type(sub):
                sub.__class__ = cls


def _unbind_not_returned(ns: dict, assigned, not_returned: list[str]) -> None:
    """Names the cell bound anew that do not come back (``trainer = Trainer(...)``, noted as ending with the
    cell) are unbound in the notebook too: left alone, they would hold what an earlier cell bound (the trainer
    of a plain run), which the next cell would read as the cell's. A notebook model, optimizer, loader or
    scheduler the cell rebound to a framework's wrapper of it (``loader = accelerator.prepare(loader)``)
    stays: it is the object the cell trained with."""
    import torch
    kept = (torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)
    for entry in not_returned:
        name = entry.split(" (", 1)[0]
        if name in assigned and name in ns and not (isinstance(ns[name], kept) or is_stateful(ns[name])):
            del ns[name]
