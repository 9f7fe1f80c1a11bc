"""The model zoos that the tests and the benchmarks share: torchvision's, timm's, a UNet, and the
functional-break nets of :mod:`functional_models`.

Not part of the installed package: the benchmarks import it as ``zoo_models`` (next to them),
the tests in ``tests/app/`` as ``benchmarks.zoo_models`` (``tests/conftest.py`` puts the repository root on the
path; ``tests/core/`` imports nothing of the benchmarks).

Each :class:`ZooEntry` names a model, its family, where its definition comes from
(``'torchvision'``, ``'timm'`` or ``'local'``: this module's :class:`UNet` or a model of
:mod:`functional_models`, whose entries are its ``FUNCTIONAL_ZOO``), the input shape
it runs at (small: each model at the least it accepts, for CPU tests), and any keyword
arguments its builder needs for that input (``img_size`` for nets with fixed attention
windows). :func:`build` makes the model with random weights, from a fixed seed, and never
downloads anything (torchvision ``weights=None``, timm ``pretrained=False``). timm is needed
only to build :data:`TIMM_ZOO` entries (``pip install 'channels-last-algo[timm]'``).

:mod:`functional_models` imports :class:`ZooEntry` from here, so this module imports it only inside
:func:`by_name` and :func:`build`, on first use: importing either module never waits on the other.

Example:
    >>> entry = by_name('resnet18')
    >>> entry.family, entry.input_shape
    ('resnet', (2, 3, 64, 64))
    >>> build(entry, num_classes=10).fc.out_features
    10
    >>> build(by_name('unet'))(torch.randn(*by_name('unet').input_shape)).shape
    torch.Size([2, 3, 64, 64])
    >>> entry = by_name('window_attention_net')
    >>> entry.family, entry.source, build(entry, num_classes=4)(torch.randn(*entry.input_shape)).shape
    ('functional-window', 'local', torch.Size([2, 4]))
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Optional

import torch
from torch import nn

__all__ = ['SOURCES', 'TIMM_ZOO', 'TORCHVISION_ZOO', 'UNet', 'ZooEntry', 'build', 'by_name', 'installed']

SOURCES = ('torchvision', 'timm', 'local')
_SMALL = (2, 3, 64, 64)  # large enough that a stride-32 net's last stage is 2x2, not ambiguous


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One model of a zoo.

    Attributes:
        name: the builder's name (torchvision or timm registry name, ``'unet'``, or a name of
            ``functional_models.MODELS``).
        family: the architecture family, for grouping results.
        source: ``'torchvision'``, ``'timm'`` or ``'local'``.
        input_shape: the N x C x H x W input the tests and benchmarks use.
        kwargs: extra keyword arguments for the builder (as a tuple of pairs, so entries hash).
    """

    name: str
    family: str
    source: str
    input_shape: tuple[int, ...] = _SMALL
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f'zoo entry {self.name!r}: source must be one of {SOURCES}, got {self.source!r}')


def _conv_block(in_channels: int, out_channels: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.GroupNorm(groups, out_channels),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """A small UNet-style model holding layers that torchvision's classifiers lack.

    GroupNorm, InstanceNorm2d (affine and not), reflection and replication padding,
    PixelUnshuffle/PixelShuffle, ConvTranspose2d, bilinear and bicubic upsampling, and skip
    connections joined by ``cat``; encoder (stride 4) and decoder with skips, ``width``
    channels at full resolution. The output has twice the input's resolution.
    """

    def __init__(self, in_channels: int = 3, out_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(in_channels, w, 3), nn.GroupNorm(4, w), nn.ReLU())
        self.down1 = nn.Sequential(
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.InstanceNorm2d(2 * w, affine=True), nn.ReLU()
        )
        self.down2 = nn.Sequential(nn.PixelUnshuffle(2), nn.Conv2d(8 * w, 4 * w, 1), nn.GroupNorm(8, 4 * w), nn.ReLU())
        self.middle = nn.Sequential(
            nn.ReplicationPad2d(1), nn.Conv2d(4 * w, 4 * w, 3), nn.InstanceNorm2d(4 * w), nn.ReLU()
        )
        self.up2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2)
        self.fuse2 = _conv_block(4 * w, 2 * w, 4)
        self.up1 = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False)
        self.side = nn.Sequential(
            nn.Upsample(scale_factor=4, mode='bicubic', align_corners=False), nn.Conv2d(4 * w, w, 1)
        )
        self.fuse1 = _conv_block(2 * w + w, w, 4)
        self.head = nn.Sequential(nn.Conv2d(w, 4 * out_channels, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.stem(x)
        half = self.down1(full)
        middle = self.middle(self.down2(half))
        half = self.fuse2(torch.cat((self.up2(middle), half), dim=1))
        full = torch.cat((self.up1(half), full), dim=1)
        full = self.fuse1(full) + self.side(middle)
        return self.head(full)


def _torchvision(name: str, family: str) -> ZooEntry:
    return ZooEntry(name, family, 'torchvision')


def _timm(name: str, family: str, input_shape: tuple[int, ...] = _SMALL, **kwargs: Any) -> ZooEntry:
    return ZooEntry(name, family, 'timm', input_shape, tuple(sorted(kwargs.items())))


TORCHVISION_ZOO: tuple[ZooEntry, ...] = (
    _torchvision('resnet50', 'resnet'),
    _torchvision('resnext50_32x4d', 'resnet'),
    _torchvision('wide_resnet50_2', 'resnet'),
    _torchvision('densenet121', 'densenet'),
    _torchvision('efficientnet_b0', 'efficientnet'),
    _torchvision('mobilenet_v2', 'mobilenet'),
    _torchvision('mobilenet_v3_large', 'mobilenet'),
    _torchvision('shufflenet_v2_x1_0', 'shufflenet'),
    _torchvision('squeezenet1_1', 'squeezenet'),
    _torchvision('googlenet', 'inception'),
    _torchvision('vgg11_bn', 'vgg'),
    _torchvision('mnasnet1_0', 'mnasnet'),
    _torchvision('regnet_y_400mf', 'regnet'),
    _torchvision('convnext_tiny', 'convnext'),
    ZooEntry('unet', 'unet', 'local', (2, 3, 32, 32)),
)
"""torchvision's classifiers (GoogLeNet needs >= 64 px) and the UNet-style test model."""

TIMM_ZOO: tuple[ZooEntry, ...] = (
    _timm('resnet10t', 'resnet'),
    _timm('legacy_seresnet18', 'se-sk-split-attention'),
    _timm('skresnet18', 'se-sk-split-attention'),
    _timm('resnest14d', 'se-sk-split-attention'),
    _timm('efficientnet_b0', 'efficientnet-mobilenet'),
    _timm('mobilenetv2_050', 'efficientnet-mobilenet'),
    _timm('mobilenetv3_small_050', 'efficientnet-mobilenet'),
    _timm('mobilenetv4_conv_small', 'efficientnet-mobilenet'),
    _timm('ghostnet_050', 'ghostnet-rexnet'),
    _timm('ghostnetv2_100', 'ghostnet-rexnet'),
    _timm('rexnet_100', 'ghostnet-rexnet'),
    _timm('regnetx_002', 'regnet'),
    _timm('regnety_002', 'regnet'),
    _timm('convnext_atto', 'convnext'),
    _timm('repvgg_a0', 'reparameterisable'),
    _timm('mobileone_s0', 'reparameterisable'),
    _timm('fastvit_t8', 'reparameterisable'),
    _timm('densenet121', 'densenet-dpn-dla-hrnet-vovnet'),
    _timm('dpn48b', 'densenet-dpn-dla-hrnet-vovnet'),
    _timm('dla46_c', 'densenet-dpn-dla-hrnet-vovnet'),
    _timm('hrnet_w18_small', 'densenet-dpn-dla-hrnet-vovnet'),
    _timm('ese_vovnet19b_dw', 'densenet-dpn-dla-hrnet-vovnet'),
    _timm('resnetv2_50x1_bit', 'weight-standardised-nf'),
    _timm('nf_regnet_b0', 'weight-standardised-nf'),
    _timm('mobilevit_xxs', 'hybrid-conv-attention'),
    _timm('mobilevitv2_050', 'hybrid-conv-attention'),
    _timm('efficientformerv2_s0', 'hybrid-conv-attention', img_size=64),
    _timm('coatnet_pico_rw_224', 'hybrid-conv-attention', img_size=64),
    _timm('efficientvit_b0', 'hybrid-conv-attention'),
    _timm('efficientvit_m0', 'hybrid-conv-attention', img_size=64),
    _timm('edgenext_xx_small', 'hybrid-conv-attention'),
    _timm('halonet26t', 'hybrid-conv-attention', self_attn_kwargs=(('block_size', 2), ('halo_size', 1))),
    _timm('botnet26t_256', 'hybrid-conv-attention', img_size=64, width_factor=0.25),
    _timm('lambda_resnet26t', 'hybrid-conv-attention', width_factor=0.25),
    _timm('maxvit_pico_rw_256', 'hybrid-conv-attention', img_size=64, depths=(1, 1, 1, 1)),
    _timm('levit_conv_128s', 'hybrid-conv-attention', img_size=64, depth=(1, 1, 1)),
    _timm('tiny_vit_5m_224', 'hybrid-conv-attention', depths=(1, 1, 1, 1), embed_dims=(32, 64, 80, 160)),
    _timm('mobilenetv4_hybrid_medium_075', 'hybrid-conv-attention'),
    _timm('repvit_m0_9', 'hybrid-conv-attention', depth=(1, 1, 1, 1)),
)
"""timm model definitions across families, the smallest variant of each, at 2 x 3 x 64 x 64: 39 models,
few enough that the zoo test checks them all in a few minutes on 2 CPU cores."""

TIMM_HEAVY_ZOO: tuple[ZooEntry, ...] = (_timm('focalnet_tiny_srf', 'hybrid-conv-attention'),)
"""timm families whose smallest definition takes no size arguments and costs the zoo test several times
another model's time (FocalNet: 28M parameters, focal modulation): audited by the benchmarks, not the test."""

_EXTRA = (ZooEntry('resnet18', 'resnet', 'torchvision'),)


def _functional() -> ModuleType:
    """:mod:`functional_models`, next to this module: imported here, on first use, since it imports
    :class:`ZooEntry` from this module."""
    return importlib.import_module(f'{__package__}.functional_models' if __package__ else 'functional_models')


def _zoos() -> tuple[ZooEntry, ...]:
    return TORCHVISION_ZOO + TIMM_ZOO + TIMM_HEAVY_ZOO + _functional().FUNCTIONAL_ZOO


def by_name(name: str, source: Optional[str] = None) -> ZooEntry:
    """The zoo entry called ``name`` (torchvision's first, unless ``source`` is given).

    ``resnet18`` is also known here, for quick examples. ValueError naming the zoo otherwise.
    """
    for entry in _zoos() + _EXTRA:
        if entry.name == name and source in (None, entry.source):
            return entry
    raise ValueError(f'{name!r} is in no zoo; choose from {", ".join(e.name for e in _zoos())}')


def installed(names: Sequence[str]) -> list[str]:
    """Those of ``names`` whose library is installed (a timm model's only where timm is).

    Example:
        >>> installed(['resnet18', 'unet'])
        ['resnet18', 'unet']
    """
    timm = importlib.util.find_spec('timm') is not None
    return [name for name in names if by_name(name).source != 'timm' or timm]


def _local(entry: ZooEntry, kwargs: dict[str, Any]) -> nn.Module:
    """A model of this repository: :class:`UNet` or one of ``functional_models.MODELS``."""
    classes: dict[str, type[nn.Module]] = {'unet': UNet, **_functional().MODELS}
    if entry.name not in classes:
        raise ValueError(f'no local model is called {entry.name!r}; choose from {", ".join(classes)}')
    model_class = classes[entry.name]
    if 'num_classes' in kwargs and 'num_classes' not in inspect.signature(model_class).parameters:
        raise ValueError(f'zoo model {entry.name!r} has no classifier, so num_classes cannot be set')
    return model_class(**kwargs)


def _is_mapping(value: Any) -> bool:
    """True for a mapping written as pairs in an entry (``(('block_size', 2),)``), so entries hash."""
    return (
        isinstance(value, tuple)
        and bool(value)
        and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in value)
    )


def _create(entry: ZooEntry, num_classes: Optional[int]) -> nn.Module:
    kwargs = {key: dict(value) if _is_mapping(value) else value for key, value in entry.kwargs}
    if num_classes is not None:
        kwargs['num_classes'] = num_classes
    if entry.source == 'local':
        return _local(entry, kwargs)
    if entry.source == 'timm':
        from channels_last_algo.integrations import require

        require('timm', 'timm')
        import timm

        return timm.create_model(entry.name, pretrained=False, **kwargs)
    import torchvision

    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # googlenet's init_weights notice
        return torchvision.models.get_model(entry.name, weights=None, **kwargs)


def build(entry: ZooEntry, num_classes: Optional[int] = None, seed: int = 0) -> nn.Module:
    """The model of ``entry`` with random weights drawn from ``seed`` (the global random state
    is left as it was), in training mode, on the CPU, NCHW; ``num_classes`` outputs if given."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _create(entry, num_classes)
    return model.train()


def library_versions() -> dict[str, Optional[str]]:
    """The version of timm, which builds :data:`TIMM_ZOO` (None where it is not installed), for a
    benchmark's machine record."""
    try:
        import timm
    except ImportError:
        return {'timm': None}
    return {'timm': timm.__version__}
