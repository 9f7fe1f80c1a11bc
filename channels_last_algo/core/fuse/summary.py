"""What :func:`~channels_last_algo.core.fuse.fuse_for_inference` did: the route taken, each
fused convolution's kernel, the BatchNorms left unfused, where the fused kernel refused the
example's shape, and the backend.

Example:
    >>> summary = FusionSummary('fx', {'conv1': 'conv+bn+relu', 'layer1.0.conv2': 'conv+bn+add+relu'}, ['norm'])
    >>> summary.count('bn'), summary.count('add')
    (2, 1)
    >>> str(summary)
    'fx: 2 convolutions fused, 2 of 3 BatchNorms folded, 2 with an activation, 1 with a residual add'
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ['FusionSummary']


@dataclasses.dataclass
class FusionSummary:
    """What :func:`~channels_last_algo.core.fuse.fuse_for_inference` did.

    Attributes:
        route: ``'fx'`` (patterns matched on a symbolic trace) or ``'modules'`` (the
            module-level fallback, when tracing failed or its result did not match).
        fused: module path of each convolution (in the original model) -> what its fused
            kernel computes, e.g. ``'conv+bn+add+relu'``.
        unfused: module paths of the BatchNorms left in the fused network, unfolded.
        trace_error: why the fx route was not taken, if it was not.
        refused: module path -> the example input's shape at that convolution, where the fused
            kernel refused it and the plain ops run instead.
        backend: ``'eager'`` (the fused kernels called from Python) or ``'inductor'``
            (``torch.compile`` with freezing over the fused network).
        split: path of each BatchNorm folded slice by slice into the convolutions whose outputs it
            read concatenated -> their paths (each is ``'conv+bn...'`` in ``fused``; it counts once).
        graphs: on the module route, the submodules fused on their own traced graphs
            (:mod:`~channels_last_algo.core.fuse.subgraphs`).
        viewed: paths (in the fused network) of the modules whose NHWC outputs are made channels first,
            since code ``.view()``s them in a shape NHWC strides cannot take (found on the first call,
            :mod:`~channels_last_algo.core.viewed_outputs`).
    """

    route: str
    fused: dict[str, str] = dataclasses.field(default_factory=dict)
    unfused: list[str] = dataclasses.field(default_factory=list)
    trace_error: Optional[str] = None
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    backend: str = 'eager'
    split: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    graphs: list[str] = dataclasses.field(default_factory=list)
    viewed: list[str] = dataclasses.field(default_factory=list)

    def count(self, part: str) -> int:
        """How many fused convolutions include ``part`` (``'bn'``, ``'add'``, ``'relu'``...)."""
        return sum(part in kernel.split('+') for kernel in self.fused.values())

    def __str__(self) -> str:
        activations = sum(kernel.split('+')[-1] not in ('conv', 'bn', 'add') for kernel in self.fused.values())
        folded = self.count('bn') - sum(len(paths) - 1 for paths in self.split.values())
        text = (
            f'{self.route}: {len(self.fused)} convolutions fused, {folded} of {folded + len(self.unfused)} BatchNorms '
            f'folded, {activations} with an activation, {self.count("add")} with a residual add'
        )
        if self.graphs:
            text += f'; {len(self.graphs)} submodules fused on their traced graphs'
        if self.refused:
            text += f'; {len(self.refused)} run as plain ops at the example shape (the fused kernel refused it)'
        if self.viewed:
            text += f'; outputs of {", ".join(self.viewed)} made channels first (viewed)'
        if self.backend != 'eager':
            text += f'; compiled by {self.backend} (freezing)'
        return text if self.trace_error is None else f'{text} (fx route not taken: {self.trace_error})'
