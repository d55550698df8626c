"""Notebook widgets: the device picker, memory gauges and the monitor thread feeding them.

Each module imports ipywidgets itself, so ``import gpumagic`` never does;
callers check :func:`gpumagic.display.widgets_supported` first and fall back
to text in terminal IPython.
"""

__all__: list[str] = []
