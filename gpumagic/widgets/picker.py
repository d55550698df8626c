"""The device picker: a dropdown whose choice becomes the session's device.

In a notebook::

    %gpuinfo                     # shows the picker under the table
    picker = gpumagic.widgets.picker.DevicePicker()
    picker.value = "cpu"         # what choosing in the dropdown does
    gpumagic.current_device()
    device(type='cpu')
"""
from __future__ import annotations

import functools
import logging
import weakref

from .. import devices, session
from ..display import fmt_bytes
from ..errors import UsageError
from .closing import close_tree

logger = logging.getLogger(__name__)

__all__ = ["DevicePicker", "device_options", "close_all_pickers"]

_open: weakref.WeakSet[DevicePicker] = weakref.WeakSet()


def device_options(report_devices: list[dict]) -> list[tuple[str, str]]:
    """Dropdown entries ``(label, value)``: ``cpu`` and each ``cuda:N`` with name and free memory."""
    options = []
    for d in report_devices:
        name = d.get("name") or d["device"]
        if d["device"] == "meta":
            name = "shapes only, no memory (dry runs)"
        if d["device"].startswith("cuda:"):
            label = f"{d['device']}: {name}, {fmt_bytes(d.get('memory_free'))} free"
        else:
            label = f"{d['device']}: {name}"
        options.append((label, d["device"]))
    return options


@functools.cache
def _dropdown_class():
    """A Dropdown whose text form says the device: what a frontend without widgets shows
    (jupyter console, a notebook exported or rendered without its widget state)."""
    import ipywidgets as w

    class PickerDropdown(w.Dropdown):
        def __repr__(self):
            # ipywidgets cuts text/plain past 110 characters: the choices only where they fit whole.
            head = f"device: {self.value} (later gpumagic cells run there"
            full = f"{head}; choices: {', '.join(str(v) for _, v in self.options)})"
            return full if len(full) <= 110 else f"{head}; {len(self.options)} to choose from)"

    return PickerDropdown


class DevicePicker:
    """A dropdown of devices; picking one calls :func:`gpumagic.set_current_device`.

    The dropdown also follows the session: if the device is set from code, every
    open picker shows it. ``gpus``: the visible GPUs, as ``%gpuinfo`` read them
    (read now where not given).
    """

    def __init__(self, report_devices: list[dict] | None = None, gpus: list | None = None):
        import ipywidgets as w
        if report_devices is None:
            from ..devices.facts import device_report
            report_devices = device_report()["devices"]
        # Only what a cell can run on: GPUs a CPU-only torch cannot use are shown by %gpuinfo, not offered.
        gpus = devices.visible_gpus() if gpus is None else gpus
        usable = devices.available_devices(gpus)
        listed = [d for d in report_devices if d["device"] in usable and d["device"] != "meta"]
        if "mps" in usable and all(d["device"] != "mps" for d in listed):  # %gpuinfo's table has no mps column
            listed.append({"device": "mps", "name": "Apple Metal"})
        listed.append({"device": "meta"})
        options = device_options(listed)
        current = devices.default_device(gpus)
        if current not in [v for _, v in options]:
            # The picked device is gone (CUDA_VISIBLE_DEVICES changed): show it as cells still
            # see it, not some other device that cells would not run on.
            options.append((f"{current}: not visible now", current))
        self.widget = _dropdown_class()(
            options=options,
            value=current,
            description="Device:",
            style={"description_width": "initial"},
            layout=w.Layout(width="max-content"),
        )
        self.widget.add_class("gpumagic-device-picker")
        self._reverting = False
        self.widget.observe(self._on_pick, names="value")
        self._unlisten = session.on_device_change(self._on_session_change)
        _open.add(self)

    @property
    def value(self) -> str:
        return self.widget.value

    @value.setter
    def value(self, device: str) -> None:
        self.widget.value = device

    def _on_pick(self, change) -> None:
        if self._reverting or change["new"] == session.picked_device():
            return
        try:
            devices.set_current_device(change["new"])
        except UsageError as exc:
            # A device that is gone (the "not visible now" entry): cells stay on the session's
            # device, so the dropdown goes back to showing it instead of a device no cell uses,
            # without that showing counting as a pick (the session keeps following the default).
            logger.warning("the device picker could not pick %s: %s", change["new"], exc)
            self._reverting = True
            try:
                self.widget.value = devices.default_device()
            finally:
                self._reverting = False

    def _on_session_change(self, device) -> None:
        target = device or devices.default_device()
        if self.widget.value != target and target in [v for _, v in self.widget.options]:
            self.widget.value = target

    def close(self) -> None:
        self._unlisten()
        close_tree(self.widget)  # its layout and style have comms of their own
        _open.discard(self)

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)


def close_all_pickers() -> None:
    for picker in list(_open):
        picker.close()
