"""transformers' vision classifiers at their default (ImageNet) configurations, random weights, as
``--models transformers_models:resnet50`` for ``benchmarks/inference.py`` (needs ``pip install transformers``).

Their forward branches on ``return_dict``, so no symbolic trace of the whole model succeeds: they take
the fused path's module route, and the fx route inside it for the stages and layers that trace.

Example:
    python benchmarks/inference.py --models transformers_models:resnet50 --variants nchw channels_last fused
"""

from __future__ import annotations

import torch


def resnet50() -> torch.nn.Module:
    """``ResNetForImageClassification`` as microsoft/resnet-50 configures it (the default config)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig())


def mobilenet_v2() -> torch.nn.Module:
    """``MobileNetV2ForImageClassification`` as google/mobilenet_v2_1.0_224 configures it (the default config)."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    return MobileNetV2ForImageClassification(MobileNetV2Config())
