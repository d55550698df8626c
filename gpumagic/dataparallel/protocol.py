"""The contract between the kernel and the ranks of a ``%%dataparallel`` cell: all that crosses between them.

The kernel sends every rank a :class:`CellOrder` (with the notebook's values packed by
:mod:`gpumagic.procs.wire`); while the cell runs, ranks send :class:`Started`, :class:`Progress`,
:class:`CellWarning`, :class:`Note` and :class:`Writing` messages; each rank ends with a :class:`RankDone`,
rank 0's carrying its :class:`Returned` (packed by :mod:`gpumagic.procs.wire`, tensors in the bulk
buffer): the trained state (:class:`Trained`, or :class:`Gathered` where ``--strategy fsdp`` gathered
it), and what the cell changed in the notebook (:class:`Changes`, :mod:`.sync`). Every field is typed;
nothing is looked up by a key that may be missing.

Imported by the kernel and by the ranks: no IPython, and no torch at import.

In a notebook (what rank 0 answered for the last cell)::

    dataparallel.per_rank[0].steps
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GRADS_KEY", "Path", "CellCode", "Roles", "Watch", "Settings", "CellOrder", "RankStats", "Started",
           "Progress", "CellWarning", "Note", "Writing", "Blob", "Refill", "Changes", "Trained", "GatheredTensor",
           "GatheredOptimizer", "Gathered", "RemoteRepr", "Returned", "RankDone"]

# Where the notebook's gradients travel among the cell's values (taken out by the ranks before the cell runs).
GRADS_KEY = "__gpumagic_grads__"

# Where an object is in the notebook: a name, then steps ("attr", name), ("item", key) or ("layer", "fc.0").
Path = tuple


@dataclass(frozen=True)
class CellCode:
    """The cell as the ranks run it."""
    tree: Any                               # its syntax tree (a cell.trees.Flat on the way)
    filename: str                           # what tracebacks call it (``Cell In[12]``)
    source: str
    placement: Any = None                   # the .cuda() rewrite's helper, where the ranks are on the CPU
    loop_targets: tuple[str, ...] = ()      # names bound by ``for`` and ``with``: their batches stay in the ranks


@dataclass(frozen=True)
class Roles:
    """The notebook names each part of the training plays."""
    modules: tuple[str, ...]
    optimizers: tuple[str, ...]
    loaders: tuple[str, ...]                # split across the ranks
    stateful: tuple[str, ...]               # schedulers and other objects with a state_dict
    device_strings: tuple[str, ...] = ()    # names holding 'cuda' or 'cuda:k': the rank's own device

    @property
    def trained(self) -> frozenset:
        """What the strategy answers for: the modules, optimizers and loaders."""
        return frozenset((*self.modules, *self.optimizers, *self.loaders))


@dataclass(frozen=True)
class Watch:
    """What rank 0 watches for the way back (:mod:`.sync`)."""
    roots: tuple[str, ...]                  # notebook names the cell reads: what they hold may change in place
    assigned: tuple[str, ...]               # names the cell binds
    deleted: tuple[str, ...] = ()           # names the cell's ``del`` unbinds
    set_attributes: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (path, attributes the cell's code sets)
    filled: tuple[str, ...] = ()            # tensors and arrays whose items the cell sets: always sent back


@dataclass(frozen=True)
class Settings:
    """The kernel's torch settings, which decide results as much as the code."""
    torch: dict                             # matmul precision, default dtype... (procs.torch_settings)
    compile: dict                           # torch._dynamo / _inductor settings (procs.compile_settings)


@dataclass(frozen=True)
class CellOrder:
    """What the kernel sends every rank: the cell, the names' roles, and how to run it."""
    values: bytes                           # the notebook's values, packed (procs.wire header)
    shared: list                            # tensors sent by reference (shared memory)
    code: CellCode
    roles: Roles
    watch: Watch
    strategy: Any                           # the rank's side of the strategy (strategies.base.RankStrategy)
    seed: int
    settings: Settings
    relays: dict                            # the notebook's loggers that stay in the kernel (procs.relays)
    all_output: bool = False
    notebook: bool = False                  # the kernel is a notebook's: rich output (tqdm bars as HTML)


@dataclass
class RankStats:
    """What a rank counts while the cell runs (shown as progress)."""
    steps: int = 0
    samples: int | None = 0                 # None: not counted (launch mode: the framework reads the data)
    seconds: float = 0.0
    backwards: int = 0
    first_step: float | None = None         # seconds from the cell's start to its first optimizer step


@dataclass(frozen=True)
class Started:
    """A rank began running the user's code (its clock, ``time.monotonic()``)."""
    t: float


@dataclass(frozen=True)
class Progress:
    stats: RankStats


@dataclass(frozen=True)
class CellWarning:
    """A warning to show against the cell."""
    text: str


@dataclass(frozen=True)
class Note:
    text: str


@dataclass(frozen=True)
class Writing:
    """fsdp's rank 0 began writing the trained state into the notebook's tensors."""


@dataclass(frozen=True)
class Blob:
    """An object pickled by :mod:`.sync.pickler`: the notebook's objects it holds travel as ``refs``."""
    data: bytes
    refs: tuple = ()                        # ("path", Path), ("late", name) or ("made", key)


@dataclass(frozen=True)
class Refill:
    """A notebook list or dict changed in place: its first ``keep`` items stay, ``tail`` follows them
    (a list's items, or a dict's ``(key, value)`` pairs)."""
    keep: int
    tail: Blob


@dataclass
class Changes:
    """What the cell changed in the notebook, as rank 0 saw it (:mod:`.sync.capture`)."""
    names: dict[str, Blob] = field(default_factory=dict)             # names the cell bound
    deleted: list[str] = field(default_factory=list)                 # names its ``del`` unbound
    fills: dict[Path, Any] = field(default_factory=dict)             # tensors and arrays changed in place
    refills: dict[Path, Refill] = field(default_factory=dict)        # lists and dicts changed in place
    attributes: dict[Path, dict[str, Blob]] = field(default_factory=dict)   # set on the notebook's objects
    deleted_attributes: dict[Path, list[str]] = field(default_factory=dict)
    made: dict[int, Any] = field(default_factory=dict)               # models the cell made, whole (by key)
    made_failed: dict[int, str] = field(default_factory=dict)        # those that cannot travel: why
    defined: list[str] = field(default_factory=list)                 # functions, classes, imports it bound
    not_returned: list[str] = field(default_factory=list)            # the note's entries, with why


@dataclass
class Trained:
    """Rank 0's trained state, for the notebook's own objects."""
    modules: dict[str, dict] = field(default_factory=dict)           # state dicts
    settings: dict[str, dict] = field(default_factory=dict)          # cell.module_settings
    grads: dict[str, dict] = field(default_factory=dict)             # parameter name -> gradient or None
    reshaped: dict[str, Any] = field(default_factory=dict)           # modules whose layers the cell replaced
    optimizers: dict[str, dict] = field(default_factory=dict)        # state dicts
    stateful: dict[str, dict] = field(default_factory=dict)          # schedulers' state dicts
    generators: dict[str, Any] = field(default_factory=dict)         # a loader's own generator's state
    scripted: dict[str, str] = field(default_factory=dict)           # name -> the module to script again


@dataclass(frozen=True)
class GatheredTensor:
    """One tensor fsdp's rank 0 gathered: written into the notebook's (``offset`` -1) or into the buffer."""
    ref: tuple                              # ("module", name, fqn) or ("optimizer", name, index, key)
    offset: int
    dtype: str
    shape: tuple
    key: tuple                              # its fingerprint, for the next cell


@dataclass(frozen=True)
class GatheredOptimizer:
    param_groups: list                      # hyperparameters, without the parameters
    plain: dict                             # index -> non-tensor state (a step count)


@dataclass
class Gathered:
    """What ``--strategy fsdp`` gathered after the cell, one tensor at a time."""
    tensors: list[GatheredTensor] = field(default_factory=list)
    optimizers: dict[str, GatheredOptimizer] = field(default_factory=dict)
    deferred: list[tuple] = field(default_factory=list)              # (ref, dtype, shape) the kernel makes


class RemoteRepr:
    """Rank 0's last expression where it cannot travel: shown by its repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


@dataclass
class Returned:
    """Rank 0's answer for the cell."""
    trained: Trained
    changes: Changes
    value: Any = None                       # a Blob of the last expression, a RemoteRepr, or None
    torch_settings: dict = field(default_factory=dict)   # what the cell changed (set_default_dtype...)


@dataclass
class RankDone:
    """What each rank answers once its cell ended."""
    stats: RankStats
    started: float                          # its clock when the user's code began and ended
    ended: float
    keys: frozenset = frozenset()           # fingerprints of the tensors it keeps for the next cell
    returned: bytes | None = None           # rank 0: :class:`Returned`, packed (procs.wire header)
    returned_bytes: int = 0
    gathered: Gathered | None = None        # rank 0 under fsdp
