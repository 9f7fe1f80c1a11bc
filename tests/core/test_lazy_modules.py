"""Lazy modules (``LazyConv2d``, ``LazyBatchNorm2d``, ``LazyLinear``) take their shapes in the first watched step:
their initialization passes the watches untouched, and auto mode, which has no step to time before it, says so and
trains channels last."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn

from channels_last_algo.core.auto_mode import AutoMode


class _LazyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.LazyConv2d(8, 3, padding=1)
        self.norm = nn.LazyBatchNorm2d()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.LazyLinear(5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.conv(F.relu(self.norm(self.stem(images))))
        return self.head(features.view(features.size(0), -1))  # a view NHWC strides refuse


def _run() -> Run:
    generator = torch.Generator().manual_seed(5)
    batches = [
        (
            torch.rand(2, 3, 8, 8, generator=generator, dtype=torch.float64),
            torch.randint(0, 5, (2,), generator=generator),
        )
        for _ in range(3)
    ]
    return Run(build=_LazyNet, batches=batches, loss=lambda output, batch: F.cross_entropy(output, batch[1]))


@pytest.mark.parametrize('options', [{}, {'audit_steps': 2}], ids=['default', 'audit'])
def test_a_model_with_lazy_modules_trains_through_the_guard_as_in_nchw(options):
    run = _run()
    steps, net, _ = guarded(run, 'guard', **options)
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert_same_run(steps, nchw(run), f'guard {options}')


@pytest.mark.parametrize('integration', INTEGRATIONS)
def test_auto_mode_on_a_model_with_lazy_modules_says_why_it_does_not_time_and_trains_channels_last(integration, caplog):
    run = _run()
    with caplog.at_level(logging.WARNING, logger='channels_last_algo'):
        steps, net, _ = guarded(run, integration, mode='auto')
    assert len(steps) == len(run.batches)
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    if integration != 'guard':  # the trainers settle the layout at the start; a plain loop asks decide()
        assert 'stem.weight is a lazy parameter without a shape yet' in caplog.text
    if integration != 'composer':  # Composer seeds each run anew, and the lazy modules draw their first weights
        assert_same_run(steps, guarded(run, integration, mode='off')[0], f'{integration} auto')


def test_deciding_on_a_model_with_lazy_modules_names_the_parameter():
    auto = AutoMode(True, lambda model, batch, loss_fn, channels_last: None)
    with pytest.raises(ValueError, match=r'_LazyNet\.stem\.weight is a lazy parameter without a shape yet'):
        auto.decide(_LazyNet(), torch.rand(2, 3, 8, 8), lambda model, batch: model(batch).sum())
