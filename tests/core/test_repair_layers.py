"""The NHWC layers of the repair rules: each computes what the layer it replaces computes, keeps NHWC
in forward and backward, and leaves a repaired model usable with fx, TorchScript, torch.export
and ONNX export."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.shufflenetv2 import channel_shuffle

from channels_last_algo.core.layers import (
    ChannelsLastBicubicUpsample,
    ChannelsLastGroupNorm,
    ChannelsLastInstanceNorm2d,
    ChannelsLastPixelShuffle,
    ChannelsLastPixelUnshuffle,
    ChannelsLastReflectionPad2d,
    ChannelsLastReplicationPad2d,
    bicubic_upsample_nhwc,
    global_avg_pool_nhwc,
    interleave_channels,
    pad_nhwc,
    pixel_shuffle_nhwc,
    pixel_unshuffle_nhwc,
)
from channels_last_algo.core.layers import bicubic as bicubic_module
from channels_last_algo.core.layout import is_channels_last, to_channels_last


def _nhwc(*shape, dtype=torch.float32):
    return to_channels_last(torch.randn(*shape, dtype=dtype))


# each replacement layer against the layer it replaces


def _swapped(native: nn.Module, replacement: type) -> nn.Module:
    """A copy of ``native`` whose class is ``replacement``, as a repair rule swaps it."""
    swapped = copy.deepcopy(native)
    swapped.__class__ = replacement
    return swapped


def _compare_layers(original, replacement_type, x, rtol=1e-5, atol=1e-5):
    """Same output and input gradient as ``original`` (NCHW), with NHWC output and gradient."""
    swapped = _swapped(original, replacement_type)
    x_ref = x.detach().contiguous().requires_grad_()
    x_cl = to_channels_last(x.detach()).requires_grad_()
    expected, actual = original(x_ref), swapped(x_cl)
    assert is_channels_last(actual)
    torch.manual_seed(2)
    grad = to_channels_last(torch.randn(expected.shape, dtype=x.dtype))
    expected.backward(grad.contiguous())
    actual.backward(grad)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(x_cl.grad, x_ref.grad, rtol=rtol, atol=atol)
    for (name, p), q in zip(swapped.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize('padding', [1, (2, 1, 0, 3), (3, 3, 1, 1), (-1, 2, 1, -2)])
@pytest.mark.parametrize(
    'original,replacement',
    [
        (nn.ReflectionPad2d, ChannelsLastReflectionPad2d),
        (nn.ReplicationPad2d, ChannelsLastReplicationPad2d),
    ],
)
def test_padding_matches(original, replacement, padding):
    _compare_layers(original(padding), replacement, torch.randn(2, 5, 6, 7), rtol=0, atol=1e-6)


def test_reflection_padding_as_large_as_the_input_is_refused():
    with pytest.raises(ValueError, match=r'reflection padding \(4, 0\) must be smaller than the padded dimension'):
        pad_nhwc(torch.randn(1, 2, 4, 4), (0, 0, 4, 0), 'reflect')
    with pytest.raises(ValueError, match="mode 'reflect' or 'replicate', not 'circular'"):
        pad_nhwc(torch.randn(1, 2, 4, 4), (1, 1, 1, 1), 'circular')


@pytest.mark.parametrize('factor', [2, 3])
def test_pixel_shuffle_and_unshuffle_match(factor):
    shuffle_input = torch.randn(2, 4 * factor**2, 3, 5)
    unshuffle_input = torch.randn(2, 4, 3 * factor, 2 * factor)
    _compare_layers(nn.PixelShuffle(factor), ChannelsLastPixelShuffle, shuffle_input, rtol=0, atol=0)
    _compare_layers(nn.PixelUnshuffle(factor), ChannelsLastPixelUnshuffle, unshuffle_input, rtol=0, atol=0)


def test_pixel_shuffle_refuses_what_the_native_op_refuses():
    with pytest.raises(ValueError, match='channels divisible by upscale_factor'):
        pixel_shuffle_nhwc(torch.randn(1, 6, 2, 2), 2)
    with pytest.raises(ValueError, match='height and width divisible by downscale_factor'):
        pixel_unshuffle_nhwc(torch.randn(1, 6, 5, 4), 2)


@pytest.mark.parametrize('groups,affine', [(1, True), (4, True), (16, True), (4, False)])
def test_group_norm_matches(groups, affine):
    torch.manual_seed(0)
    norm = nn.GroupNorm(groups, 16, affine=affine, eps=1e-3)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    _compare_layers(norm, ChannelsLastGroupNorm, torch.randn(3, 16, 5, 6) * 3 + 1)


def test_group_norm_in_bfloat16_matches_within_bfloat16_rounding():
    norm = nn.GroupNorm(4, 16).to(torch.bfloat16)
    _compare_layers(norm, ChannelsLastGroupNorm, torch.randn(2, 16, 5, 5, dtype=torch.bfloat16), rtol=2e-2, atol=2e-2)


def test_group_norm_refuses_channels_that_groups_do_not_divide():
    with pytest.raises(ValueError, match='16 channels and 3 groups'):
        ChannelsLastGroupNorm(3, 15)(torch.randn(1, 16, 2, 2))


@pytest.mark.parametrize('affine', [True, False])
def test_instance_norm_matches(affine):
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(8, affine=affine)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    _compare_layers(norm, ChannelsLastInstanceNorm2d, torch.randn(2, 8, 7, 5) * 2 - 1)


@pytest.mark.parametrize(
    'native,replacement,shape',
    [
        (nn.InstanceNorm2d(3), ChannelsLastInstanceNorm2d, (2, 3, 1, 1)),
        (nn.InstanceNorm2d(3, affine=True), ChannelsLastInstanceNorm2d, (3, 1, 1)),  # unbatched
        (nn.GroupNorm(4, 4), ChannelsLastGroupNorm, (1, 4, 1, 1)),  # one value per group
    ],
    ids=['instance-norm', 'instance-norm-unbatched', 'group-norm'],
)
@pytest.mark.parametrize('training', [True, False])
def test_a_norm_over_one_value_fails_as_the_native_layer_does(native, replacement, shape, training):
    """torch refuses to normalise a single value (a 1x1 map in instance norm, one value per group): the
    replacement must fail there too, with torch's words, not return zeros."""
    swapped = _swapped(native, replacement)
    x = torch.randn(shape)
    with pytest.raises(ValueError) as expected:
        native.train(training)(x)
    with pytest.raises(ValueError) as actual:
        swapped.train(training)(x)
    assert str(actual.value) == str(expected.value)


def test_instance_norm_keeps_native_behaviour_outside_4d_input():
    norm = nn.InstanceNorm2d(4)
    swapped = _swapped(norm, ChannelsLastInstanceNorm2d)
    x = torch.randn(4, 5, 5)  # unbatched
    torch.testing.assert_close(swapped(x), norm(x))


@pytest.mark.parametrize(
    'kwargs',
    [
        dict(scale_factor=2),
        dict(scale_factor=4, align_corners=True),
        dict(scale_factor=(2, 3)),
        dict(size=(9, 5)),
        dict(scale_factor=1.5, recompute_scale_factor=True),
        dict(scale_factor=0.5),
    ],
)
def test_bicubic_upsample_matches(kwargs):
    _compare_layers(nn.Upsample(mode='bicubic', **kwargs), ChannelsLastBicubicUpsample, torch.randn(2, 6, 8, 7))


def test_bicubic_upsample_above_the_matrix_size_limit_uses_the_native_kernel(monkeypatch):
    monkeypatch.setattr(bicubic_module, 'MATMUL_MAX_SIZE', 6)
    up = ChannelsLastBicubicUpsample(scale_factor=2, mode='bicubic')
    x = _nhwc(1, 2, 8, 8)
    assert torch.equal(up(x), F.interpolate(x, scale_factor=2, mode='bicubic'))
    torch.testing.assert_close(bicubic_upsample_nhwc(x, scale_factor=2), up(x), rtol=1e-5, atol=1e-6)


# under autocast and in half precision: the native layer's dtype and rounding

_LOW_PRECISION_LAYERS = {
    'bicubic': (lambda: nn.Upsample(scale_factor=1.5, mode='bicubic'), ChannelsLastBicubicUpsample),
    'group_norm': (lambda: nn.GroupNorm(2, 6), ChannelsLastGroupNorm),
    'instance_norm': (lambda: nn.InstanceNorm2d(6, affine=True), ChannelsLastInstanceNorm2d),
}


def _output_and_input_grad(layer, x, autocast):
    """``layer(x)`` under autocast to ``autocast`` (None: off), and the gradient of a fixed float64 loss."""
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = layer(x)
    torch.manual_seed(2)
    (out.double() * torch.randn(out.shape, dtype=torch.float64).to(out.device)).sum().backward()
    return out, x.grad


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
@pytest.mark.parametrize('name', sorted(_LOW_PRECISION_LAYERS))
@pytest.mark.parametrize(
    'dtype,autocast',
    [
        (torch.float32, torch.bfloat16),  # after a float32 op: autocast casts matrix products, not these layers
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),  # after a convolution under autocast
        (torch.float16, torch.float16),
        (torch.bfloat16, None),  # a model in bfloat16
    ],
)
def test_under_autocast_and_in_half_precision_a_replacement_returns_and_rounds_as_the_native_layer(
    device, name, dtype, autocast
):
    """The native kernels compute half inputs in float32 and round once; autocast has no policy for these layers but
    CUDA's group norm (float32): a replacement's dtype is the native one, and its error from float64 is no larger."""
    make, replacement = _LOW_PRECISION_LAYERS[name]
    torch.manual_seed(0)
    native, x = make().to(device), torch.randn(3, 6, 9, 5, device=device)
    swapped = _swapped(native, replacement)
    exact = _output_and_input_grad(copy.deepcopy(native).double(), x.double(), None)
    if autocast is None:
        native, swapped = native.to(dtype), swapped.to(dtype)
    expected = _output_and_input_grad(native, x.to(dtype), autocast)
    actual = _output_and_input_grad(swapped, to_channels_last(x.to(dtype)), autocast)
    for what, got, want, reference in zip(('output', 'input gradient'), actual, expected, exact):
        assert got.dtype == want.dtype, f'{name}: {what} is {got.dtype}, natively {want.dtype}'
        error, native_error = ((t.double() - reference).abs().max().item() for t in (got, want))
        float32_rounding = 8 * torch.finfo(torch.float32).eps * reference.abs().max().item()  # summation order
        assert error <= 1.5 * native_error + float32_rounding, (
            f'{name}: {what} off by {error:.1e}, natively {native_error:.1e}'
        )


@pytest.mark.parametrize('name', sorted(_LOW_PRECISION_LAYERS))
def test_a_replacement_runs_on_the_meta_device_as_the_native_layer(name):
    """Shape inference and deferred initialisation run models on 'meta', which has no autocast to turn off."""
    make, replacement = _LOW_PRECISION_LAYERS[name]
    native = make().to('meta')
    swapped = _swapped(native, replacement)
    x = to_channels_last(torch.empty(3, 6, 9, 5, device='meta'))
    expected, actual = native(x), swapped(x)
    assert (actual.device, actual.shape, actual.dtype) == (expected.device, expected.shape, expected.dtype)


def test_global_pool_and_channel_interleave_match():
    x = torch.randn(2, 6, 5, 4)
    torch.testing.assert_close(global_avg_pool_nhwc(to_channels_last(x)), F.adaptive_avg_pool2d(x, 1))
    a, b = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert torch.equal(interleave_channels(a, b), channel_shuffle(torch.cat((a, b), dim=1), 2))
