"""Layout classification and restriding of 4D and 5D tensors."""

import pytest
import torch

from channels_last_algo.core.layout import (
    Layout,
    has_channels_last_strides,
    is_channels_last,
    layout_of,
    to_channels_last,
)


@pytest.mark.parametrize(
    'shape,first,last',
    [
        ((2, 3, 8, 8), Layout.NCHW, Layout.NHWC),
        ((2, 3, 4, 8, 8), Layout.NCDHW, Layout.NDHWC),
    ],
)
def test_layout_of_names_both_orders(shape, first, last):
    x = torch.randn(shape)
    assert layout_of(x) is first
    assert layout_of(to_channels_last(x)) is last
    assert last.is_channels_last and first.is_channels_first


@pytest.mark.parametrize('shape', [(2, 1, 8, 8), (2, 16, 1, 1), (8, 1, 3, 3), (4, 8, 1, 1, 1), (4, 1, 3, 3, 3)])
def test_ambiguous_shapes_get_real_channels_last_strides(shape):
    x = torch.randn(shape)
    assert layout_of(x) is Layout.AMBIGUOUS
    # .contiguous() keeps the channels-first strides: that is the trap this module avoids.
    assert not has_channels_last_strides(
        x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    )
    y = to_channels_last(x)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    assert y.stride() == torch.empty(shape).to(memory_format=fmt).stride()
    assert has_channels_last_strides(y) and is_channels_last(y)
    torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_to_channels_last_returns_the_same_tensor_when_nothing_to_do():
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    assert to_channels_last(x) is x
    label = torch.arange(4)
    assert to_channels_last(label) is label


def test_permuted_view_is_other_and_is_restrided():
    x = torch.randn(2, 8, 8, 3).permute(0, 3, 1, 2)  # NHWC bytes: a channels-last view
    assert layout_of(x) is Layout.NHWC
    y = torch.randn(2, 3, 8, 8)[:, :, ::2, :]  # strided slice: dense in neither order
    assert layout_of(y) is Layout.OTHER
    assert layout_of(to_channels_last(y)) is Layout.NHWC
    assert layout_of(torch.randn(3, 4)) is Layout.OTHER


def _tensors_of_every_layout():
    """4D and 5D tensors: contiguous, channels last, ambiguous (size-1 dimensions), permuted, sliced, expanded."""
    generator = torch.Generator().manual_seed(0)
    for shape in [(2, 3, 4, 5), (2, 1, 4, 5), (2, 3, 1, 1), (1, 3, 4, 1), (2, 3, 4, 5, 6), (2, 1, 1, 5, 6)]:
        x = torch.randn(shape, generator=generator)
        yield x
        yield to_channels_last(x)
        yield x.transpose(-1, -2)
        yield to_channels_last(x)[:, :, :1]
        yield to_channels_last(x)[..., ::2]
        yield x[:1].expand(3, *shape[1:])


def test_layouts_inside_vmap_are_those_of_the_same_strides_outside():
    """Inside ``torch.func.vmap`` torch does not say whether a tensor is channels-last contiguous ("NYI"): the
    layout of each sample is read from its strides, as outside."""
    for x in _tensors_of_every_layout():
        assert _read_inside_vmap(x) == [(layout_of(x), is_channels_last(x))], (x.shape, x.stride())


def _read_inside_vmap(x: torch.Tensor) -> list:
    """What ``layout_of`` and ``is_channels_last`` say of ``x`` as the one sample of a batch ``vmap`` runs."""
    seen = []
    torch.func.vmap(lambda t: seen.append((layout_of(t), is_channels_last(t))) or t)(x.expand(2, *x.shape))
    return seen
