"""``%%ondevice``: run a cell on a chosen device (thin: parse, run, display)."""
from __future__ import annotations

import argparse
import tokenize

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..display import note
from .args import parse

__all__ = ["OnDeviceMagics"]


def _names(values) -> tuple[str, ...]:
    """``['a,b', 'c']`` (repeated ``--move``) -> ``('a', 'b', 'c')``."""
    out: list[str] = []
    for value in values or ():
        out += [n.strip() for n in value.split(",") if n.strip()]
    return tuple(out)


def _ends_with_semicolon(cell: str) -> bool:
    if ";" not in cell:
        return False
    from IPython.core.displayhook import DisplayHook
    try:
        return DisplayHook.semicolon_at_end_of_expression(cell)
    except (tokenize.TokenError, SyntaxError):  # the cell already ran, so just show the value
        return False


@magics_class
class OnDeviceMagics(Magics):
    """The ``%%ondevice`` cell magic."""

    _parsed: dict = {}

    def _parse(self, line: str):
        """``parse_argstring``, remembered per line: a loop of cells repeats the same line."""
        cached = self._parsed.get(line)
        if cached is None:
            cached = parse(self.ondevice, line)   # a bad flag's error ends with the usage line
            if len(self._parsed) > 256:
                self._parsed.clear()
            self._parsed[line] = cached
        return argparse.Namespace(**vars(cached))

    @magic_arguments()
    @argument("device", nargs="?", default=None,
              help="cpu, cuda (or gpu), cuda:N, N, mps or meta, quoted or not ('cuda:1'); omitted: the "
                   "session's current device (picked in %%gpuinfo, else cuda:0 where there is a GPU, else cpu)")
    @argument("--stream", action="store_true",
              help="run on a side stream of DEVICE, ordered with the current stream on entry and exit")
    @argument("--sync", action="store_true", help="synchronise DEVICE when the cell ends")
    @argument("--time", action="store_true",
              help="report the cell's time: CUDA events (after the streams the cell made or made current) "
                   "and wall time until the device finished")
    @argument("--move", action="append", metavar="NAME[,NAME...]",
              help="move these notebook tensors (rebound) and modules (in place) to DEVICE first")
    @argument("--no-rewrite", action="store_true", dest="no_rewrite",
              help="do not rewrite .cuda()/'cuda' placement; only make DEVICE the default device")
    @cell_magic
    def ondevice(self, line, cell):
        """Run the cell on DEVICE; CUDA-specific placement in it follows DEVICE.

        In a notebook::

            %%ondevice cuda:1
            a = torch.cuda.FloatTensor([1., 2.])    # on cuda:1
            model = sq.cuda()                       # on cuda:1
            model(torch.randn(3, 20).cuda())

            %%ondevice cpu --time
            model(torch.randn(3, 20).cuda())        # the same cell, on the CPU

        ``.cuda()``, ``.to('cuda')``, ``torch.device('cuda')``,
        ``device='cuda:0'`` and ``torch.cuda.FloatTensor(...)``-style
        constructors land on DEVICE; factories (``torch.zeros``,
        ``nn.Linear(...)``) get ``device=DEVICE``; modules built during the
        cell have their parameters placed on DEVICE. Afterwards torch's
        default device, the current CUDA device and stream are restored.
        """
        __tracebackhide__ = True
        from ..ondevice.run import OnDeviceOptions, run_on_device
        args = self._parse(line)
        options = OnDeviceOptions(
            device=args.device, stream=args.stream, sync=args.sync, time=args.time,
            move=_names(args.move), rewrite=not args.no_rewrite,
            header=f"%%ondevice {line}".rstrip(),
        )
        try:
            result = run_on_device(self.shell, cell, options, note=note)
        except SyntaxError as exc:
            exc.__traceback__ = None  # IPython lists a SyntaxError's frames; ours say nothing
            raise exc
        if result.timing is not None:
            print(result.timing)
        if _ends_with_semicolon(cell):
            return None  # IPython checks the wrapper line, which never ends in ';'
        return result.value
