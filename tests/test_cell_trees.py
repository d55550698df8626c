"""gpumagic.cell.trees: syntax trees copied and measured without recursion."""
from __future__ import annotations

import ast
import copy
import sys

import pytest

from gpumagic.cell.trees import Flat, copy_tree, depth, room_for, shipped
from tests.deep_cells import elif_chain, nested_abs


def test_a_copy_is_equal_and_shares_no_node_or_list():
    tree = ast.parse("def f(a, *, b=2):\n    return [a + i for i in range(b)]\nx = f(1)  # two\n",
                     type_comments=True)
    copied = copy_tree(tree)
    assert ast.dump(copied, include_attributes=True) == ast.dump(tree, include_attributes=True)
    old_ids = {id(n) for n in ast.walk(tree)} | {id(v) for n in ast.walk(tree) for _, v in ast.iter_fields(n)
                                                 if isinstance(v, list)}
    assert not any(id(n) in old_ids for n in ast.walk(copied))
    copied.body[0].name = "g"
    copied.body[1].value.args.append(ast.Constant(3))
    assert tree.body[0].name == "f" and len(tree.body[1].value.args) == 1
    ns: dict = {}
    exec(compile(copy_tree(tree), "<cell>", "exec"), ns)
    assert ns["x"] == [1, 2]


@pytest.mark.parametrize("source, deep, name, value", [(elif_chain(250, 137), 250, "r", 137),
                                                       (nested_abs(190), 190, "v", 1)])
def test_trees_deeper_than_deepcopy_goes_copy_and_run(source, deep, name, value):
    tree = ast.parse(source)
    with pytest.raises(RecursionError):   # what the magics did before
        copy.deepcopy(tree)
    assert depth(tree) > deep
    ns: dict = {}
    exec(compile(copy_tree(tree), "<cell>", "exec"), ns)
    assert ns[name] == value


def test_a_flat_tree_pickles_without_recursion_and_unpickles_as_the_tree():
    import pickle
    tree = ast.parse(elif_chain(900, 4))
    with pytest.raises(RecursionError):   # pickle recurses once per level, too
        pickle.dumps(tree)
    back = pickle.loads(pickle.dumps(Flat(tree)))
    assert isinstance(back, ast.Module) and depth(back) == depth(tree)
    assert [(type(n).__name__, getattr(n, "lineno", None)) for n in ast.walk(back)] == \
        [(type(n).__name__, getattr(n, "lineno", None)) for n in ast.walk(tree)]
    assert shipped(Flat(tree)) is tree and shipped(back) is back   # (a forked worker gets the Flat itself)


def test_room_for_a_deep_tree_is_made_for_the_block_only():
    tree = ast.parse(elif_chain(900, 4))
    limit = sys.getrecursionlimit()
    with room_for(tree):
        inside = sys.getrecursionlimit()
        fixed = ast.fix_missing_locations(copy_tree(tree))   # (recursive: one frame per level)
    assert inside >= 4 * 900 and sys.getrecursionlimit() == limit
    assert depth(fixed) == depth(tree)
    with room_for(ast.parse("x = 1")):
        assert sys.getrecursionlimit() == limit   # a shallow tree needs nothing raised
