"""The swapped layers: NHWC-preserving replacements for the layers that drop channels last and the
rules that apply them (:mod:`.repair_rules`), and the kernel safe paths that the known layout kernel bugs
(:mod:`channels_last_algo.core.safety.bugs`) route layers through (:mod:`.safe_paths`).

The replacements of timm's layers (``channel_concat``, ``split_attention``,
``weight_standardization``) import timm and are loaded by the rules only for models that
hold those layers, so they are not imported here.

The layers move axes with ``permute`` (or ``movedim``) on axes counted from the front: the
TorchScript ONNX exporter writes negative axes into the ONNX ``Transpose`` as they are, which
onnxruntime refuses. ``tests/core/test_export_matrix.py`` runs every layer through fx,
TorchScript, ``torch.export`` and both ONNX exporters, and compares the numbers.

Example:
    >>> import torch
    >>> from channels_last_algo.core.layers import repair_model
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1))
    >>> [record.reason for record in repair_model(model)]
    ['global_avg_pool']
"""

from channels_last_algo.core.layers.bicubic import ChannelsLastBicubicUpsample, bicubic_upsample_nhwc
from channels_last_algo.core.layers.channel_shuffle import ChannelsLastInvertedResidual, interleave_channels
from channels_last_algo.core.layers.global_avg_pool import ChannelsLastAdaptiveAvgPool2d, global_avg_pool_nhwc
from channels_last_algo.core.layers.group_norm_nhwc import (
    ChannelsLastGroupNorm,
    ChannelsLastInstanceNorm2d,
    group_norm_nhwc,
    instance_norm_nhwc,
)
from channels_last_algo.core.layers.mobilenet_v2 import ChannelsLastMobileNetV2
from channels_last_algo.core.layers.padding import ChannelsLastReflectionPad2d, ChannelsLastReplicationPad2d, pad_nhwc
from channels_last_algo.core.layers.pixel_shuffle import (
    ChannelsLastPixelShuffle,
    ChannelsLastPixelUnshuffle,
    pixel_shuffle_nhwc,
    pixel_unshuffle_nhwc,
)
from channels_last_algo.core.layers.repair_rules import RULES, RepairRule, repair_model, unrepaired_subclasses
from channels_last_algo.core.layers.safe_paths import NCHWAvgPool2d, SubsampledConv2d

__all__ = [
    'RULES',
    'ChannelsLastAdaptiveAvgPool2d',
    'ChannelsLastBicubicUpsample',
    'ChannelsLastGroupNorm',
    'ChannelsLastInstanceNorm2d',
    'ChannelsLastInvertedResidual',
    'ChannelsLastMobileNetV2',
    'ChannelsLastPixelShuffle',
    'ChannelsLastPixelUnshuffle',
    'ChannelsLastReflectionPad2d',
    'ChannelsLastReplicationPad2d',
    'NCHWAvgPool2d',
    'RepairRule',
    'SubsampledConv2d',
    'bicubic_upsample_nhwc',
    'global_avg_pool_nhwc',
    'group_norm_nhwc',
    'instance_norm_nhwc',
    'interleave_channels',
    'pad_nhwc',
    'pixel_shuffle_nhwc',
    'pixel_unshuffle_nhwc',
    'repair_model',
    'unrepaired_subclasses',
]
