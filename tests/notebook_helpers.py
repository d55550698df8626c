"""Running cells as a notebook does: a real Jupyter kernel (ipykernel through nbclient), started in the
project root so that the kernel imports this checkout's ``gpumagic`` and ``tests``."""
from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordingClient(NotebookClient):
    """Keeps every output message of each cell, as the frontend receives them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages: dict[int, list] = {}

    def process_message(self, msg, cell, cell_index):
        self.messages.setdefault(cell_index, []).append((msg["msg_type"], msg["content"]))
        return super().process_message(msg, cell, cell_index)


def run_notebook(cells, *, timeout: int = 300, allow_errors: bool = False, record: bool = False):
    """The notebook of ``cells`` (sources), executed with ``timeout`` seconds a cell; with ``record``,
    ``(notebook, messages)``: every output message by cell index, updates included, which outputs drop."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    client = (RecordingClient if record else NotebookClient)(
        nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
        resources={"metadata": {"path": ROOT}})
    client.execute()
    return (nb, client.messages) if record else nb


def stream_text(cell, name: str | None = None) -> str:
    """The text a cell wrote to its streams, joined; only ``name``'s ("stdout" or "stderr") when given."""
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and (name is None or o.name == name))
