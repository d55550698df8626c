"""Which names a cell reads and binds, and which notebook functions it reaches.

Plain functions over a cell's AST (and, for :func:`used_names`, the
notebook's namespace); no IPython, no torch.

In a notebook::

    tree = ast.parse(cell)
    used_names(tree, get_ipython().user_ns)   # ['model', 'loader', 'train', 'loss_fn', ...]
"""
from __future__ import annotations

import ast
import dis
import functools
import re
import types

__all__ = ["names_read", "names_assigned", "names_deleted", "attributes_assigned", "import_bindings", "free_reads",
           "used_names", "loop_targets", "names_tree", "notebook_names", "attribute_chain", "calls_assigned",
           "items_assigned", "notebook_object_attributes", "held_slots"]

# IPython's own history names (_, __, _i3, _oh, In, Out...): never the user's values.
_HISTORY = re.compile(r"^(_+|_i+|_i?\d+|_(dh|oh|ih)|In|Out)$")
_SHELL = frozenset({"get_ipython", "exit", "quit"})


def names_read(tree: ast.AST) -> list[str]:
    """Names the cell reads, in order of first use (``model`` in ``model(x)``...)."""
    seen: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            seen.setdefault(node.id, None)
    return list(seen)


def import_bindings(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """``(local name, dotted name it binds)`` for each name an import statement binds
    (``import a.b`` binds ``a``; ``from m import x as y`` binds ``y`` to ``m.x``; ``*`` is left out)."""
    if isinstance(node, ast.Import):
        return [(a.asname, a.name) if a.asname else (a.name.split(".")[0], a.name.split(".")[0]) for a in node.names]
    module = "." * node.level + (node.module or "")
    return [(a.asname or a.name, f"{module}.{a.name}") for a in node.names if a.name != "*"]


def names_assigned(tree: ast.AST) -> list[str]:
    """Names the cell binds in the notebook's scope (``loss = ...``, ``for epoch in ...``, ``import math``,
    ``def train``), in the order they appear; not the names of nested scopes (a lambda's or a
    comprehension's)."""
    seen: dict[str, None] = {}
    for node in _top_scope(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            seen.setdefault(node.name, None)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for local, _ in import_bindings(node):
                seen.setdefault(local, None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            seen.setdefault(node.id, None)
    for name in _globals_bound_in_functions(tree):
        seen.setdefault(name, None)
    return list(seen)


def _globals_bound_in_functions(tree: ast.AST) -> list[str]:
    """Names a function defined in the cell declares ``global`` and binds (``def main(): global ran;
    ran = ...``): calling it binds them in the notebook's scope, as the cell's own statements do."""
    found: dict[str, None] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = list(_top_scope(fn))
        declared = {name for node in body if isinstance(node, ast.Global) for name in node.names}
        if not declared:
            continue
        for node in body:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound = [node.id]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = [node.name]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound = [local for local, _ in import_bindings(node)]
            else:
                continue
            for name in bound:
                if name in declared:
                    found.setdefault(name, None)
    return list(found)


def names_deleted(tree: ast.AST) -> list[str]:
    """Names a ``del`` in the notebook's scope unbinds (``del tmp``)."""
    return list(dict.fromkeys(node.id for node in _top_scope(tree)
                              if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del)))


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
           ast.DictComp, ast.GeneratorExp)


def _top_scope(tree: ast.AST):
    """The cell's nodes in the notebook's own scope, in source order: a nested scope (function, class,
    lambda, comprehension) is yielded itself, but not what it holds (a decorator, default or base
    class is read where the scope is made, yet binds nothing there but a walrus, left out)."""
    stack = list(reversed(getattr(tree, "body", [])))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def used_names(tree: ast.AST, namespace: dict, depth: int = 3) -> list[str]:
    """Notebook names the cell reads (see :func:`free_reads`), plus the globals of the
    notebook functions it calls (``train(...)``), transitively."""
    found: dict[str, None] = dict.fromkeys(free_reads(tree))
    frontier = list(found)
    seen_code: set = set()
    named: dict[int, str] | None = None
    for _ in range(depth):
        nxt = []
        for name in frontier:
            for code in _code_objects(namespace.get(name), namespace):
                if id(code) in seen_code:
                    continue
                seen_code.add(id(code))
                for g in _global_names(code):
                    if g not in found and g in namespace:
                        found[g] = None
                        nxt.append(g)
            held = _held_attributes(namespace.get(name), namespace)
            if held:
                # A notebook object holding other notebook objects (a trainer class's self.model,
                # self.opt): the cell reaches them through it, as through a name.
                if named is None:
                    named = {id(v): k for k, v in namespace.items() if not k.startswith("_")}
                for value in held:
                    g = named.get(id(value))
                    if g is not None and g not in found:
                        found[g] = None
                        nxt.append(g)
        frontier = nxt
    return list(found)


def _is_notebook_instance(value, namespace) -> bool:
    cls = type(value)
    return cls.__module__ == namespace.get("__name__", "__main__") and not isinstance(value, type) \
        and not isinstance(value, types.FunctionType)


def notebook_object_attributes(value, namespace) -> dict | None:
    """The own ``__dict__`` of an instance of a notebook class, not of a torch module (whose parts are
    its own); None for anything else. Read from the dict, never through ``getattr``: a class's
    ``__getattr__`` may raise anything for a missing name (an attribute dict raises KeyError)."""
    if not _is_notebook_instance(value, namespace):
        return None
    attrs = getattr(value, "__dict__", None)
    return attrs if isinstance(attrs, dict) and "_parameters" not in attrs else None


HELD_DEPTH = 3          # how far down a notebook object's attributes, dicts and lists are followed
HELD_ITEMS = 1000       # a dict or list longer than this holds data, not the objects a trainer uses


def held_slots(value, namespace, depth: int = HELD_DEPTH):
    """``(container, key, held)`` for each object an instance of a notebook class holds: its attributes
    (the container its ``__dict__``), and, ``depth`` levels down, the attributes of the notebook objects
    and the items of the dicts and lists it holds there (``self.parts.model``, ``self.nets["g"]``,
    ``self.models[0]``): where a trainer object keeps the models it trains. Each container once."""
    attrs = notebook_object_attributes(value, namespace)
    if attrs is None:
        return
    seen = {id(attrs)}
    todo = [(attrs, 1)]
    while todo:
        container, level = todo.pop()
        for key, held in list(container.items() if isinstance(container, dict) else enumerate(container)):
            yield container, key, held
            if level >= depth:
                continue
            inner = notebook_object_attributes(held, namespace)
            if inner is None and type(held) in (dict, list) and len(held) <= HELD_ITEMS:
                inner = held
            if inner is not None and id(inner) not in seen:
                seen.add(id(inner))
                todo.append((inner, level + 1))


def _held_attributes(value, namespace) -> list:
    """What an instance of a notebook class holds (see :func:`held_slots`), less plain numbers and strings
    (which the notebook's own numbers may be, by identity)."""
    return [held for _, _, held in held_slots(value, namespace)
            if not isinstance(held, (int, float, complex, str, bytes, type(None)))]


def _code_objects(value, namespace):
    """Code of notebook functions (and of methods of notebook classes) that ``value`` is."""
    if _is_notebook_instance(value, namespace) and "_parameters" not in getattr(value, "__dict__", {}):
        # ``runner.step(x)``: its class's methods read the notebook's globals. (Not a torch module's:
        # what its forward reads, a frozen encoder, is its own business, not a model the cell trains.)
        value = type(value)
    if isinstance(value, type) and getattr(value, "__module__", None) == namespace.get("__name__", "__main__"):
        for attr in vars(value).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, property):
                for accessor in (attr.fget, attr.fset, attr.fdel):
                    yield from _function_code(accessor, namespace)
            elif isinstance(attr, functools.cached_property):
                yield from _function_code(attr.func, namespace)
            else:
                yield from _function_code(attr, namespace)
    else:
        yield from _function_code(value, namespace)


def _function_code(value, namespace):
    """Code of ``value`` and of what it wraps, where notebook functions: under a decorator's wrapper
    (@torch.compile, @torch.no_grad(), a notebook decorator) the function is its ``__wrapped__`` or a
    function its closure holds. Each function once: a ``__wrapped__`` may lead back."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        fn = todo.pop()
        if not isinstance(fn, types.FunctionType) or id(fn) in seen:
            continue
        seen.add(id(fn))
        if fn.__globals__ is namespace:
            yield fn.__code__
        todo.append(vars(fn).get("__wrapped__"))
        for cell in fn.__closure__ or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:   # a cell not yet filled
                pass


# Instructions that name a global; co_names also holds attribute names (opt.step), which made a notebook
# value called ``step`` (step = torch.compile(train_step)) count as read by every function calling opt.step().
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS", "STORE_GLOBAL", "STORE_NAME",
                         "DELETE_GLOBAL", "DELETE_NAME"})


def _global_names(code):
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_OPS:
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def free_reads(tree: ast.AST) -> list[str]:
    """Names the cell may read before binding them itself: the notebook values it needs.

    ``it = iter(loader)`` or ``x, y = batch`` inside the loop bind before they
    read, so the notebook's old ``it``, ``x``, ``y`` are not shipped (an old
    iterator would not even pickle; old batches would cost memory and time).
    Bindings inside ``if``/``for``/``while``/``try`` count only inside them,
    since they may not run; functions and lambdas count all their reads.
    """
    reads: dict[str, None] = {}
    _block(getattr(tree, "body", []), set(), reads)
    return list(reads)


def _expr_reads(node, bound: set, reads: dict, local: frozenset = frozenset()) -> None:
    if node is None:
        return
    if isinstance(node, ast.Name):
        if isinstance(node.ctx, ast.Load) and node.id not in bound and node.id not in local:
            reads.setdefault(node.id, None)
        return
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = local | targets
        for g in node.generators:
            _expr_reads(g.iter, bound, reads, inner)
            for cond in g.ifs:
                _expr_reads(cond, bound, reads, inner)
        for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
            _expr_reads(part, bound, reads, inner)
        return
    if isinstance(node, ast.Lambda):
        args = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            _expr_reads(d, bound, reads, local)
        _expr_reads(node.body, bound, reads, local | args)
        return
    for child in ast.iter_child_nodes(node):
        _expr_reads(child, bound, reads, local)


def _store_names(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _block(stmts, bound: set, reads: dict) -> None:
    """Walk statements in execution order; ``bound`` grows with what is surely bound."""
    for st in stmts:
        _STATEMENTS.get(type(st).__name__, _expr_reads)(st, bound, reads)


def _assign(st, bound: set, reads: dict) -> None:
    _expr_reads(st.value, bound, reads)
    for t in st.targets:
        _expr_reads(t, bound, reads)          # subscripts/attributes read their base
        bound |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}


def _ann_assign(st, bound: set, reads: dict) -> None:
    _expr_reads(st.value, bound, reads)
    if st.value is not None and isinstance(st.target, ast.Name):
        bound.add(st.target.id)
    elif not isinstance(st.target, ast.Name):
        _expr_reads(st.target, bound, reads)


def _aug_assign(st, bound: set, reads: dict) -> None:
    _expr_reads(st.value, bound, reads)
    if not isinstance(st.target, ast.Name):
        _expr_reads(st.target, bound, reads)
    elif st.target.id not in bound:
        reads.setdefault(st.target.id, None)


def _loop(st, bound: set, reads: dict) -> None:
    """``for`` and ``while``: the body may run any number of times, the else-part once or not."""
    if isinstance(st, ast.While):
        _expr_reads(st.test, bound, reads)
        _block(st.body, set(bound), reads)
    else:
        _expr_reads(st.iter, bound, reads)
        _block(st.body, bound | _store_names(st.target), reads)
    _block(st.orelse, set(bound), reads)


def _if(st, bound: set, reads: dict) -> None:
    _expr_reads(st.test, bound, reads)
    _block(st.body, set(bound), reads)
    _block(st.orelse, set(bound), reads)


def _with(st, bound: set, reads: dict) -> None:
    for item in st.items:
        _expr_reads(item.context_expr, bound, reads)
        if item.optional_vars is not None:
            bound |= _store_names(item.optional_vars)
    _block(st.body, bound, reads)               # a with-body always starts


def _try(st, bound: set, reads: dict) -> None:
    _block(st.body, set(bound), reads)
    for h in st.handlers:
        _expr_reads(h.type, bound, reads)
        _block(h.body, bound | ({h.name} if h.name else set()), reads)
    _block(st.orelse, set(bound), reads)
    _block(st.finalbody, set(bound), reads)


def _import(st, bound: set, reads: dict) -> None:
    bound.update(local for local, _ in import_bindings(st))


def _definition(st, bound: set, reads: dict) -> None:
    """Reads inside may happen at any later call: count them all (minus the function's own names)."""
    own = {a.arg for a in ast.walk(st) if isinstance(a, ast.arg)} | _store_names(st)
    for node in ast.walk(st):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                and node.id not in bound and node.id not in own:
            reads.setdefault(node.id, None)
    bound.add(st.name)


def _delete(st, bound: set, reads: dict) -> None:
    for t in st.targets:
        _expr_reads(t, bound, reads)            # ``del d[k]`` reads d
        for n in ast.walk(t):                   # ``del tmp`` needs the notebook's tmp
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Del) and n.id not in bound:
                reads.setdefault(n.id, None)


def _match(st, bound: set, reads: dict) -> None:
    _expr_reads(st.subject, bound, reads)
    for case in st.cases:
        for node in ast.walk(case):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
                reads.setdefault(node.id, None)


def _declaration(st, bound: set, reads: dict) -> None:
    """``global`` and ``nonlocal`` read nothing."""


# Statement kinds by class name (``TryStar`` and ``Match`` exist only on newer Pythons); any other
# statement (an expression, a return, an assert) reads what its expressions read.
_STATEMENTS = {
    "Assign": _assign, "AnnAssign": _ann_assign, "AugAssign": _aug_assign,
    "For": _loop, "AsyncFor": _loop, "While": _loop, "If": _if, "With": _with, "AsyncWith": _with,
    "Try": _try, "TryStar": _try, "Import": _import, "ImportFrom": _import,
    "FunctionDef": _definition, "AsyncFunctionDef": _definition, "ClassDef": _definition,
    "Delete": _delete, "Global": _declaration, "Nonlocal": _declaration, "Match": _match,
}


def attributes_assigned(tree: ast.AST) -> dict[str, list[str]]:
    """``{path: [attribute, ...]}`` for what the cell sets or deletes on an object it reaches from a name,
    anywhere in the cell: ``args.epochs = 1`` and ``state.count += 1`` give ``{"args": ["epochs"], "state":
    ["count"]}``; ``cfg.optim.lr = 0.1`` gives ``{"cfg.optim": ["lr"]}``, and ``del cfg.name``
    ``{"cfg": ["name"]}``."""
    found: dict[str, dict[str, None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            chain = attribute_chain(node.value)
            if chain is not None:
                found.setdefault(".".join(chain), {})[node.attr] = None
    return {path: list(attrs) for path, attrs in found.items()}


def items_assigned(tree: ast.AST) -> dict[str, list[str]]:
    """``{name: [target, ...]}`` for what the cell sets or deletes through an item of an object it reaches
    from a name: ``held["n"] = 2``, ``cfgs[0].lr = 0.5`` and ``del cache[k]`` give ``{"held": ['held['n']'],
    "cfgs": ["cfgs[0].lr"], "cache": ["cache[k]"]}``."""
    found: dict[str, dict[str, None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            base, through_item = node.value, isinstance(node, ast.Subscript)
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                through_item = through_item or isinstance(base, ast.Subscript)
                base = base.value
            if through_item and isinstance(base, ast.Name):
                found.setdefault(base.id, {})[ast.unparse(node)] = None
    return {name: list(targets) for name, targets in found.items()}


def attribute_chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` (read) as ``["a", "b", "c"]``; None for anything but a name or an attribute chain on one."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        return [node.id, *reversed(attrs)]
    return None


def calls_assigned(tree: ast.AST):
    """``(names, chain)`` for each ``name = a.b.C(...)`` in the cell: the names bound, and the called
    :func:`attribute_chain` (None where the callee is not one)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            yield [t.id for t in node.targets if isinstance(t, ast.Name)], attribute_chain(node.value.func)


def loop_targets(tree: ast.AST) -> list[str]:
    """Names bound by ``for`` and ``with ... as`` (batches, files): not worth a note when left behind."""
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list = []
        if isinstance(node, (ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
        for target in targets:
            found.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return sorted(found)


def names_tree(names: list[str]) -> ast.Module:
    """A tree that reads exactly ``names`` (to ask the namespace helpers about them)."""
    return ast.Module([ast.Expr(ast.Name(id=n, ctx=ast.Load())) for n in names], type_ignores=[])


def notebook_names(names: list[str], ns: dict, hidden: dict | None = None) -> list[str]:
    """``names`` that are the user's values in ``ns``: not IPython's history, not hidden by the shell."""
    hidden = hidden or {}
    out = []
    for n in names:
        if n not in ns:
            continue
        if n in hidden:   # the shell's own (``Out``), unless the user bound the name anew (``Out = namedtuple(...)``)
            if hidden[n] is ns[n]:
                continue
        elif n in _SHELL or _HISTORY.match(n):
            continue
        out.append(n)
    return out
