"""A cell's code: compiled as IPython compiles it, rewritten, and read for the names it uses.

* :mod:`.compile` - compile a magic's cell body keeping the user's line numbers;
* :mod:`.names` - which notebook names, modules, optimizers and loaders a cell uses;
* :mod:`.placement` - the AST rewrite that makes ``.cuda()`` code follow a chosen device.

Nothing here imports IPython's shell: the shell is passed in where needed.
"""
__all__: list[str] = []
