# Makes pytest import examples/conftest.py as ``examples.conftest``, so that it
# never stands in for tests/conftest.py when a test does ``from conftest import``.
