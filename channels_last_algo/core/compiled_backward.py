"""Compiled training that stays NHWC in backward, where the installed inductor leaves it channels first.

Inductor decides its layout optimisation per compiled graph by counting ``aten.convolution``
nodes (``GraphLowering.decide_layout_opt``); a backward graph holds only ``convolution_backward``,
so it gets none. Since torch 2.13, whose lowering of ``convolution_backward`` follows that decision,
compiled backward then lays some gradients out channels first between its convolutions even for a
converted model (pytorch#189239): on torch 2.14.1, a converted MobileNetV3-large's compiled
backward held 7 such buffers (around its depthwise convolutions). With inductor's
``force_layout_optimization`` on while the graphs compile, it held none
(``benchmarks/compile.py``, variant ``compiled_guarded``).

:class:`CompiledBackwardLayout` turns that setting on (``torch._inductor.config.patch``) from a
training step's start to its end, for a converted model, where :func:`backward_layout_left_off`
says the installed inductor needs it and the user has not turned layout optimisation off.
Inductor reads its settings only while it compiles (the forward at the compiled model's first
call, the backward lazily at its first backward, both inside the step): a step that compiles
nothing is untouched, and nothing outside the steps changes. What it does not reach: a gradient
that no convolution's preference reaches in backward (ResNet-18's max-pool gradient) stays as
inductor lays it out.

Example:
    >>> from torch._inductor import config
    >>> layout = CompiledBackwardLayout()
    >>> layout.start()
    >>> config.force_layout_optimization == layout.needed
    True
    >>> layout.stop()
    >>> config.force_layout_optimization
    False
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

import torch

from channels_last_algo.core.runtime import version_in

__all__ = ['CompiledBackwardLayout', 'backward_layout_left_off', 'channels_first_buffers']

_LOWERING_FOLLOWS_DECISION = '>=2.13'  # convolution_backward's lowering asks layout_opt (PR 178945)

_DIMS = r'\((\d+), (\d+), (\d+), (\d+)\), \((\d+), (\d+), (\d+), (\d+)\)'  # a 4D size, then its stride
_ALLOCATED = re.compile(r'(\w+) = empty_strided_\w+\(' + _DIMS)  # a buffer inductor's code allocates
_CHECKED = re.compile(r'assert_(?:size_stride|tensor_metadata)\((\w+), ' + _DIMS)  # an input, an extern result
_VIEWED = re.compile(r'reinterpret_tensor\((\w+), ' + _DIMS)


@functools.lru_cache(maxsize=1)
def _inductor_skips_backward_graphs() -> bool:
    """Whether ``decide_layout_opt`` turns layout optimisation off for a graph of one
    ``convolution_backward`` (traced with fake tensors; nothing is compiled)."""
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering
    from torch.fx.experimental.proxy_tensor import make_fx

    def backward(grad: torch.Tensor, images: torch.Tensor, weight: torch.Tensor) -> Any:
        return torch.ops.aten.convolution_backward(
            grad, images, weight, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
        )

    shapes = ((2, 8, 8, 8), (2, 8, 8, 8), (8, 8, 3, 3))
    graph = make_fx(backward, tracing_mode='fake')(*(torch.empty(shape) for shape in shapes))
    with config.patch(force_layout_optimization=False, layout_optimization=True):
        return not GraphLowering.decide_layout_opt(graph, is_inference=False)


def backward_layout_left_off() -> bool:
    """True where the installed inductor lays compiled backward out without its layout optimisation
    (torch >= 2.13 until pytorch#189239 is fixed) and the user has left that optimisation on."""
    if not version_in(torch.__version__, _LOWERING_FOLLOWS_DECISION):
        return False
    from torch._inductor import config

    if not config.layout_optimization or config.force_layout_optimization:
        return False
    return _inductor_skips_backward_graphs()


class CompiledBackwardLayout:
    """Inductor's layout optimisation forced on between :meth:`start` and :meth:`stop`, where needed."""

    def __init__(self) -> None:
        self._patch: Optional[Any] = None

    @functools.cached_property
    def needed(self) -> bool:
        """Whether this torch needs it (:func:`backward_layout_left_off`, asked once, on first use)."""
        return backward_layout_left_off()

    @property
    def note(self) -> Optional[str]:
        """The console's line on it; None where nothing is needed."""
        if not self.needed:
            return None
        return (
            "what training steps compile: inductor's layout optimisation forced on (torch "
            f'{torch.__version__} leaves backward graphs without it, pytorch#189239)'
        )

    def start(self) -> None:
        """A training step starts: force the optimisation on, where needed; nothing if already on."""
        if self.needed and self._patch is None:
            from torch._inductor import config

            self._patch = config.patch(force_layout_optimization=True)
            self._patch.__enter__()

    def stop(self) -> None:
        """The step is over (or failed): inductor's setting as it was; safe to call at any time."""
        patch, self._patch = self._patch, None
        if patch is not None:
            patch.__exit__(None, None, None)


def channels_first_buffers(code: str) -> list[str]:
    """The image-like 4D buffers (C > 1, H*W > 1) of inductor's generated ``code``
    (``torch._inductor.utils.run_and_get_code``) whose channels are not innermost: as allocated or
    checked, or where the code views a buffer in 4D, as viewed.

    Example:
        >>> channels_first_buffers('buf1 = empty_strided_cpu((2, 8, 4, 4), (128, 1, 32, 8), torch.float32)')
        []
        >>> channels_first_buffers('buf2 = empty_strided_cuda((2, 8, 4, 4), (128, 16, 4, 1), torch.float16)')
        ['buf2 = empty_strided_cuda((2, 8, 4, 4), (128, 16, 4, 1)']
    """
    views: dict[str, list[tuple[int, ...]]] = {}
    for match in _VIEWED.finditer(code):
        views.setdefault(match.group(1), []).append(tuple(map(int, match.groups()[1:])))
    found = []
    for match in [*_ALLOCATED.finditer(code), *_CHECKED.finditer(code)]:
        name, dims = match.group(1), tuple(map(int, match.groups()[1:]))
        for _, c, h, w, _, channel_stride, _, _ in views.get(name, [dims]):
            if c > 1 and h * w > 1 and channel_stride != 1:
                found.append(match.group(0))
    return found
