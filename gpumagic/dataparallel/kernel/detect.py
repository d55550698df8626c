"""Which mode a ``%%dataparallel`` cell runs in: gpumagic's DDP, or launch mode for code that distributes itself.

A cell that builds a Hugging Face ``Trainer``, an accelerate ``Accelerator``,
a Lightning ``Trainer``, ``Fabric`` or ``LightningCLI``, its own ``DistributedDataParallel`` or
FSDP, or calls ``init_process_group``, distributes by itself: wrapping its
model and splitting its loaders as well would do the work twice. Such a cell
runs in launch mode (:mod:`..strategies.launch`); :func:`choose_mode` says which and why.

What is looked at: the cell's code (names it imports included), the code of
the notebook functions and methods it calls (their own imports included), and
of the functions it imports from modules imported before; nothing is imported
to decide. What this cannot see, :mod:`..rank.mode_guard` refuses as the cell runs.

In a notebook::

    choose_mode(ast.parse("trainer = Trainer(model=model, args=args)"), {"Trainer": transformers.Trainer})
    # ('launch', 'the cell builds a Hugging Face Trainer (transformers.Trainer)')
"""
from __future__ import annotations

import ast
import dis
import sys
import sysconfig
import types
from collections.abc import Iterator

from ...cell.names import attribute_chain, import_bindings
from ...errors import usage_error

__all__ = ["choose_mode", "distributes_itself", "framework_of", "DISTRIBUTING"]

# (package roots, class or function name, what to call it): what distributes by itself. A class
# matches through its bases, so Seq2SeqTrainer and trl's SFTTrainer are Hugging Face Trainers.
DISTRIBUTING = (
    (("transformers", "trl"), "Trainer", "a Hugging Face Trainer"),
    (("accelerate",), "Accelerator", "an accelerate Accelerator"),
    (("lightning", "pytorch_lightning"), "Trainer", "a Lightning Trainer"),
    (("lightning", "lightning_fabric"), "Fabric", "a Lightning Fabric"),
    # builds a Lightning Trainer inside (the Lightning examples' entry point; args=[...] in a notebook)
    (("lightning", "pytorch_lightning"), "LightningCLI", "a Lightning CLI, which builds a Lightning Trainer"),
    (("torch",), "DistributedDataParallel", "its own DistributedDataParallel"),
    (("torch",), "FullyShardedDataParallel", "FSDP"),
    (("torch",), "fully_shard", "FSDP (fully_shard)"),
    (("torch",), "init_process_group", "init_process_group"),
)
# What starts processes of its own: inside a rank it would start them once per rank.
STARTS_PROCESSES = (
    (("torch",), "spawn"), (("torch",), "start_processes"), (("accelerate",), "notebook_launcher"),
    (("accelerate",), "debug_launcher"),
)
# Framework objects that fix the number of processes when made: made in the kernel, they know one.
MADE_FOR_ONE_PROCESS = ("a Hugging Face Trainer", "an accelerate Accelerator", "a Lightning Trainer",
                        "a Lightning Fabric")


def distributes_itself(tree: ast.AST, ns: dict, used: list[str]) -> str | None:
    """Why the cell ``tree`` (reading notebook names ``used``) distributes by itself (``"the cell builds a Hugging
    Face Trainer (transformers.Trainer)"``), or None for a hand-written loop.

    Raises ``UsageError`` for a cell neither mode can run: one that starts processes of its own, or uses a
    framework trainer made in the kernel.
    """
    _refuse_kernel_made(ns, used)
    found = None
    for qualified, obj in _references(tree, ns, used):
        if _matches(qualified, obj, STARTS_PROCESSES):
            # notebook_launcher(fn, args) calls fn(*args); mp.spawn(fn, args) calls fn(rank, *args)
            example = ("training_function(*args)" if qualified.split(".")[-1].endswith("_launcher")
                       else "train(int(os.environ['RANK']), *args)")
            raise usage_error(
                f"the cell calls {qualified}, which starts processes of its own; under %%dataparallel the ranks "
                "exist already and each runs the cell: call the training function directly instead "
                f"(for example {example}), or run the cell without %%dataparallel")
        what = framework_of(qualified, obj)
        if what is not None and found is None:
            found = f"the cell {'calls' if what == 'init_process_group' else 'builds'} {what} ({qualified})"
    return found


def choose_mode(tree: ast.AST, ns: dict, used: list[str], launch: bool = False) -> tuple[str, str]:
    """``("launch" | "ddp", why)`` for the cell: launch mode where ``launch`` (``--launch``) or where it
    :func:`distributes_itself`."""
    found = distributes_itself(tree, ns, used)
    if launch:
        return "launch", "--launch"
    return ("launch", found) if found is not None else ("ddp", "a hand-written loop")


def framework_of(qualified: str, obj=None) -> str | None:
    """What ``obj`` (or, unresolved, the dotted name ``qualified``) is among :data:`DISTRIBUTING`."""
    for roots, name, what in DISTRIBUTING:
        if _matches(qualified, obj, ((roots, name),)):
            return what
    return None


def _matches(qualified: str, obj, table) -> bool:
    if obj is not None:
        candidates = obj.__mro__ if isinstance(obj, type) else (obj,)
        for c in candidates:
            module = getattr(c, "__module__", None) or ""
            if any(module.split(".")[0] in roots and getattr(c, "__name__", None) == name for roots, name in table):
                return True
        return False
    parts = qualified.split(".")
    for roots, name in table:
        if parts[0] in roots and (parts[-1] == name or (name == "Trainer" and parts[-1].endswith("Trainer")
                                                           and parts[0] in ("transformers", "trl"))):
            return True
    return False


def _refuse_kernel_made(ns: dict, used: list[str]) -> None:
    for name in used:
        value = ns.get(name)
        if value is None or isinstance(value, (type, types.ModuleType, types.FunctionType)):
            continue
        what = framework_of(f"{type(value).__module__}.{type(value).__name__}", type(value))
        if what in MADE_FOR_ONE_PROCESS:
            raise usage_error(
                f"{name!r} is {what} made in the kernel, where it counted one process; make it inside the "
                f"%%dataparallel cell, where it sees every rank (its arguments may come from earlier cells)")


def _references(tree: ast.AST, ns: dict, used: list[str]) -> Iterator[tuple[str, object]]:
    """``(dotted name, object or None)`` for what the cell and the notebook functions it uses refer to."""
    imported = _imports(tree)
    seen: set = set()
    for node in ast.walk(tree):
        chain = attribute_chain(node)
        if chain is None:
            continue
        base, attrs = chain[0], chain[1:]
        if base in imported:
            dotted = ".".join([imported[base], *attrs])
            yield dotted, None
            # a module imported before (an earlier cell, or a file of the user's): what it defines
            obj = _already_imported(dotted)
        elif base in ns:
            obj = ns[base]
            for a in attrs:
                obj = getattr(obj, a, None)
                if obj is None:
                    break
            if obj is not None:
                yield ".".join(chain), obj
        else:
            continue
        yield from _function_references(obj, seen)
    for name in used:
        yield from _function_references(ns.get(name), seen)


def _function_references(obj, seen: set) -> Iterator[tuple[str, object]]:
    """What a function or bound method (``experiment.run``) refers to; nothing for other objects."""
    fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
    if isinstance(fn, types.FunctionType) and _is_users_code(fn.__code__):
        yield from _code_references(fn.__code__, fn.__globals__, seen)


def _is_users_code(code: types.CodeType) -> bool:
    """Code of the notebook or of the user's own files: not of an installed package or the standard
    library (a library's functions are matched by name, never read)."""
    filename = code.co_filename
    return not (any(part in filename for part in ("site-packages", "dist-packages"))
                or filename.startswith(_STANDARD_LIBRARY))


_STANDARD_LIBRARY = sysconfig.get_paths()["stdlib"]


def _already_imported(dotted: str):
    """The object a dotted name names, if its module is imported already (nothing is imported here)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            continue
        obj: object = module
        for a in parts[i:]:
            obj = getattr(obj, a, None)
            if obj is None:
                return None
        return obj
    return None


def _code_references(code: types.CodeType, globals_: dict, seen: set | None = None) -> Iterator[tuple[str, object]]:
    """What a notebook function's code refers to: its globals, attribute chains from the modules among
    them (``torch.distributed.init_process_group``), and what the notebook functions it calls refer to."""
    seen = set() if seen is None else seen
    if id(code) in seen:
        return
    seen.add(id(code))
    instructions = list(dis.get_instructions(code))
    names = set(code.co_names)   # the globals it reads and the attributes it reads, alike
    # imports inside the function (``from accelerate import Accelerator`` in ``def train():``)
    for module in {i.argval for i in instructions if i.opname == "IMPORT_NAME"}:
        yield module, None
        for name in names:
            yield f"{module}.{name}", None
    # Only names read as globals are the notebook's: ``model.train()`` is no call of a notebook ``train``.
    for name in {i.argval for i in instructions if i.opname in _GLOBAL_LOADS}:
        value = globals_.get(name)
        if isinstance(value, types.ModuleType):
            yield from _module_attributes(name, value, names, depth=3)
        elif isinstance(value, types.FunctionType):
            yield name, value
            yield from _code_references(value.__code__, value.__globals__, seen)
        elif value is not None:
            yield name, value
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_references(const, globals_, seen)


_GLOBAL_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS")


def _module_attributes(dotted: str, module: types.ModuleType, names: set, depth: int) -> Iterator[tuple[str, object]]:
    for attr in names:
        sub = getattr(module, attr, None)
        if sub is None:
            continue
        if isinstance(sub, types.ModuleType):
            if depth > 1:
                yield from _module_attributes(f"{dotted}.{attr}", sub, names, depth - 1)
        else:
            yield f"{dotted}.{attr}", sub


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name, for the cell's own (absolute) imports."""
    return {local: dotted for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for local, dotted in import_bindings(node) if not dotted.startswith(".")}
