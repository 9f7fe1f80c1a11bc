"""Small conv nets whose layout breaks are functional calls and tensor ops, not module classes.

A repair rule swaps a module class that drops NHWC; a break written in a ``forward`` as a function
call or a tensor op (``x[:, :k]``, ``torch.cat``, an attention reshape, ``x.mean((2, 3))``, an
in-place update) has no class to swap. Each model here holds one such class of break, written the
way real networks write it (FasterNet, GhostNet, ConvNeXt, LeViT, Swin, MaxViT, SE, FocalNet,
SPP/PSP, ShuffleNetV2), at 8 to 32 channels, with BatchNorm, ReLU and GELU, and ends in a pooled
Linear head (``num_classes`` outputs). They test that such breaks are left as the user wrote them
and named: converted with ``apply_channels_last``, each shows at least one layout break of its
class in the audit, and computes what the NCHW model computes. ``FUNCTIONAL_ZOO`` lists them with their
family (the class of break) and input shape; :mod:`zoo_models` finds and builds them like its own
(``by_name``, ``build``: seeded, nothing downloaded). Most breaks are in a block's forward; those of
:class:`PermuteCatNet`, :class:`SqueezeMeanNet` and :class:`InplaceNet` are in the root model's.

Every forward is scriptable (``torch.jit.script``) and exportable (``torch.export``), and all but
:class:`InplaceNet` trace with ``torch.fx.symbolic_trace`` (an fx ``Proxy`` takes no item assignment,
and that model's pattern is one: ``y[:, :k] = conv(x[:, :k])``).

This module imports :class:`ZooEntry` from :mod:`zoo_models` at the top; ``zoo_models`` imports this
module inside its functions, on first use (its name -> class table for ``'local'`` entries is
``{'unet': UNet, **MODELS}``), so neither import waits on the other and the zoo's entry type stays in
one place. The attention nets (families 3 and 4) are in :mod:`functional_attention`, and the conv, head
and stem-blocks-head net that every net is built of in :mod:`functional_blocks`.

Example:
    >>> import torch
    >>> from benchmarks.zoo_models import build, by_name
    >>> entry = by_name('partial_conv_net')
    >>> entry.family, entry.source, entry.input_shape
    ('functional-slice', 'local', (2, 3, 32, 32))
    >>> build(entry).double()(torch.randn(*entry.input_shape, dtype=torch.float64)).shape
    torch.Size([2, 10])
    >>> len(FUNCTIONAL_ZOO) == len(MODELS)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as benchmarks.functional_models (the tests)
    from .functional_attention import AttentionReshapeNet, AttentionViewNet, GridAttentionNet, WindowAttentionNet
    from .functional_blocks import BlocksNet, conv_bn, pooled_head
    from .zoo_models import ZooEntry
except ImportError:  # imported next to the benchmark scripts
    from functional_attention import AttentionReshapeNet, AttentionViewNet, GridAttentionNet, WindowAttentionNet
    from functional_blocks import BlocksNet, conv_bn, pooled_head
    from zoo_models import ZooEntry

__all__ = ['FUNCTIONAL_ZOO', 'MODELS']


# 1. channel slices


class PartialConv(nn.Module):
    """FasterNet's block: a 3x3 conv on the channel slice ``x[:, :k]``, the rest passed on, a 1x1 MLP."""

    def __init__(self, dim: int, ratio: int = 4) -> None:
        super().__init__()
        self.k = dim // ratio
        self.pconv = nn.Conv2d(self.k, self.k, 3, padding=1, bias=False)
        self.mlp = nn.Sequential(conv_bn(dim, 2 * dim, 1), nn.Conv2d(2 * dim, dim, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.pconv(x[:, : self.k]), x[:, self.k :]], 1)
        return x + self.mlp(y)


class PartialConvNet(BlocksNet):
    """functional-slice: the conv sees ``x[:, :k]``, whose backward (``slice_backward``) pads its gradient NCHW."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([PartialConv(width), PartialConv(width)], width, num_classes)


class Ghost(nn.Module):
    """GhostNet's module: a 1x1 conv, a cheap depthwise 3x3 of it, ``torch.cat([a, b], 1)[:, :out]``."""

    def __init__(self, cin: int, out: int, ratio: int = 3) -> None:
        super().__init__()
        init = -(-out // ratio)
        self.out = out
        self.primary = conv_bn(cin, init, 1)
        self.cheap = conv_bn(init, init * (ratio - 1), 3, groups=init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.primary(x)
        return torch.cat([a, self.cheap(a)], 1)[:, : self.out]


class GhostSliceNet(BlocksNet):
    """functional-slice: ghost modules cut their concatenation to ``out`` channels with ``[:, :out]``."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([Ghost(width, 20), Ghost(20, width)], width, num_classes)


# 2. cat with a tensor that came back NCHW


class TokenCat(nn.Module):
    """A token branch (``x.flatten(2).transpose(1, 2)``, LayerNorm, Linear, ``.transpose(1, 2).contiguous()
    .view(B, C, H, W)``) concatenated to the conv features with ``torch.cat`` and fused by a 1x1 conv."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.fuse = conv_bn(2 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.mix(self.norm(x.flatten(2).transpose(1, 2)))
        t = t.transpose(1, 2).contiguous().view(b, c, h, w)
        return self.fuse(torch.cat([x, F.gelu(t)], 1))


class TokenCatNet(BlocksNet):
    """functional-cat: ``torch.cat`` of the NHWC trunk with a token branch viewed back as NCHW."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([TokenCat(width), TokenCat(width)], width, num_classes)


class PermuteCatNet(nn.Module):
    """functional-cat, in the root model's forward: a ConvNeXt-style branch (depthwise conv,
    ``permute(0, 2, 3, 1)``, LayerNorm, Linear, GELU, ``permute(0, 3, 1, 2).contiguous()``)
    concatenated to the trunk with ``torch.cat``."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = conv_bn(3, width, stride=2)
        self.dw = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm = nn.LayerNorm(width)
        self.pw = nn.Linear(width, width)
        self.fuse = conv_bn(2 * width, width, 1)
        self.head = pooled_head(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = F.gelu(self.pw(self.norm(self.dw(x).permute(0, 2, 3, 1))))
        y = y.permute(0, 3, 1, 2).contiguous()
        return self.head(self.fuse(torch.cat([x, y], 1)))


# 3. and 4. attention reshaped back to N x C x H x W, window and grid attention: functional_attention.py


# 5. global mean as a function


class SqueezeMeanNet(nn.Module):
    """functional-mean, in the root model's forward: EfficientNet-style, a squeeze-excitation gate
    ``x * torch.sigmoid(fc(x.mean((2, 3), keepdim=True)))`` on a SiLU output and the head
    ``fc(silu(x).mean((2, 3)))``; the mean's gradient comes back NCHW and meets ``silu_backward``."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = conv_bn(3, width, stride=2)
        self.dw = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False), nn.BatchNorm2d(width))
        self.reduce, self.expand = nn.Conv2d(width, 8, 1), nn.Conv2d(8, width, 1)
        self.last = nn.Sequential(nn.Conv2d(width, 2 * width, 1, bias=False), nn.BatchNorm2d(2 * width))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.dw(self.stem(x)))
        x = x * torch.sigmoid(self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return self.fc(F.silu(self.last(x)).mean((2, 3)))


class FocalModulation(nn.Module):
    """FocalNet: query, context and gates from one 1x1 conv (``torch.split``), depthwise focal levels,
    ``ctx_global = gelu(ctx.mean((2, 3), keepdim=True))`` added to the gated local context."""

    def __init__(self, dim: int, levels: int = 2) -> None:
        super().__init__()
        self.dim, self.levels = dim, levels
        self.f = nn.Conv2d(dim, 2 * dim + levels + 1, 1)
        self.focal = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False), nn.GELU()) for _ in range(levels)]
        )
        self.h = nn.Conv2d(dim, dim, 1)
        self.proj = conv_bn(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, ctx, gates = torch.split(self.f(x), [self.dim, self.dim, self.levels + 1], 1)
        ctx_all = torch.zeros_like(q)
        for level, layer in enumerate(self.focal):
            ctx = layer(ctx)
            ctx_all = ctx_all + ctx * gates[:, level : level + 1]
        ctx_global = F.gelu(ctx.mean((2, 3), keepdim=True))
        ctx_all = ctx_all + ctx_global * gates[:, self.levels :]
        return x + self.proj(q * self.h(ctx_all))


class FocalModulationNet(BlocksNet):
    """functional-mean: focal modulation, whose global context is ``gelu(ctx.mean((2, 3), keepdim=True))``."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([FocalModulation(width), FocalModulation(width)], width, num_classes)


# 6. pooled and split branches concatenated


class PyramidPool(nn.Module):
    """SPP, ``torch.cat([x, F.max_pool2d(x, 5, 1, 2), F.max_pool2d(x, 9, 1, 4)], 1)``, then PSP's
    ``torch.cat([x, F.adaptive_avg_pool2d(x, 1).expand_as(x)], 1)``, each fused by a 1x1 conv."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.spp = conv_bn(3 * dim, dim, 1)
        self.psp = conv_bn(2 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.spp(torch.cat([x, F.max_pool2d(x, 5, 1, 2), F.max_pool2d(x, 9, 1, 4)], 1))
        return self.psp(torch.cat([x, F.adaptive_avg_pool2d(x, 1).expand_as(x)], 1))


class PyramidPoolNet(BlocksNet):
    """functional-pooled-cat: SPP's max-pool branches (NHWC throughout) and PSP's expanded global
    pool (channels first) concatenated to the features."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([PyramidPool(width)], width, num_classes)


class ShuffleSplit(nn.Module):
    """ShuffleNetV2's unit: ``x.chunk(2, 1)``, one half through 1x1 / depthwise 3x3 / 1x1, ``torch.cat``
    of the halves, a functional channel shuffle (``view``, ``transpose(1, 2)``, ``contiguous``, ``view``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        half = dim // 2
        self.branch = nn.Sequential(
            conv_bn(half, half, 1),
            nn.Conv2d(half, half, 3, padding=1, groups=half, bias=False),
            conv_bn(half, half, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, 1)
        y = torch.cat([a, self.branch(b)], 1)
        n, c, h, w = y.shape
        return y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


class SplitShuffleNet(BlocksNet):
    """functional-pooled-cat: ``chunk`` halves concatenated back, one of them already shuffled to NCHW."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([ShuffleSplit(width), ShuffleSplit(width), ShuffleSplit(width)], width, num_classes)


# 7. in-place updates


class BranchSum(nn.Module):
    """Branches summed in place into ``x.new_zeros(x.shape)`` (a channels-first buffer), ``out += x``,
    then ``F.relu(out, inplace=True)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList([conv_bn(dim, dim, 1), conv_bn(dim, dim, 3), conv_bn(dim, dim, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape)
        for branch in self.branches:
            out += branch(x)
        out += x
        return F.relu(out, inplace=True)


class InplaceNet(nn.Module):
    """functional-inplace, partly in the root model's forward: FasterNet's partial conv written on a
    clone (``y[:, :k] = conv(x[:, :k])``), a residual ``y += x`` and ``F.relu(y, inplace=True)``; then
    :class:`BranchSum`. Not traceable by ``torch.fx.symbolic_trace`` (no item assignment on a ``Proxy``);
    ``torch.jit.script`` and ``torch.export`` take it."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.k = width // 4
        self.stem = conv_bn(3, width, stride=2)
        self.pconv = nn.Conv2d(self.k, self.k, 3, padding=1, bias=False)
        self.mlp = nn.Sequential(conv_bn(width, 2 * width, 1), nn.Conv2d(2 * width, width, 1, bias=False))
        self.sum = BranchSum(width)
        self.head = pooled_head(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = x.clone()
        y[:, : self.k] = self.pconv(x[:, : self.k])
        y = self.mlp(y)
        y += x
        y = F.relu(y, inplace=True)
        return self.head(self.sum(y))


MODELS: dict[str, type[nn.Module]] = {
    'partial_conv_net': PartialConvNet,
    'ghost_slice_net': GhostSliceNet,
    'token_cat_net': TokenCatNet,
    'permute_cat_net': PermuteCatNet,
    'attention_reshape_net': AttentionReshapeNet,
    'attention_view_net': AttentionViewNet,
    'window_attention_net': WindowAttentionNet,
    'grid_attention_net': GridAttentionNet,
    'squeeze_mean_net': SqueezeMeanNet,
    'focal_modulation_net': FocalModulationNet,
    'pyramid_pool_net': PyramidPoolNet,
    'split_shuffle_net': SplitShuffleNet,
    'inplace_net': InplaceNet,
}
"""Each model's zoo name and class; every class takes ``num_classes`` (10 by default)."""

_FAMILIES = {
    'functional-slice': ('partial_conv_net', 'ghost_slice_net'),
    'functional-cat': ('token_cat_net', 'permute_cat_net'),
    'functional-attention': ('attention_reshape_net', 'attention_view_net'),
    'functional-window': ('window_attention_net', 'grid_attention_net'),
    'functional-mean': ('squeeze_mean_net', 'focal_modulation_net'),
    'functional-pooled-cat': ('pyramid_pool_net', 'split_shuffle_net'),
    'functional-inplace': ('inplace_net',),
}
_SMALL = ('attention_reshape_net', 'attention_view_net', 'window_attention_net', 'grid_attention_net')

FUNCTIONAL_ZOO: tuple[ZooEntry, ...] = tuple(
    ZooEntry(name, family, 'local', (2, 3, 16, 16) if name in _SMALL else (2, 3, 32, 32))
    for family, names in _FAMILIES.items()
    for name in names
)
"""One entry per model of :data:`MODELS`: the family is its class of break; the attention nets run
at 2 x 3 x 16 x 16 (8 x 8 tokens after the stem), the others at 2 x 3 x 32 x 32."""
