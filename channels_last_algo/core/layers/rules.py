"""The repair rules: which layer that drops NHWC is replaced by which NHWC-preserving layer.

Each :class:`RepairRule` names one module type (matched exactly, so subclasses with their own
forward are left alone), an optional condition on the module's settings, and a replacement
that subclasses the original and only overrides ``forward``. Applying a rule reassigns the
module's class in place: the module keeps its ``Parameter`` and buffer objects (an optimizer
built before stays valid), its hooks, and its ``state_dict`` keys and values, so checkpoints
load into the repaired and the unrepaired model alike. Adding a rule is adding a row to
:data:`RULES` and a small layer in this package.

Rules marked ``cuda_only`` remove breaks that only CUDA kernels have; they are applied only to
models on CUDA (their layers compute the same numbers on any device). When several rules match
a module, the first applicable row wins.

Some breaks need no rule of their own because they follow from one that has a rule: the
layer-scale ``mul``/``add`` of ConvNeXt's last blocks and the activation backward before a
classifier come from the global pool's NCHW gradient, and the ``add`` and ``threshold_backward``
around a UNet's ``ConvTranspose2d`` from the instance norm and bicubic breaks before them
(ConvTranspose2d's own weight gradient keeps NHWC on torch 2.7 CPU). ConvNeXt's
``LayerNorm2d`` already normalises the (N, H, W, C) permutation, which is NHWC-natural.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.InstanceNorm2d(8))
    >>> [(r.path, r.original, r.rule) for r in repair_model(model)]
    [('1', 'torch.nn.modules.instancenorm.InstanceNorm2d', 'instance_norm')]
    >>> type(model[1]).__name__
    'ChannelsLastInstanceNorm2d'
    >>> repair_model(model)         # idempotent
    []
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.shufflenetv2 import InvertedResidual

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

__all__ = ['RULES', 'RepairRecord', 'RepairRule', 'repair_model']

log = logging.getLogger(__name__)


def _qualified_name(cls: type) -> str:
    return f'{cls.__module__}.{cls.__qualname__}'


@dataclasses.dataclass(frozen=True)
class RepairRule:
    """One row of the rule table.

    Attributes:
        name: short identifier, reported in :class:`RepairRecord`.
        original: the module type this rule replaces (exact type, not subclasses).
        replacement: a subclass of ``original`` that adds no state and keeps NHWC.
        removes: the layout break the replacement removes (op, pass, where it shows).
        cuda_only: apply only to models on CUDA (the break is in a CUDA kernel only).
        condition: further test on the module's settings; None matches every instance.
    """

    name: str
    original: type
    replacement: type
    removes: str
    cuda_only: bool = False
    condition: Optional[Callable[[nn.Module], bool]] = None

    def __post_init__(self) -> None:
        if not issubclass(self.replacement, self.original):
            raise TypeError(
                f'repair rule {self.name!r}: replacement {_qualified_name(self.replacement)} must subclass '
                f'{_qualified_name(self.original)} so that the swapped module keeps its state; '
                'derive the replacement from the original and override forward only'
            )

    def matches(self, module: nn.Module, device: torch.device) -> bool:
        """True when this rule applies to ``module`` in a model on ``device``."""
        if type(module) is not self.original or (self.cuda_only and device.type != 'cuda'):
            return False
        return self.condition is None or self.condition(module)


@dataclasses.dataclass(frozen=True)
class RepairRecord:
    """One module that :func:`repair_model` replaced.

    Attributes:
        path: the module's name in ``model.named_modules()`` ('' for the model itself).
        original: qualified name of the module's type before the repair.
        rule: name of the :class:`RepairRule` applied.
    """

    path: str
    original: str
    rule: str


RULES: tuple[RepairRule, ...] = (
    RepairRule(
        name='global_avg_pool',
        original=nn.AdaptiveAvgPool2d,
        replacement=ChannelsLastAdaptiveAvgPool2d,
        condition=is_global_pool,
        removes='backward: the gradient of a 1x1 adaptive average pool is written NCHW, so the activation '
        'before it turns NCHW (silu_backward in EfficientNet, hardswish_backward in MobileNetV3, the '
        'layer-scale mul/add of the last ConvNeXt blocks)',
    ),
    RepairRule(
        name='mobilenet_v2_global_pool',
        original=MobileNetV2,
        replacement=ChannelsLastMobileNetV2,
        removes="backward: hardtanh_backward of MobileNetV2's last ReLU6 returns NCHW after the functional "
        'global pool in its forward',
    ),
    RepairRule(
        name='shufflenet_channel_shuffle',
        original=InvertedResidual,
        replacement=ChannelsLastInvertedResidual,
        removes="forward and backward: aten.cat returns NCHW after channel_shuffle's channels-first "
        'contiguous copy, in every ShuffleNetV2 block',
    ),
    RepairRule(
        name='group_norm_cuda',
        original=nn.GroupNorm,
        replacement=ChannelsLastGroupNorm,
        cuda_only=True,
        removes='forward and backward on CUDA: native_group_norm makes its input contiguous and returns NCHW',
    ),
    RepairRule(
        name='instance_norm',
        original=nn.InstanceNorm2d,
        replacement=ChannelsLastInstanceNorm2d,
        condition=uses_input_statistics,
        removes='forward: instance norm reshapes its input to 1 x N*C x H x W for batch_norm, an NCHW clone '
        '(and the NCHW tensors after it, in forward and backward)',
    ),
    RepairRule(
        name='bicubic_upsample',
        original=nn.Upsample,
        replacement=ChannelsLastBicubicUpsample,
        condition=is_bicubic,
        removes='backward: upsample_bicubic2d_backward returns NCHW (and is slow on NHWC input on CPU)',
    ),
    RepairRule(
        name='pixel_shuffle_cuda',
        original=nn.PixelShuffle,
        replacement=ChannelsLastPixelShuffle,
        cuda_only=True,
        removes='forward on CUDA: pixel_shuffle (math_pixel_shuffle) clones to contiguous NCHW',
    ),
    RepairRule(
        name='pixel_unshuffle_cuda',
        original=nn.PixelUnshuffle,
        replacement=ChannelsLastPixelUnshuffle,
        cuda_only=True,
        removes='forward on CUDA: pixel_unshuffle (math_pixel_unshuffle) clones to contiguous NCHW',
    ),
    RepairRule(
        name='reflection_pad_cuda',
        original=nn.ReflectionPad2d,
        replacement=ChannelsLastReflectionPad2d,
        cuda_only=True,
        removes='forward and backward on CUDA: reflection_pad2d allocates NCHW output and gradient',
    ),
    RepairRule(
        name='replication_pad_cuda',
        original=nn.ReplicationPad2d,
        replacement=ChannelsLastReplicationPad2d,
        cuda_only=True,
        removes='forward and backward on CUDA: replication_pad2d allocates NCHW output and gradient',
    ),
)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device('cpu')


def repair_model(
    model: nn.Module,
    device: Optional[Union[torch.device, str]] = None,
    rules: Sequence[RepairRule] = RULES,
) -> list[RepairRecord]:
    """Swap, in place, every module of ``model`` that a rule matches for its NHWC replacement.

    Args:
        model: the model to repair; its modules change class, nothing else changes.
        device: the device the model trains on, which decides whether CUDA-only rules apply;
            by default the device of the model's first parameter or buffer (CPU if none).
        rules: the rule table, :data:`RULES` unless given.

    Returns:
        One :class:`RepairRecord` per replaced module, in ``named_modules`` order; empty
        when nothing matched (a repaired model matches nothing again).
    """
    device = _model_device(model) if device is None else torch.device(device)
    records = []
    for path, module in model.named_modules():
        rule = next((r for r in rules if r.matches(module, device)), None)
        if rule is None:
            continue
        records.append(RepairRecord(path=path, original=_qualified_name(type(module)), rule=rule.name))
        module.__class__ = rule.replacement
    if records:
        log.info('%s: repaired %d modules for channels last: %s', type(model).__name__, len(records),
                 ', '.join(sorted({r.rule for r in records})))
    return records
