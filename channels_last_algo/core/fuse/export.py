"""Export: the fused copy saved with ``torch.export`` (a ``.pt2`` file) that loads and runs
without this package, at any input size the model accepts.

Example:
    >>> import tempfile
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> path = Path(tempfile.mkdtemp()) / 'net.pt2'
    >>> _, summary = export_for_inference(net, path, torch.randn(2, 3, 8, 8))
    >>> program = torch.export.load(path).module()
    >>> x = torch.randn(3, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> torch.testing.assert_close(program(x), net(x), rtol=1e-4, atol=1e-5)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from channels_last_algo.core.argument_checks import require_flags, require_module, write_problem
from channels_last_algo.core.fuse.inference import fuse_for_inference
from channels_last_algo.core.fuse.summary import FusionSummary
from channels_last_algo.core.layout import to_channels_last

__all__ = ['export_for_inference']

log = logging.getLogger(__name__)

_FAKE_BINARY_REGISTERED = False


def _register_fake_binary_convolution() -> None:
    """Give ``mkldnn::_convolution_pointwise.binary`` the shape function ``torch.export``
    needs (torch 2.7 ships one for the unary form only). The output has ``other``'s shape;
    a saved program runs without it."""
    global _FAKE_BINARY_REGISTERED
    if _FAKE_BINARY_REGISTERED:
        return
    try:
        torch.library.register_fake('mkldnn::_convolution_pointwise.binary')(
            lambda x, other, *args: torch.empty_like(other, memory_format=torch.channels_last)
        )
    except RuntimeError as error:  # a torch that has its own
        log.debug('mkldnn::_convolution_pointwise.binary keeps its fake kernel: %s', error)
    _FAKE_BINARY_REGISTERED = True


def _check_export_arguments(path: Union[str, Path], example_input: torch.Tensor, dynamic_batch: bool) -> None:
    """Refuse a path that is not a file path or that writing could destroy (a folder, a link, an existing file
    that is no ``.pt2``), and a dynamic batch with an example batch of 1; a missing folder is made."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f'export_for_inference: path must be a file path, got {type(path).__name__} {path!r}')
    target = Path(path)
    problem = write_problem(target, '.pt2') if target.parent.exists() or target.is_symlink() else None  # else made
    if problem:
        raise ValueError(f'export_for_inference: path {path}: {problem}')
    if dynamic_batch and example_input.shape[0] < 2:
        raise ValueError(
            f'export with a dynamic batch size needs an example batch of at least 2, got shape '
            f'{tuple(example_input.shape)}; repeat the example along the batch dimension, or fix the '
            'batch size (dynamic_batch=False; --static-batch for `channels-last export`)'
        )


def _export(fused: nn.Module, example_input: torch.Tensor, dynamic_batch: bool) -> torch.export.ExportedProgram:
    """``fused`` traced by ``torch.export`` on the NHWC example, the batch size free when ``dynamic_batch``."""
    _register_fake_binary_convolution()
    example = to_channels_last(example_input)
    dynamic_shapes = {'args': ({0: torch.export.Dim('batch', min=1, max=2**16)},)} if dynamic_batch else None
    with torch.no_grad():
        program = torch.export.export(fused, (example,), dynamic_shapes=dynamic_shapes, strict=False)
    # an unused scalar such as BlurPool's int(torch.div(h, 2)) stays as an aten.item node that
    # torch.export.load cannot read back (torch 2.7 to 2.14): drop what nothing uses
    program.graph_module.graph.eliminate_dead_code()
    program.graph_module.recompile()
    return program


def export_for_inference(
    model: nn.Module, path: Union[str, Path], example_input: torch.Tensor, dynamic_batch: bool = True
) -> tuple[torch.export.ExportedProgram, FusionSummary]:
    """Fuse ``model`` for inference and save it with ``torch.export`` to ``path`` (``.pt2``).

    The saved program holds the folded NHWC weights and calls the fused oneDNN kernels
    (``mkldnn::_convolution_pointwise``) directly, so it loads and runs without this package:
    ``torch.export.load(path).module()(images)``. Where a fused kernel refuses the example's
    shape (``summary.refused``), that convolution is saved as the plain ops. Weights are not
    prepacked in it (oneDNN reorders them on each call), so it runs somewhat slower than
    :func:`~channels_last_algo.core.fuse.fuse_for_inference`'s copy in the same process. The
    program is traced on CPU for the example's channels, height and width; inputs to it are
    expected NHWC.

    Args:
        model: the model, in eval mode (see :func:`~channels_last_algo.core.fuse.fuse_for_inference`).
        path: the file to write.
        example_input: one input batch (N, C, H, W) of the shape and dtype to serve.
        dynamic_batch: let the batch size vary (needs ``example_input`` with N >= 2).

    Returns:
        The exported program that was saved, and what was fused.

    Raises:
        ValueError: ``model`` is in train mode, a dynamic batch has an example batch of 1, or ``path`` is a folder,
            a link, or an existing file that is no ``.pt2`` (which it would overwrite).
    """
    require_module(model, 'export_for_inference')
    require_flags('export_for_inference', dynamic_batch=dynamic_batch)
    _check_export_arguments(path, example_input, dynamic_batch)
    fused = fuse_for_inference(model, example_input, traceable=True)  # its check finds the refused shapes
    program = _export(fused, example_input, dynamic_batch)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, path)
    log.info('saved %s (%s) to %s', type(model).__name__, fused.summary, path)
    return program, fused.summary
