"""``%gpuinfo``: every device, with the facts people look up, and a device picker."""
from __future__ import annotations

from html import escape

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import display, session
from .args import parse

__all__ = ["InfoMagics", "render_report", "shown_device"]

# (label, key, formatter) rows of the table; devices are its columns.
_B = display.fmt_bytes
UTILISATION = "utilisation (time busy)"
ROWS = [
    ("name", "name", str),
    ("uuid", "uuid", str),
    ("pci bus id", "pci_bus_id", str),
    ("compute capability", "compute_capability", str),
    ("multiprocessors", "multiprocessors", str),
    ("memory total", "memory_total", _B),
    ("memory used", "memory_used", _B),
    ("memory free", "memory_free", _B),
    ("torch allocated", "torch_allocated", _B),
    ("torch reserved", "torch_reserved", _B),
    ("torch peak", "torch_peak", _B),
    ("kernel resident", "process_rss", _B),
    # One row for one meaning, the share of recent time the device was busy: for a GPU,
    # time a kernel ran (NVML); for the CPU, all cores' busy time (psutil). Each device
    # has one of the two keys, so they share the row instead of making two "utilisation" rows.
    (UTILISATION, "utilization", lambda v: f"{v:.0f} %"),
    ("memory utilisation (time busy)", "utilization_memory", lambda v: f"{v} %"),
    ("cores (logical/physical)", "cores_logical", None),
    ("temperature", "temperature_c", lambda v: f"{v} C"),
    ("power", "power_w", lambda v: f"{v:.0f} W"),
    ("power limit", "power_limit_w", lambda v: f"{v:.0f} W"),
    ("SM clock", "clock_sm_mhz", lambda v: f"{v} MHz"),
    ("SM clock max", "clock_sm_max_mhz", lambda v: f"{v} MHz"),
    ("memory clock", "clock_mem_mhz", lambda v: f"{v} MHz"),
    ("memory clock max", "clock_mem_max_mhz", lambda v: f"{v} MHz"),
    ("PCIe", "pcie_generation", None),
    ("NVLink peers", "nvlink_peers", None),
    ("MIG", "mig", lambda v: "yes" if v else "no"),
]
GPU_ONLY = {"uuid", "pci_bus_id", "compute_capability", "multiprocessors", "utilization_memory",
            "temperature_c", "power_w", "power_limit_w", "clock_sm_mhz", "clock_sm_max_mhz",
            "clock_mem_mhz", "clock_mem_max_mhz", "pcie_generation", "nvlink_peers", "mig"}


def _cell(device: dict, key: str, formatter) -> str | None:
    """One table cell; ``None`` when the row does not apply to this kind of device."""
    is_gpu = device["device"].startswith("cuda:")
    if key in GPU_ONLY and not is_gpu:
        return None
    if key == "cores_logical":
        return f"{device['cores_logical']}/{device['cores_physical']}" if "cores_logical" in device else None
    if key == "pcie_generation":
        gen, width = device.get("pcie_generation"), device.get("pcie_width")
        return f"gen {gen} x{width}" if gen is not None else display.NA
    if key == "nvlink_peers":
        peers = device.get("nvlink_peers")
        if not peers:
            return display.NA if peers is None else "none"
        return ", ".join(f"{peer} ({links} links)" for peer, links in peers.items())
    if key == "utilization":
        key = "utilization_gpu" if is_gpu else "utilization_cpu"
    if key not in device:
        return None
    value = device[key]
    if value is None:
        return display.NA
    return formatter(value)


def render_report(report: dict) -> display.Rendered:
    """The report as a table whose columns are devices (text and HTML)."""
    devs = report["devices"]
    header = ["", *[d["device"] for d in devs]]
    rows = []
    for label, key, formatter in ROWS:
        cells = [_cell(d, key, formatter) for d in devs]
        if all(c is None for c in cells):
            continue
        rows.append([label, *[c if c is not None else "" for c in cells]])
    system = report["system"]
    footer = (f"driver {system.get('driver_version') or display.NA}, "
              f"CUDA (driver) {system.get('cuda_driver_version') or display.NA}, "
              f"torch {system['torch_version']} (CUDA {system.get('torch_cuda_version') or 'none'}), "
              f"CUDA initialised in this kernel: {'yes' if system['cuda_initialized'] else 'no'}")
    attr_rows = _attribute_rows(devs)
    # No device to show (a GPU named while the driver does not answer): the footer and the notes alone.
    text = (display.text_table(rows, header) + "\n" if devs else "") + footer
    html = (display.html_table(rows, header) if devs else "") + f"<p>{escape(footer)}</p>"
    if attr_rows:
        gpu_header = ["CUDA attribute", *[d["device"] for d in devs if "attributes" in d]]
        text += "\n\n" + display.text_table(attr_rows, gpu_header)
        html += display.html_table(attr_rows, gpu_header)
    for note in report["notes"]:
        text += f"\nnote: {note}"
        html += f"<p><i>note: {escape(note)}</i></p>"  # notes quote the environment and NVML's errors
    return display.Rendered(text, html)


def _attribute_rows(devs: list[dict]) -> list[list[str]]:
    with_attrs = [d for d in devs if "attributes" in d]
    if not with_attrs:
        return []
    names = sorted({k for d in with_attrs for k in d["attributes"]})
    return [[n, *[str(d["attributes"].get(n, display.NA)) for d in with_attrs]] for n in names]


def shown_device(spec, gpus=None, hung: str | None = None) -> str:
    """``spec`` as a canonical device name; errors name every device ``%gpuinfo`` can show.

    That is every device a cell can run on, plus GPUs that a CPU-only torch
    cannot use: they exist, so their facts are shown. ``gpus``: the visible GPUs
    (read now where not given). Where the driver did not answer (``hung``), a GPU
    cannot be checked: ``cuda:N`` is kept as given, and the report shows no column
    for it, only the note.
    """
    from ..devices import available_devices, parse_device, visible_gpus
    from ..devices.discovery import torch_cpu_only, unchecked_gpu
    from ..errors import UsageError, usage_error
    gpus = visible_gpus() if gpus is None else gpus
    gpu = unchecked_gpu(spec) if hung is not None else None
    if gpu is not None:
        return gpu
    try:
        return parse_device(spec, gpus)
    except UsageError as exc:
        if not gpus or not torch_cpu_only():
            raise
        choices = available_devices(gpus)
        choices[1:1] = [g.device for g in gpus]
        raise usage_error(str(exc).split("; valid choices")[0], choices) from None


@magics_class
class InfoMagics(Magics):

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell, **kwargs)
        # Made when the extension loads: the CPU's busy share in the first %gpuinfo covers the time
        # since then (see devices/facts.py), instead of a window of no time that reads 0 %.
        from ..devices.facts import prime_cpu_utilisation
        prime_cpu_utilisation()

    @magic_arguments()
    @argument("device", nargs="?", default=None,
              help="show one device: cpu, cuda (or gpu), cuda:N, N, mps, meta (default: all)")
    @argument("--all", action="store_true", dest="all_attributes",
              help="add every CUDA attribute through pycuda (asked in a short-lived subprocess)")
    @argument("--json", action="store_true", help="return the facts as a plain dict instead of showing them")
    @line_magic
    def gpuinfo(self, line=""):
        """Show every device: name, memory, compute capability, utilisation, topology, driver.

        Queries go through NVML and never initialise CUDA in the kernel. In a
        notebook a device picker follows the table: the device picked is where
        later gpumagic cells run (``gpumagic.current_device()``). NVML is read in
        a thread waited for at most a few seconds: a wedged driver leaves the CPU
        and a note saying so, not a hung notebook.

        Examples
        --------
        ::

            %gpuinfo
            %gpuinfo cuda:1 --all
            facts = %gpuinfo --json
        """
        from ..devices.facts import device_report, read_nvml

        args = parse(self.gpuinfo, line)
        reading = read_nvml()   # every NVML figure, bounded; nothing below asks NVML again
        device = shown_device(args.device, reading.gpus, reading.hung) if args.device is not None else None
        report = device_report(device, with_pycuda=args.all_attributes, reading=reading)
        if args.json:
            return report
        rendered = render_report(report)
        if display.widgets_supported(self.shell):
            from IPython.display import display as show

            from ..widgets.picker import DevicePicker, close_all_pickers
            session.register_closer("pickers", close_all_pickers)
            show(rendered)
            listed = device_report(reading=reading)["devices"] if device else report["devices"]
            show(DevicePicker(listed, gpus=reading.gpus).widget)
        else:
            # No picker here: say where cells run and how to change it.
            print(rendered.text)
            from ..devices import available_devices
            print(f"gpumagic cells run on {report['system']['current_device']}; "
                  f"gpumagic.set_current_device(DEVICE) changes it ({', '.join(available_devices(reading.gpus))}).")
