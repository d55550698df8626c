"""AST transformers applied to a cell before it runs, one module per concern.

* :mod:`gpumagic.rewrite.placement` - CUDA-specific placement (``.cuda()``,
  ``torch.device('cuda')``, ``torch.cuda.FloatTensor``...) follows the device
  chosen with ``%%ondevice``.

Transformers are plain ``ast.NodeTransformer`` classes; pass them to
:func:`gpumagic.cells.compile_cell`.
"""
from .placement import HELPER, Placement, PlacementRewriter, rewrite_placement

__all__ = ["HELPER", "Placement", "PlacementRewriter", "rewrite_placement"]
