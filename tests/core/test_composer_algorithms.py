"""``ChannelsLast`` beside Composer's own vision algorithms: each trains as it does alone.

Composer's recipes list ChannelsLast among algorithms that swap layers in (BlurPool, Factorize,
SqueezeExcite, StochasticDepth, GhostBatchNorm, WeightStandardization's parametrization), run extra
passes (SAM, SelectiveBackprop), keep copies of the model (EMA, SWA), reshape or mix the batch (ColOut,
CutMix, MixUp, CutOut, ProgressiveResizing), freeze layers or clip gradients. A float64 net of two bottleneck
blocks trains 4 steps with each, alone and with ChannelsLast in either mode, which Composer runs first in the
list for every other algorithm and last for the rest; every step's loss and parameters must equal the run
without it, and in mode 'on' its convolutions must be channels last.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')

import composer.algorithms as algorithms
from composer import Callback, Trainer
from composer.core import Algorithm, Event
from composer.models import ComposerClassifier
from guarded_runs import assert_same_run
from torch import nn
from torchvision.models.resnet import Bottleneck

from channels_last_algo import ChannelsLast

ALGORITHMS = {
    'blurpool': lambda: algorithms.BlurPool(replace_convs=True, replace_maxpools=True),
    'factorize': lambda: algorithms.Factorize(factorize_linears=False, min_channels=8, latent_channels=0.5),
    'squeeze_excite': lambda: algorithms.SqueezeExcite(latent_channels=8, min_channels=16),
    'stochastic_depth': lambda: algorithms.StochasticDepth('ResNetBottleneck', stochastic_method='sample'),
    'ghost_batchnorm': lambda: algorithms.GhostBatchNorm(ghost_batch_size=2),
    'weight_standardization': lambda: algorithms.WeightStandardization(),
    'sam': lambda: algorithms.SAM(rho=0.05, interval=2),
    'selective_backprop': lambda: algorithms.SelectiveBackprop(start=0, end=1, keep=0.5, interrupt=0),
    'ema': lambda: algorithms.EMA(half_life='1ba'),
    'swa': lambda: algorithms.SWA(swa_start='0.25dur', swa_end='0.75dur', swa_lr=0.01),
    'colout': lambda: algorithms.ColOut(p_row=0.15, p_col=0.15),
    'cutmix': lambda: algorithms.CutMix(alpha=1.0),
    'mixup': lambda: algorithms.MixUp(alpha=0.2),
    'cutout': lambda: algorithms.CutOut(length=0.5),
    'progressive_resizing': lambda: algorithms.ProgressiveResizing(initial_scale=0.5, size_increment=4),
    'layer_freezing': lambda: algorithms.LayerFreezing(freeze_start=0.0, freeze_level=0.5),
    'gradient_clipping': lambda: algorithms.GradientClipping(clipping_type='norm', clipping_threshold=0.1),
}


class _Float64(Algorithm):
    """Makes the model float64 at ``INIT``, after the algorithms that swap layers in (BlurPool's filter is
    made float32)."""

    def match(self, event, state) -> bool:
        return event == Event.INIT

    def apply(self, event, state, logger) -> None:
        state.model.double()


class _Steps(Callback):
    def __init__(self) -> None:
        self.steps: list = []

    def batch_end(self, state, logger) -> None:
        parameters = {name: p.detach().clone() for name, p in state.model.named_parameters()}
        self.steps.append((state.loss.detach().clone(), parameters))


def _network() -> nn.Module:
    """A stem, a max pool and two of torchvision's bottleneck blocks (the second strided), for 32-px images."""
    downsample = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
    return nn.Sequential(
        *(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)),
        *(Bottleneck(16, 4), Bottleneck(16, 8, stride=2, downsample=downsample)),
        *(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)),
    )


def _fit(algorithm: Algorithm, channels_last: ChannelsLast | None, first: bool) -> tuple[list, nn.Module]:
    """4 steps (2 epochs of 2 batches of 4 32-px images) with ``algorithm`` and, where given, ChannelsLast
    before or after it."""
    torch.manual_seed(0)
    model = ComposerClassifier(_network(), num_classes=10)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 32, 32, generator=generator, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(images, torch.randint(0, 10, (8,), generator=generator))
    listed = [algorithm, _Float64()]
    if channels_last is not None:
        listed = [channels_last, *listed] if first else [*listed, channels_last]
    steps = _Steps()
    trainer = Trainer(
        model=model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=4),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        max_duration='2ep',
        device='cpu',
        algorithms=listed,
        callbacks=[steps],
        progress_bar=False,
        seed=7,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return steps.steps, trainer.state.model


@pytest.mark.parametrize('mode', ['on', 'auto'])
@pytest.mark.parametrize('name', list(ALGORITHMS))
def test_channels_last_beside_a_composer_algorithm_trains_as_the_algorithm_alone(name, mode):
    first = list(ALGORITHMS).index(name) % 2 == 0
    expected, _ = _fit(ALGORITHMS[name](), None, first)
    steps, model = _fit(ALGORITHMS[name](), ChannelsLast(mode=mode), first)
    assert_same_run(steps, expected, f'ChannelsLast({mode!r}) {"before" if first else "after"} {name}')
    if mode == 'on':  # auto keeps the layout it timed faster, which differs between machines
        weights = [p for p in model.parameters() if p.dim() == 4 and p.shape[-1] > 1]
        assert weights and all(not w.is_contiguous() for w in weights), 'the convolutions should be channels last'
