"""Auto mode: the layout decision, its traceless trial steps, and Composer integration."""

import copy
import functools
import itertools
import random

import numpy as np
import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import ChannelsLast, LayoutGuard, has_channels_last_strides
from channels_last_algo.core import guard as guard_module
from channels_last_algo.core.auto import LayoutDecision, decide_layout


class LayoutClock:
    """A fake clock: each reading advances by the cost of the layout ``weight`` has now, so a
    step's measured time is that layout's cost and the decision is deterministic."""

    def __init__(self, weight, nchw_cost=1.0, channels_last_cost=0.5):
        self.weight, self.now = weight, 0.0
        self.costs = {False: nchw_cost, True: channels_last_cost}

    def __call__(self):
        self.now += self.costs[has_channels_last_strides(self.weight)]
        return self.now


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                         nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _step(model, x):
    def run(channels_last):
        inputs = x.to(memory_format=torch.channels_last) if channels_last else x
        model(inputs).sum().backward()
    return run


@pytest.mark.parametrize('channels_last_cost,keep', [(0.5, True), (1.5, False), (0.99, False)])
def test_decision_keeps_channels_last_only_when_faster_by_the_margin(channels_last_cost, keep):
    model = _model()
    clock = LayoutClock(model[0].weight, channels_last_cost=channels_last_cost)
    decision = decide_layout(model, _step(model, torch.randn(4, 3, 8, 8)), steps=3, margin=0.02, timer=clock)
    assert decision.channels_last is keep and decision.steps == 3
    assert has_channels_last_strides(model[0].weight) is keep
    assert decision.speedup == pytest.approx(1 / channels_last_cost)
    assert LayoutDecision.from_dict(decision.to_dict()) == decision
    assert ('kept channels last' if keep else 'kept NCHW') in str(decision)


def test_trial_steps_leave_no_trace():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()
    optimizer.step()                                       # momentum state and a gradient exist
    params = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    momentum = [optimizer.state[p]['momentum_buffer'].clone() for p in model.parameters()]
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123), random.seed(123), np.random.seed(123)

    decide_layout(model, _step(model, x), optimizers=optimizer, steps=2, timer=LayoutClock(model[0].weight))

    assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected[1:]
    torch.manual_seed(123)
    torch.testing.assert_close(torch.rand(3), expected[0])
    for key, value in model.state_dict().items():      # weights and BN running stats / counts
        torch.testing.assert_close(value, params[key], rtol=0, atol=0, msg=key)
    for p, grad, buf in zip(model.parameters(), grads, momentum):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)
        torch.testing.assert_close(optimizer.state[p]['momentum_buffer'], buf, rtol=0, atol=0)
        if p.dim() == 4:                               # state follows the chosen layout
            assert p.grad.stride() == p.stride() == optimizer.state[p]['momentum_buffer'].stride()


def test_deciding_time_is_bounded():
    model = _model()
    clock = LayoutClock(model[0].weight, nchw_cost=100.0, channels_last_cost=50.0)
    decision = decide_layout(model, _step(model, torch.randn(2, 3, 8, 8)), steps=10, max_seconds=150, timer=clock)
    assert decision.steps == 1 and decision.cost_seconds > 0
    with pytest.raises(ValueError, match='margin'):
        decide_layout(model, _step(model, torch.randn(2, 3, 8, 8)), margin=1.5)


def test_plain_loop_guard_follows_the_decision():
    model = _model()
    guard = LayoutGuard(mode='auto')
    guard.on_init(model)
    x = torch.randn(4, 3, 8, 8)
    decide = functools.partial(decide_layout, timer=LayoutClock(model[0].weight, channels_last_cost=2.0))
    guard_module.decide_layout, original = decide, guard_module.decide_layout
    try:
        guard.decide(model, x, lambda m, inputs: m(inputs).sum())
    finally:
        guard_module.decide_layout = original
    assert not guard.channels_last and guard.on_batch(x) is x
    assert not has_channels_last_strides(model[0].weight)
    with pytest.raises(RuntimeError, match="mode='auto'"):
        LayoutGuard().decide(model, x, lambda m, inputs: m(inputs).sum())


def _trainer(mode, **options):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(12, 3, 8, 8, generator=generator), torch.randint(0, 10, (12,), generator=generator))
    algorithm = ChannelsLast(mode=mode)
    trainer = Trainer(model=ComposerClassifier(_model(), num_classes=10), train_dataloader=DataLoader(data, batch_size=4),
                      max_duration='3ba', device='cpu', algorithms=[algorithm], seed=7, progress_bar=False,
                      optimizers=None, **options)
    return trainer, algorithm


@pytest.mark.parametrize('channels_last_cost', [0.5, 2.0])
def test_composer_auto_trains_exactly_as_the_chosen_layout_from_the_start(monkeypatch, channels_last_cost):
    def fake_decide(model, run_step, **options):
        weight = next(p for p in model.parameters() if p.dim() == 4)
        return decide_layout(model, run_step, timer=LayoutClock(weight, channels_last_cost=channels_last_cost), **options)

    monkeypatch.setattr(guard_module, 'decide_layout', fake_decide)
    auto, algorithm = _trainer('auto')
    auto.fit()
    chosen = algorithm.decision.channels_last
    assert chosen is (channels_last_cost < 1)
    reference, _ = _trainer('on' if chosen else 'off')
    reference.fit()
    for (name, a), b in zip(reference.state.model.named_parameters(), auto.state.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        if a.dim() == 4:
            assert has_channels_last_strides(b) is chosen


def test_resumed_run_keeps_the_decision_without_measuring(monkeypatch, tmp_path):
    monkeypatch.setattr(guard_module, 'decide_layout', functools.partial(
        decide_layout, timer=itertools.count().__next__))  # every step takes 1: a tie keeps NCHW
    first, algorithm = _trainer('auto', save_folder=str(tmp_path), save_interval='3ba')
    first.fit()
    assert algorithm.decision.channels_last is False

    def must_not_measure(*args, **kwargs):
        raise AssertionError('a resumed run measured again')

    monkeypatch.setattr(guard_module, 'decide_layout', must_not_measure)
    resumed, algorithm = _trainer('auto', load_path=str(tmp_path / 'ep0-ba3-rank0.pt'))
    assert algorithm.decision is not None and algorithm.decision.channels_last is False
    assert not has_channels_last_strides(resumed.state.model.module[0].weight)
