"""Random numbers drawn as in NCHW: a dropout of tokens flattened from a map (a DETR encoder's input, contiguous
here and transposed in NCHW), through ``F.dropout`` and through ``nn.Dropout``; Gaussian noise from
``torch.randn_like`` of an activation; a DropBlock-style mask from ``torch.empty_like(z).bernoulli_()``; noise
added to the batch itself, in the model or in the step's code (that batch tensor is then left as it comes), and to
what a functional convolution makes of it; noise for a map that is channels last in NCHW too; and a dropout
after a 1x1 convolution of a contiguous map. torch's CPU generators fill memory in its order, so each draws other
numbers onto NHWC's elements than onto NCHW's for the same seed. Each model trains 3 float64 steps through every
integration, every step equal to the NCHW run's."""

from __future__ import annotations

import logging

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, classification_batches, guarded, nchw
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.layers.safe_paths import NCHWMaskDropout


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return classification_batches(classes=5, seed=3)


class _Convolved(nn.Module):
    """Seeds the global generator at each forward call (the trainers draw from it themselves between steps),
    so that every run draws the same numbers and only where they fall can differ."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.project = nn.Conv2d(6, 8, 1)
        self.head = nn.Linear(8, 5)
        self.calls = 0
        self.register_forward_pre_hook(self._seeded)

    @staticmethod
    def _seeded(module, args):
        module.calls += 1
        torch.manual_seed(module.calls)


class TokensDropped(_Convolved):
    """Tokens ``z.flatten(2).permute(0, 2, 1)`` dropped by ``F.dropout`` (as DETR's encoder does) and by an
    ``nn.Dropout``, then mixed by a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.3)
        self.mix = nn.Linear(8, 8)

    def forward(self, x):
        tokens = self.project(F.relu(self.stem(x))).flatten(2).permute(0, 2, 1)
        tokens = self.mix(F.dropout(tokens, 0.4, self.training)) + self.dropout(tokens)
        return self.head(tokens.mean(1))


class Noised(_Convolved):
    """Gaussian noise from ``torch.randn_like`` of an activation, and a DropBlock-style mask drawn in place into
    ``torch.empty_like`` of another."""

    def forward(self, x):
        z = F.relu(self.stem(x))
        z = z + 0.3 * torch.randn_like(z)
        y = self.project(z)
        mask = torch.empty_like(y).bernoulli_(0.7)
        return self.head((y * mask).mean((2, 3)))


class Plain(_Convolved):
    """No random numbers of its own."""

    def forward(self, x):
        return self.head(self.project(F.relu(self.stem(x))).mean((2, 3)))


class BatchNoised(Plain):
    """Noise drawn for the batch itself (``x + torch.randn_like(x)``), which no module makes."""

    def forward(self, x):
        return super().forward(x + 0.5 * torch.randn_like(x))


class ConvolvedThenNoised(_Convolved):
    """Noise for what a functional convolution makes of the batch (``F.conv2d(x, weight)``), no module's output:
    its channels-last weight lays it out NHWC whatever the batch's layout."""

    def forward(self, x):
        z = F.conv2d(x, self.stem.weight, self.stem.bias, padding=1)
        z = z + 0.5 * torch.randn_like(z)
        return self.head(self.project(F.relu(z)).mean((2, 3)))


def _noised_in_the_step(net: nn.Module, batch: tuple) -> torch.Tensor:
    """A diffusion-style step: noise drawn for the batch in the training step's own code, outside the model."""
    torch.manual_seed(int(batch[1].sum()))
    images = batch[0]
    return net(images + 0.5 * torch.randn_like(images))


class AttendedAndNoised(_Convolved):
    """Noise drawn for a map that is channels last in NCHW too: attention over the tokens of a contiguous map,
    transposed back to (n, c, h, w) and group-normed (as a diffusers VAE's mid block), then
    ``torch.randn_like`` of it. NCHW draws in NHWC order there, and so must the package."""

    def __init__(self) -> None:
        super().__init__()
        self.attend = nn.Linear(6, 6)
        self.norm = nn.GroupNorm(2, 6)

    def forward(self, x):
        z = F.relu(self.stem(x)).contiguous()
        n, c, h, w = z.shape
        tokens = self.attend(z.flatten(2).transpose(1, 2))
        y = self.norm(tokens.transpose(1, 2).reshape(n, c, h, w))
        y = y + 0.3 * torch.randn_like(y)
        return self.head(self.project(y).mean((2, 3)))


class ProjectedAndDropped(_Convolved):
    """A 1x1 convolution of a contiguous map (an ASPP's projection of its pyramid), dropped: NCHW's output is
    contiguous, the channels-last kernel's NHWC."""

    def forward(self, x):
        y = self.project(F.relu(self.stem(x)).contiguous())
        return self.head(F.dropout(y, 0.3, self.training).mean((2, 3)))


def _cross_entropy(output, batch):
    return F.cross_entropy(output, batch[1])


RUNS = {
    'tokens-dropped': Run(TokensDropped, _batches(), _cross_entropy),
    'noised': Run(Noised, _batches(), _cross_entropy),
    'batch-noised': Run(BatchNoised, _batches(), _cross_entropy),
    'batch-noised-in-the-step': Run(Plain, _batches(), _cross_entropy, forward=_noised_in_the_step),
    'convolved-then-noised': Run(ConvolvedThenNoised, _batches(), _cross_entropy),
    'attended-and-noised': Run(AttendedAndNoised, _batches(), _cross_entropy),
    'projected-and-dropped': Run(ProjectedAndDropped, _batches(), _cross_entropy),
}


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('name', list(RUNS))
def test_random_numbers_fall_as_in_nchw(name, integration):
    """No step differs from the NCHW run's, the stem stays channels last, and the dropout layer draws its noise
    in the order of NCHW's transposed tokens."""
    run = RUNS[name]
    steps, net, _ = guarded(run, integration, audit_steps=1)
    assert_same_run(steps, nchw(run), f'{name} through {integration}')
    assert not net.stem.weight.is_contiguous(), 'the stem should stay channels last'
    if isinstance(getattr(net, 'dropout', None), NCHWMaskDropout):
        assert net.dropout.noise_order == (0, 2, 1)


@pytest.mark.parametrize('name', ['batch-noised', 'batch-noised-in-the-step'])
def test_a_batch_given_random_numbers_is_left_as_it_comes(name, caplog):
    """Noise drawn like a batch tensor the guard made NHWC, in the model or in the step's code, falls as in NCHW
    on the first step; from the next batch on that tensor is left as it comes, so no step after is watched."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, _, guard = guarded(RUNS[name], 'guard', audit_steps=1)
    said = [r.getMessage() for r in caplog.records]
    left = [line for line in said if 'left as it comes' in line]
    assert len(left) == 1, said
    assert left[0].startswith('channels last: batch[0] left as it comes from the next batch on (given random numbers')
    assert 'by randn_like at ' in left[0] and 'test_random_draws.py:' in left[0], left
    assert not any('every step' in line for line in said), said
    assert guard.on_batch(_batches()[0])[0].is_contiguous()
