"""The repair rules: which layer that drops NHWC is replaced by which NHWC-preserving layer.

Each :class:`RepairRule` is a row of data: the op that breaks (what the audit shows without
the rule), the layer type that holds it (and its subclasses that compute as it does; one with
its own ``forward`` is left alone and named by :func:`unrepaired_subclasses`), an optional
condition on the layer's settings, the replacement (a subclass that only overrides
``forward``), and where the break exists: the devices and the torch versions. A rule applies
only where its break exists, so a rule that a newer torch makes unnecessary is not applied
there; ``tests/core/test_repair.py`` probes every rule's break on the installed torch, so a row
whose versions are wrong fails there.

Applying a rule reassigns the module's class in place (:mod:`channels_last_algo.core.swap`): the
module keeps its ``Parameter`` and buffer objects (an optimizer built before stays valid), its
hooks, and its ``state_dict`` keys and values, so checkpoints load into the repaired and the
unrepaired model alike. Layers of other libraries (timm's) are named by their qualified class name,
and their replacements are imported only when a model holds them, so the table costs no
import. Adding a rule is adding a row to :data:`RULES` and a small layer in this package.
When several rules match a module, the first applicable row wins. A break that no rule removes
stays where it is, and the layout audit names it.

Some breaks need no rule of their own because they follow from one that has a rule: the
layer-scale ``mul``/``add`` of ConvNeXt's last blocks and the activation backward before a
classifier come from the global pool's NCHW gradient, and the ``add`` and ``threshold_backward``
around a UNet's ``ConvTranspose2d`` from the instance norm and bicubic breaks before them.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.InstanceNorm2d(8))
    >>> [(r.path, r.kind, r.reason, r.original) for r in repair_model(model)]
    [('1', 'repair', 'instance_norm', 'torch.nn.modules.instancenorm.InstanceNorm2d')]
    >>> type(model[1]).__name__
    'ChannelsLastInstanceNorm2d'
    >>> repair_model(model)         # idempotent
    []
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Optional, Union

import torch
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.shufflenetv2 import InvertedResidual

from channels_last_algo.core.argument_checks import require_module
from channels_last_algo.core.layers.bicubic import ChannelsLastBicubicUpsample, is_bicubic
from channels_last_algo.core.layers.channel_shuffle import ChannelsLastInvertedResidual
from channels_last_algo.core.layers.global_avg_pool import ChannelsLastAdaptiveAvgPool2d, is_global_pool
from channels_last_algo.core.layers.group_norm_nhwc import (
    ChannelsLastGroupNorm,
    ChannelsLastInstanceNorm2d,
    uses_input_statistics,
)
from channels_last_algo.core.layers.mobilenet_v2 import ChannelsLastMobileNetV2
from channels_last_algo.core.layers.padding import ChannelsLastReflectionPad2d, ChannelsLastReplicationPad2d
from channels_last_algo.core.layers.pixel_shuffle import ChannelsLastPixelShuffle, ChannelsLastPixelUnshuffle
from channels_last_algo.core.runtime import VersionSpec, model_device
from channels_last_algo.core.swap import SwapRow, first_matches, qualified_name, swap_first_match, uncovered
from channels_last_algo.core.swap_records import SwapRecord, UncoveredLayer

__all__ = ['RULES', 'RepairRule', 'repair_model', 'unrepaired_subclasses']

log = logging.getLogger(__name__)

_LAYERS = 'channels_last_algo.core.layers'


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepairRule(SwapRow):
    """One row of the rule table: a :class:`~channels_last_algo.core.swap.SwapRow` (``name``,
    ``original``, ``replacement``, ``devices``, ``torch_versions``: where the break exists) and
    the break it removes.

    Attributes:
        breaks: the op that drops NHWC without the rule, and in which pass ('aten.cat (forward)').
        removes: how the break shows and why the replacement removes it.
        condition: further test on the module's settings; None matches every instance.
    """

    row_kind: ClassVar[str] = 'repair rule'

    breaks: str
    removes: str
    devices: tuple[str, ...] = ('cpu', 'cuda')
    torch_versions: VersionSpec = VersionSpec.parse('>=2.7')
    condition: Optional[Callable[[nn.Module], bool]] = None

    def applies(self, device: torch.device, version: str = torch.__version__) -> bool:
        """True when the break this rule removes exists on ``device`` with torch ``version``."""
        return self.holds_on(device.type, version)

    def reaches(self, module: nn.Module, device: torch.device) -> bool:
        """True when ``module``, an ``original`` or a subclass not swapped yet, holds this rule's
        break in a model on ``device``."""
        return (
            self.applies(device)
            and self.unswapped_original(module)
            and (self.condition is None or self.condition(module))
        )

    def matches(self, module: nn.Module, where: Any) -> bool:
        """True when the swap may replace ``module``'s class (:meth:`SwapRow.matches`) and no other code extends
        its backward (:func:`extended_by_others`)."""
        return super().matches(module, where) and not extended_by_others(module)


def extended_by_others(module: nn.Module) -> bool:
    """Whether code other than this package hooks ``module`` both ways, a forward (or forward pre) hook and a
    backward (or backward pre) hook, as libraries that extend backprop layer by layer do: they pick their handling
    of a layer by its exact class (Opacus's per-sample gradients and BackPACK's extensions look ``type(module)``
    up in a table), which a repair would change under them.

    Example:
        >>> pool = nn.AdaptiveAvgPool2d(1)
        >>> _ = pool.register_forward_hook(print)  # hooks of other code
        >>> logged = extended_by_others(pool)
        >>> _ = pool.register_full_backward_hook(print)
        >>> logged, extended_by_others(pool)
        (False, True)
    """
    forward = (module._forward_hooks, module._forward_pre_hooks)
    backward = (module._backward_hooks, module._backward_pre_hooks)
    return all(any(not _ours(hook) for table in tables for hook in table.values()) for tables in (forward, backward))


def _ours(hook: Any) -> bool:
    """Whether ``hook`` (a function, a bound method, a partial, a callable object) is this package's."""
    hook = getattr(hook, 'func', hook)
    return (getattr(hook, '__module__', None) or type(hook).__module__).startswith(f'{__package__.split(".")[0]}.')


_TIMM_GHOST = 'timm.models.ghostnet'
_TIMM_STD_CONV = 'timm.layers.std_conv'

RULES: tuple[RepairRule, ...] = (
    RepairRule(
        name='global_avg_pool',
        breaks='silu_backward, hardswish_backward, mul, add (backward)',
        original=nn.AdaptiveAvgPool2d,
        replacement=ChannelsLastAdaptiveAvgPool2d,
        condition=is_global_pool,
        removes='the gradient of a 1x1 adaptive average pool is written NCHW, so the activation before it '
        'turns NCHW (silu_backward in EfficientNet, hardswish_backward in MobileNetV3, the layer-scale mul/add '
        'of the last ConvNeXt blocks)',
    ),
    RepairRule(
        name='mobilenet_v2_global_pool',
        breaks='hardtanh_backward (backward)',
        original=MobileNetV2,
        replacement=ChannelsLastMobileNetV2,
        removes="hardtanh_backward of MobileNetV2's last ReLU6 returns NCHW after the functional global pool "
        'in its forward',
    ),
    RepairRule(
        name='shufflenet_channel_shuffle',
        breaks='cat (forward and backward)',
        original=InvertedResidual,
        replacement=ChannelsLastInvertedResidual,
        removes="aten.cat returns NCHW after channel_shuffle's channels-first contiguous copy, in every "
        'ShuffleNetV2 block',
    ),
    RepairRule(
        name='group_norm_cuda',
        breaks='native_group_norm (forward and backward)',
        original=nn.GroupNorm,
        replacement=ChannelsLastGroupNorm,
        devices=('cuda',),
        removes='native_group_norm makes its input contiguous and returns NCHW on CUDA (pytorch#111824)',
    ),
    RepairRule(
        name='instance_norm',
        breaks='clone (forward)',
        original=nn.InstanceNorm2d,
        replacement=ChannelsLastInstanceNorm2d,
        condition=uses_input_statistics,
        removes='instance norm reshapes its input to 1 x N*C x H x W for batch_norm, an NCHW clone (and the '
        'NCHW tensors after it, in forward and backward)',
    ),
    RepairRule(
        name='bicubic_upsample',
        breaks='upsample_bicubic2d_backward (backward)',
        original=nn.Upsample,
        replacement=ChannelsLastBicubicUpsample,
        condition=is_bicubic,
        removes='upsample_bicubic2d_backward returns NCHW (and is slow on NHWC input on CPU)',
    ),
    RepairRule(
        name='pixel_shuffle_cuda',
        breaks='pixel_shuffle (forward)',
        original=nn.PixelShuffle,
        replacement=ChannelsLastPixelShuffle,
        devices=('cuda',),
        removes='pixel_shuffle (math_pixel_shuffle) clones to contiguous NCHW on CUDA',
    ),
    RepairRule(
        name='pixel_unshuffle_cuda',
        breaks='pixel_unshuffle (forward)',
        original=nn.PixelUnshuffle,
        replacement=ChannelsLastPixelUnshuffle,
        devices=('cuda',),
        removes='pixel_unshuffle (math_pixel_unshuffle) clones to contiguous NCHW on CUDA',
    ),
    RepairRule(
        name='reflection_pad_cuda',
        breaks='reflection_pad2d (forward and backward)',
        original=nn.ReflectionPad2d,
        replacement=ChannelsLastReflectionPad2d,
        devices=('cuda',),
        removes='reflection_pad2d allocates NCHW output and gradient on CUDA',
    ),
    RepairRule(
        name='replication_pad_cuda',
        breaks='replication_pad2d (forward and backward)',
        original=nn.ReplicationPad2d,
        replacement=ChannelsLastReplicationPad2d,
        devices=('cuda',),
        removes='replication_pad2d allocates NCHW output and gradient on CUDA',
    ),
    RepairRule(
        name='pooled_upsample',
        breaks='cat (forward)',
        original='torchvision.models.segmentation.deeplabv3.ASPPPooling',
        replacement=f'{_LAYERS}.pooled_upsample.ChannelsLastASPPPooling',
        removes="the upsampled 1x1 pooled map of DeepLabV3's ASPP comes out NCHW (the map's strides are NCHW), "
        'and the cat with the NHWC branches turns NCHW; the map gets channels-last strides first',
    ),
    RepairRule(
        name='channel_slice',
        breaks='add, clone; slice_backward before torch 2.14 (backward)',
        original=f'{_TIMM_GHOST}.GhostModule',
        replacement=f'{_LAYERS}.channel_concat.ChannelsLastGhostModule',
        removes='slicing channels off a concatenation allocates its gradient NCHW (slice_backward, up to torch '
        '2.13), the residual add into that slice (a view) copies the whole concatenation NCHW in backward, and '
        'the add that accumulates the gradients turns NCHW; sliced on the channels-last view before the '
        'concatenation instead',
    ),
    RepairRule(
        name='channel_slice_gated',
        breaks='add, clone; slice_backward before torch 2.14 (backward)',
        original=f'{_TIMM_GHOST}.GhostModuleV2',
        replacement=f'{_LAYERS}.channel_concat.ChannelsLastGhostModuleV2',
        removes='as channel_slice, in the attention-gated ghost module',
    ),
    RepairRule(
        name='split_attention',
        breaks='avg_pool2d_backward (backward, in the layer after it)',
        original='timm.layers.split_attn.SplitAttn',
        replacement=f'{_LAYERS}.split_attention.ChannelsLastSplitAttn',
        removes='the radix sum over an N x R x C x H x W view of an NHWC activation comes out NCHW and '
        '.contiguous() keeps it so; summed over the N x H x W x R x C view instead',
    ),
    *(
        RepairRule(
            name=f'weight_standardization_{index}',
            breaks='clone, copy_ of the weight (backward)',
            original=f'{_TIMM_STD_CONV}.{layer}',
            replacement=f'{_LAYERS}.weight_standardization.ChannelsLast{layer}',
            removes='reshape(1, out_channels, -1) of an NHWC weight copies it to NCHW every step (and its '
            'gradient back); standardised over the channels-last view instead',
        )
        for index, layer in enumerate(('StdConv2d', 'StdConv2dSame', 'ScaledStdConv2d', 'ScaledStdConv2dSame'))
    ),
)


def repair_model(
    model: nn.Module,
    device: Optional[Union[torch.device, str]] = None,
    rules: Sequence[RepairRule] = RULES,
) -> list[SwapRecord]:
    """Swap, in place, every module of ``model`` that a rule matches for its NHWC replacement.

    Args:
        model: the model to repair; its modules change class, nothing else changes.
        device: the device the model trains on, which decides which rules apply (see
            :meth:`RepairRule.applies`); by default the device of the model's first parameter or
            buffer (CPU if none).
        rules: the rule table, :data:`RULES` unless given.

    Returns:
        One :class:`~channels_last_algo.core.swap_records.SwapRecord` (kind ``'repair'``, the rule's name
        as its reason) per replaced module, in ``named_modules`` order; empty when nothing
        matched (a repaired model matches nothing again).
    """
    require_module(model, 'repair_model')
    device = model_device(model) if device is None else torch.device(device)
    records = swap_first_match(model, rules, 'repair', lambda rule, module: rule.matches(module, device))
    if records:
        log.info(
            '%s: repaired %d modules for channels last: %s',
            type(model).__name__,
            len(records),
            ', '.join(sorted({r.reason for r in records})),
        )
    return records


def unrepaired_subclasses(
    model: nn.Module, device: Optional[Union[torch.device, str]] = None, rules: Sequence[RepairRule] = RULES
) -> list[UncoveredLayer]:
    """The modules of ``model`` that a rule's break holds but whose class overrides what the
    replacement takes over (its own ``forward``), or whose backward other code extends
    (:func:`extended_by_others`), so :func:`repair_model` leaves them as they are.

    Example:
        >>> class OwnPool(nn.AdaptiveAvgPool2d):
        ...     def forward(self, x):
        ...         return super().forward(x) * 2
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), OwnPool(1))
        >>> [(u.path, u.reason, u.overrides) for u in unrepaired_subclasses(model)]
        [('1', 'global_avg_pool', ('forward',))]
    """
    device = model_device(model) if device is None else torch.device(device)

    def hooked(rule: RepairRule, module: nn.Module) -> bool:  # what the rule would swap but for the hooks
        return extended_by_others(module) and SwapRow.matches(rule, module, device)

    return uncovered(model, rules, 'repair', lambda rule, module: rule.reaches(module, device)) + [
        UncoveredLayer(path, 'repair', rule.name, qualified_name(type(module)), (), hooked=True)
        for path, module, rule in first_matches(model, rules, hooked)
    ]
