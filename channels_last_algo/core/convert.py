"""``apply_channels_last``: the functional form of the algorithm, and its inverse.

Restrides the 4D parameters and buffers of a model's convolutions to ``torch.channels_last``
and the 5D ones to ``torch.channels_last_3d``, in place (any other 4D/5D tensor, such as a
positional embedding or a weight bank that the model views, keeps its layout and is listed in
the summary), and (``repair=True``) swaps the layers that would
drop NHWC for their NHWC-preserving equivalents (see :mod:`channels_last_algo.core.layers`).
The ``Parameter`` objects stay the same (an
optimizer built before stays valid), their gradients and any optimizer state shaped like
them are restrided too, and the ``state_dict`` keys do not change. Ambiguous shapes (1x1 and
depthwise kernels, ``in_channels=1``) get real channels-last strides.

The ``state_dict`` afterwards: the same keys, shapes and values, and, as after PyTorch's own
``model.to(memory_format=torch.channels_last)``, its 4D/5D entries alias the model's tensors
and so have NHWC strides (EMA code updates models through those aliases). Save
``canonical_state(model.state_dict())`` (:mod:`~channels_last_algo.core.canonical_checkpoints`) for a
file that holds NCHW-contiguous tensors, as the Composer algorithm, the Lightning callback and
``channels-last train`` do; ``load_state_dict`` of either kind keeps the model channels last.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv3d(8, 4, 1))
    >>> summary = apply_channels_last(model)
    >>> summary.converted
    ['0.weight', '1.weight']
    >>> model[0].weight.is_contiguous(memory_format=torch.channels_last)
    True
    >>> apply_channels_last(model).converted        # idempotent
    []
    >>> apply_channels_first(model).converted       # back to NCHW / NCDHW
    ['0.weight', '1.weight']
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch.nn.parameter import is_lazy

from channels_last_algo.core.argument_checks import require_flags, require_module, require_optimizers
from channels_last_algo.core.channels_first_outputs import take_back
from channels_last_algo.core.extension_functions import cover_extension_functions
from channels_last_algo.core.layers import repair_model, unrepaired_subclasses
from channels_last_algo.core.layout import MemoryFormat, channels_last_format, to_channels_first, to_channels_last
from channels_last_algo.core.module_calls import is_torchscript
from channels_last_algo.core.optimizer_state_layout import keep_state_in_weight_layout, match_state_to_weights
from channels_last_algo.core.process_sharing import shared_between_processes
from channels_last_algo.core.safety.bugs import crashing_subclasses, make_safe, unsafe_subclasses, why_kept_nchw
from channels_last_algo.core.swap_records import SwapRecord, UncoveredLayer
from channels_last_algo.core.weight_layout import ddp_around, weight_layout_for

__all__ = [
    'ConversionSummary',
    'apply_channels_first',
    'apply_channels_last',
    'convert_quietly',
    'keep_weights_contiguous',
    'refuse_under_ddp',
    'restride',
]

log = logging.getLogger(__name__)

Optimizers = Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]]
"""An optimizer, several, or None: what every conversion takes alongside the model."""


@dataclasses.dataclass
class ConversionSummary:
    """What :func:`apply_channels_last` (or :func:`apply_channels_first`) changed.

    Attributes:
        layout: ``'channels last'`` or ``'channels first'`` (a :class:`~channels_last_algo.core.layout.MemoryFormat`
            as text), the format the tensors now have.
        converted: names (as in ``state_dict``) of the 4D/5D tensors that were restrided.
        unchanged: names of the 4D/5D tensors that already had that layout.
        optimizer_states: how many optimizer state tensors were restrided to their parameter's strides.
        uninitialized: names of lazy-module parameters that have no shape yet and were skipped.
        repaired: the layers swapped for NHWC-preserving ones (``repair=True``; kind ``'repair'``).
        made_safe: the layers routed around a known layout kernel bug (``kernel_safety=True``;
            kind ``'safe_path'``).
        not_covered: the layers that a repair rule or a known bug's safe path needs but whose class
            overrides what the swap replaces (its own ``forward``), so they keep their class; each
            names the row it needs.
        left: the 4D/5D tensors no convolution owns (a positional embedding, a weight bank the
            model views), each with why it keeps its layout: only convolution tensors are restrided.
        kept_channels_first: the layers of :attr:`not_covered` whose kernel bug crashes or hangs channels
            last (by :func:`apply_channels_last`): the model was left NCHW for them, nothing restrided or
            swapped, so it trains as NCHW does, with its batches as they come.
    """

    layout: str = str(MemoryFormat.CHANNELS_LAST)
    converted: list[str] = dataclasses.field(default_factory=list)
    unchanged: list[str] = dataclasses.field(default_factory=list)
    optimizer_states: int = 0
    uninitialized: list[str] = dataclasses.field(default_factory=list)
    repaired: list[SwapRecord] = dataclasses.field(default_factory=list)
    made_safe: list[SwapRecord] = dataclasses.field(default_factory=list)
    not_covered: list[UncoveredLayer] = dataclasses.field(default_factory=list)
    left: dict[str, str] = dataclasses.field(default_factory=dict)
    kept_channels_first: list[UncoveredLayer] = dataclasses.field(default_factory=list)

    @property
    def tensors(self) -> int:
        """How many 4D/5D tensors the model holds, all in :attr:`layout` now."""
        return len(self.converted) + len(self.unchanged)

    @property
    def nothing_channels_last(self) -> bool:
        """Channels last was asked for, but no 4D/5D tensor of the model is or will be (a lazy one) channels last (a
        TorchScript model, tensors no convolution owns, :attr:`kept_channels_first`): NHWC batches would only add
        layout copies to each step, or reach the layer that crashes."""
        nothing = self.layout == str(MemoryFormat.CHANNELS_LAST) and not (self.tensors or self.uninitialized)
        return nothing or bool(self.kept_channels_first)

    def __str__(self) -> str:
        return (
            f'{self.layout}: {len(self.converted)} tensors restrided, '
            f'{len(self.unchanged)} already {self.layout}, '
            f'{self.optimizer_states} optimizer state tensors restrided, {len(self.repaired)} layers repaired, '
            f'{len(self.made_safe)} layers on a kernel safe path'
        )


Restride = Callable[[torch.Tensor], torch.Tensor]

_RESTRIDES: dict[MemoryFormat, Restride] = {
    MemoryFormat.CHANNELS_LAST: to_channels_last,
    MemoryFormat.CHANNELS_FIRST: to_channels_first,
}


def _restride_in_place(tensor: torch.Tensor, restride: Restride, before: Callable[[], Any] = lambda: None) -> bool:
    """Give ``tensor`` new strides by swapping its ``.data``, calling ``before()`` first; True if it changed."""
    data = tensor.data  # a new alias object on each access: compare against this one
    restrided = restride(data)
    if restrided is data:
        return False
    before()
    tensor.data = restrided
    return True


def refuse_under_ddp(model: torch.nn.Module) -> None:
    """RuntimeError where a live DistributedDataParallel wraps ``model``, whose weights are about to be restrided."""
    if ddp_around(model):
        raise RuntimeError(
            f'channels last: the weights of {type(model).__name__} would be restrided while DistributedDataParallel '
            'wraps it: its gradient buckets keep the strides the weights had when it was built, and DDP would then '
            "hand back wrong gradients. Where code views a weight, pass weights='contiguous' (ChannelsLast, "
            'ChannelsLastCallback, LayoutGuard, algorithms.channels_last.weights in a recipe) so the weights are '
            'contiguous before DDP wraps the model (activations still go NHWC); else restride before wrapping.'
        )


def _owned_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """``module``'s own parameters and buffers, and those its parametrizations keep (``weight_norm``'s
    ``parametrizations.weight.original0``), under their ``state_dict`` names relative to it."""
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)
    parametrizations = getattr(module, 'parametrizations', None)
    if isinstance(parametrizations, torch.nn.ModuleDict):
        for name, tensor in parametrizations.named_parameters():
            yield f'parametrizations.{name}', tensor


def _tensors_by_use(model: torch.nn.Module, restride: Restride) -> Iterable[tuple[str, torch.Tensor, Optional[str]]]:
    """Every 4D/5D (or lazy) parameter and buffer of ``model``, once, with why it keeps its layout:
    None for a convolution's tensors, which go channels last; a reason for any other (a positional
    embedding, a weight bank that the model views and mixes), which is left as it is, and for a
    convolution's tensor whose memory is shared where ``restride`` would copy it (one that already
    has the strides is kept as it is, and counts as unchanged)."""
    seen: set[int] = set()
    sharing = _memory_shared(model)
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.utils.parametrize.ParametrizationList):
            continue  # listed with the module it parametrizes
        convolution = isinstance(module, torch.nn.modules.conv._ConvNd)
        for name, tensor in _owned_tensors(module):
            if id(tensor) in seen or not (is_lazy(tensor) or channels_last_format(tensor) is not None):
                continue
            seen.add(id(tensor))
            reason = None if convolution else f'a tensor of {type(module).__name__}, not a convolution weight'
            if is_torchscript(module):
                reason = "a TorchScript module's tensor (no watch sees into TorchScript)"
            if id(tensor) in sharing and restride(data := tensor.data) is not data:
                reason = sharing[id(tensor)]
            yield (f'{path}.{name}' if path else name), tensor, reason


def _memory_shared(model: torch.nn.Module) -> dict[int, str]:
    """Why each parameter or buffer whose memory is not its own alone keeps its layout: a restrided
    copy would no longer share it (``b.weight.data = a.weight.data``; a view into a larger buffer;
    ``model.share_memory()`` for Hogwild workers)."""
    by_storage: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=True), *model.named_buffers()):
        if is_lazy(tensor):
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a tensor subclass, sparse)
            continue
        if storage.data_ptr() != 0:  # not lazy, not meta
            by_storage.setdefault((tensor.device, storage.data_ptr()), []).append((name, tensor))
    reasons = {}
    for group in by_storage.values():
        for _, tensor in group:
            others = [other for other, t in group if t is not tensor]
            if shared_between_processes(tensor):
                reasons[id(tensor)] = (
                    'shares its memory with other processes (share_memory()): a restrided copy would not'
                )
            elif others:
                reasons[id(tensor)] = f'shares its memory with {others[0]}: a restrided copy would not'
            elif tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                reasons[id(tensor)] = 'a view into a larger buffer: a restrided copy would leave it'
    return reasons


def _restride_model(
    model: torch.nn.Module,
    memory_format: MemoryFormat,
    optimizers: Optimizers,
    outside_ddp: bool = False,
) -> ConversionSummary:
    restride = _RESTRIDES[memory_format]
    summary = ConversionSummary(layout=str(memory_format))
    # before the first weight changes: a walk over the objects alive, where a process group exists
    not_under_ddp = (lambda: None) if outside_ddp else functools.cache(functools.partial(refuse_under_ddp, model))
    for name, tensor, reason in _tensors_by_use(model, restride):
        if is_lazy(tensor):
            summary.uninitialized.append(name)
            continue
        if reason is not None:
            summary.left[name] = reason
            continue
        changed = _restride_in_place(tensor, restride, not_under_ddp)
        grad = getattr(tensor, 'grad', None)
        if grad is not None and channels_last_format(grad) is not None:
            changed = _restride_in_place(grad, restride) or changed
        (summary.converted if changed else summary.unchanged).append(name)

    if optimizers is not None:
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        summary.optimizer_states = sum(match_state_to_weights(optimizer) for optimizer in optimizers)
    return summary


def apply_channels_last(
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    repair: bool = True,
    kernel_safety: bool = True,
) -> ConversionSummary:
    """Restride ``model``'s convolution weights (and their gradients) to channels last in place
    (its ``state_dict`` afterwards: see the module's docstring).

    Args:
        model: the model to convert. Modified in place and also left usable by any optimizer
            that already holds its parameters.
        optimizers: optimizers whose per-parameter state (momentum, Adam moments) should be
            restrided with their parameters; only needed when they already hold state.
        repair: also swap the layers that drop NHWC (channel shuffle, global pooling's
            gradient, instance norm, bicubic upsampling; on CUDA group norm, pixel shuffle,
            padding) for NHWC-preserving subclasses: same parameters, ``state_dict`` keys and
            numbers (:func:`~channels_last_algo.core.layers.repair_model`).
        kernel_safety: also route the layers that match a known layout kernel bug on this torch,
            device and CPU (a crash or wrong numbers in NHWC) through their safe path: same
            parameters, keys and numbers (:func:`~channels_last_algo.core.safety.bugs.make_safe`); and give the
            pybind11 extension functions alive contiguous copies of NHWC tensors, as NCHW hands them
            (:mod:`~channels_last_algo.core.extension_functions`).

    Returns:
        A :class:`ConversionSummary`. A model with no 4D/5D tensor is left alone with a warning, since channels
        last can do nothing for it; so is one with a layer that crashes channels last and takes no safe path.

    Raises:
        ValueError: ``model`` is already wrapped in ``DistributedDataParallel`` (convert the
            bare model, then wrap it), as :class:`~channels_last_algo.core.guard.LayoutGuard` refuses it.
    """
    require_module(model, 'apply_channels_last')
    require_flags('apply_channels_last', repair=repair, kernel_safety=kernel_safety)
    require_optimizers(optimizers, 'apply_channels_last')
    weight_layout_for(model)  # raises on a model already wrapped in DistributedDataParallel
    summary = _converted_unless_it_crashes(model, optimizers, repair, kernel_safety)
    _report_conversion(model, summary)
    return summary


def _converted_unless_it_crashes(
    model: torch.nn.Module, optimizers: Optimizers, repair: bool, kernel_safety: bool
) -> ConversionSummary:
    """:func:`convert_quietly`, unless a layer reaches a known kernel bug that crashes or hangs channels last and
    no safe path replaces it (``kernel_safety``): then the model is left NCHW (``kept_channels_first``)."""
    kept = crashing_subclasses(model) if kernel_safety else []
    if kept:
        return ConversionSummary(not_covered=_not_covered(model, repair, kernel_safety), kept_channels_first=kept)
    return convert_quietly(model, optimizers, repair, kernel_safety)


def convert_quietly(
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    repair: bool = True,
    kernel_safety: bool = True,
) -> ConversionSummary:
    """:func:`apply_channels_last` without its argument checks and its warnings, for a model this
    package built itself: a fused inference graph, whose oneDNN convolutions hold their weights
    prepacked, has no 4D tensor left to warn about, yet its other layers still need the rules.

    Example:
        >>> convert_quietly(torch.nn.Sequential(torch.nn.Linear(2, 2))).tensors
        0
    """
    summary = _restride_model(model, MemoryFormat.CHANNELS_LAST, optimizers)
    summary.made_safe = make_safe(model) if kernel_safety else []
    if kernel_safety:  # pybind11 kernels that read NCHW's memory order get contiguous copies, and fused optimizers
        cover_extension_functions(model)  # state in their parameters' strides
        keep_state_in_weight_layout(model)
    summary.repaired = repair_model(model) if repair else []
    summary.not_covered = _not_covered(model, repair, kernel_safety)
    take_back(model)  # a loaded model's hooks that make viewed outputs channels first
    return summary


def _not_covered(model: torch.nn.Module, repair: bool, kernel_safety: bool) -> list[UncoveredLayer]:
    """The layers a safe path or a repair rule needs but whose class overrides what the swap replaces."""
    return (unsafe_subclasses(model) if kernel_safety else []) + (unrepaired_subclasses(model) if repair else [])


def _report_conversion(model: torch.nn.Module, summary: ConversionSummary) -> None:
    """Warn where channels last could not act on every tensor (lazy parameters, or none at
    all, or kept NCHW); log the summary otherwise. Warnings point at the caller of ``apply_channels_last``."""
    if summary.kept_channels_first:
        warnings.warn(f'{type(model).__name__}: kept NCHW: {why_kept_nchw(summary.kept_channels_first)}', stacklevel=3)
    elif summary.uninitialized:
        warnings.warn(
            f'{type(model).__name__} has uninitialized lazy parameters {summary.uninitialized}, '
            'which were left as they are; run one forward pass to initialize them, then call '
            'apply_channels_last again.',
            stacklevel=3,
        )
    elif summary.tensors == 0 and summary.left:
        reasons = '; '.join(f'{name}: {why}' for name, why in list(summary.left.items())[:3])
        warnings.warn(
            f'{type(model).__name__} has no 4D or 5D tensor channels last may restride ({reasons}'
            f'{"; ..." if len(summary.left) > 3 else ""}); the model was left as it is.',
            stacklevel=3,
        )
    elif summary.tensors == 0:
        warnings.warn(
            f'{type(model).__name__} has no 4D or 5D parameter or buffer (no Conv2d/Conv3d), '
            'so channels last cannot change anything; the model was left as it is.',
            stacklevel=3,
        )
    else:
        log.info('%s: %s', type(model).__name__, summary)


def apply_channels_first(
    model: torch.nn.Module,
    optimizers: Optimizers = None,
) -> ConversionSummary:
    """The inverse restride of :func:`apply_channels_last`: every 4D/5D parameter, buffer,
    gradient and optimizer state tensor back to the default contiguous (NCHW / NCDHW) strides,
    in place. Repaired layers stay: they compute the same numbers in either layout."""
    require_module(model, 'apply_channels_first')
    require_optimizers(optimizers, 'apply_channels_first')
    return restride(model, channels_last=False, optimizers=optimizers)


def keep_weights_contiguous(model: torch.nn.Module, optimizers: Optimizers, sharded: bool) -> ConversionSummary:
    """Contiguous weights for NHWC activations (sharding, or ``weights='contiguous'``): the weights restrided back
    unless ``sharded``, extension functions given NCHW copies, and the layers a known kernel bug reaches on NHWC
    input on their safe paths, as :func:`apply_channels_last` puts them (or NCHW batches where one cannot be)."""
    cover_extension_functions(model)
    summary = ConversionSummary(layout='channels first') if sharded else apply_channels_first(model, optimizers)
    summary.kept_channels_first = crashing_subclasses(model)  # then NCHW batches: the activations reach them too
    summary.made_safe = [] if summary.kept_channels_first else make_safe(model)
    return summary


def restride(
    model: torch.nn.Module,
    channels_last: bool,
    optimizers: Optimizers = None,
    outside_ddp: bool = False,
) -> ConversionSummary:
    """Only restride (no repair, no warning): to channels last, or back to channels first.
    What auto mode does between its trial steps. ``outside_ddp``: the caller made sure no DDP wraps
    ``model`` (:func:`refuse_under_ddp`), which is otherwise looked for before a weight changes."""
    memory_format = MemoryFormat.CHANNELS_LAST if channels_last else MemoryFormat.CHANNELS_FIRST
    return _restride_model(model, memory_format, optimizers, outside_ddp)
