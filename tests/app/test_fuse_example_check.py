"""The example check of a fused copy where rounding decides the output: a threshold, top-k or NMS turns a
float32 rounding difference into another box. Right copies pass (in float64, or by their modules where
exact ties decide the model's own output); wrong ones do not."""

import copy

import pytest
import torch
from torch import nn

from channels_last_algo import fuse_for_inference
from channels_last_algo.core.fuse.example_check import ExampleCheck, max_relative_error


class _KeepsAboveHalf(nn.Module):
    """Keeps the scores above one half: a score of exactly one half (a zero input) is decided by rounding."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.Sigmoid())

    def forward(self, x):
        scores = self.body(x)
        return scores * (scores > 0.5)


def _example():
    x = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    x[..., :3] = 0.0  # scores of exactly 0.5 there
    return x


def _shifted(model, shift):
    """``model`` with ``shift`` added to its convolution's output (a bias)."""
    conv = model.body[0]
    conv.bias = nn.Parameter(torch.full((conv.out_channels,), shift, dtype=conv.weight.dtype))
    return model


@pytest.mark.parametrize(
    'shift, in_float64, by_module, right',
    [(1e-6, 1e-13, True, True), (1e-6, 1e-13, False, False), (1e-2, 1e-2, True, False)],
    ids=['rounding, by module', 'rounding, as a whole', 'wrong'],
)
def test_where_exact_ties_decide_the_output_the_modules_before_them_are_compared(shift, in_float64, by_module, right):
    """A float32 copy ``shift`` off the model, whose float64 copy is ``in_float64`` off: rounding, or wrong."""
    model = _KeepsAboveHalf().eval()
    check = ExampleCheck(model, _example(), 'eager', rtol=1e-4)
    fused = _shifted(copy.deepcopy(model), shift)
    with torch.no_grad():
        assert max_relative_error(fused(_example()), model(_example())) > 0.1  # the whole output differs
    error = check.mismatch(fused, lambda float64_model: _shifted(float64_model, in_float64), by_module=by_module)
    assert (error is None) == right


def test_where_the_output_does_not_move_a_difference_is_the_copys():
    model = _KeepsAboveHalf().eval()
    x = torch.randn(1, 3, 6, 6)  # no exact ties: the output is continuous here
    check = ExampleCheck(model, x, 'eager', rtol=1e-4)
    assert check.mismatch(_shifted(copy.deepcopy(model), 1e-2), lambda m: _shifted(m, 1e-2), by_module=True) > 1e-3


def test_a_detector_with_tied_scores_fuses():
    """Random weights score many anchors alike: the boxes kept differ with any rounding."""
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    torch.manual_seed(0)
    model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3).eval()
    images = [torch.rand(3, 96, 128, generator=torch.Generator().manual_seed(1))]
    fused = fuse_for_inference(model, (images,))
    assert fused.summary.unfused == [] and fused.summary.count('bn') > 50
    features = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        expected = model.backbone(features)
        actual = fused.module.backbone(features.contiguous(memory_format=torch.channels_last))
    assert max_relative_error(actual, expected) < 1e-5


def test_outputs_of_no_boxes_and_of_other_counts_compare():
    none, two, three = torch.zeros(0, 4), torch.ones(2, 4), torch.ones(3, 4)
    assert max_relative_error({'boxes': none}, {'boxes': torch.zeros(0, 4)}) == 0.0
    assert max_relative_error([two], [three]) == float('inf') == max_relative_error([two], [two, two])
    assert (
        max_relative_error(
            two.flip(0) * torch.tensor([1.0, 2.0]).view(2, 1), two * torch.tensor([2.0, 1.0]).view(2, 1), any_order=True
        )
        == 0.0
    )


class _ChecksItsConvolution(nn.Module):
    """Checks its convolution's class in a forward fx cannot trace (it decides on values)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if not isinstance(self.conv, nn.Conv2d):
            raise TypeError(f'conv must be an nn.Conv2d, got {type(self.conv).__name__}')
        y = self.conv(x)
        return y if y.sum() > -1e9 else -y


def test_a_copy_that_fails_on_the_example_is_refused_in_one_line_naming_the_model():
    with pytest.raises(
        RuntimeError, match=r'^the fused copy of _ChecksItsConvolution fails on the example input \('
    ) as raised:
        fuse_for_inference(_ChecksItsConvolution().eval(), torch.randn(1, 3, 8, 8))
    assert 'TypeError: conv must be an nn.Conv2d, got FusedConv2d' in str(raised.value)


class _CountsItsCalls(nn.Module):
    """A forward that counts its calls in an attribute of its own."""

    def __init__(self):
        super().__init__()
        self.body, self.calls = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), 0

    def forward(self, x):
        self.calls += 1
        return self.body(x)


def test_the_example_check_leaves_the_count_the_models_forward_keeps_as_it_was():
    """The check calls the model once more, on the example: what its forward counts is put back after."""
    model = _CountsItsCalls().eval()
    fuse_for_inference(model, torch.randn(1, 3, 8, 8))
    assert model.calls == 0
