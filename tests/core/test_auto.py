"""Auto mode: the evidence rule of the layout decision, its traceless trial steps, and the
Composer integration (training in auto mode equals training in the chosen layout)."""

import copy
import functools
import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from channels_last_algo import LayoutGuard, WeightLayoutPlan, has_channels_last_strides, is_channels_last
from channels_last_algo.core import auto_mode as auto_mode_module
from channels_last_algo.core.auto import LayoutDecision, decide_layout
from channels_last_algo.core.auto_mode import Trial
from channels_last_algo.core.layers import NCHWAvgPool2d
from channels_last_algo.core.swap import SwapRow, swap_first_match
from channels_last_algo.core.timing import FakeClock


class LayoutClock:
    """A fake clock: each reading advances by the cost of the layout ``weight`` has now, so a
    step's measured time is that layout's cost and the decision is deterministic."""

    def __init__(self, weight, nchw_cost=1.0, channels_last_cost=0.5):
        self.weight, self.now = weight, 0.0
        self.costs = {False: nchw_cost, True: channels_last_cost}

    def __call__(self):
        self.now += self.costs[has_channels_last_strides(self.weight)]
        return self.now


class NoisySteps:
    """Steps that take ``cost[layout]`` seconds of a fake clock times log-normal noise, and
    ``spike`` times as long with probability ``spike_rate`` (a burst of load from other work)."""

    def __init__(self, model, channels_last_cost, sigma, spike_rate=0.0, spike=2.5, seed=0):
        self.model, self.clock, self.rng = model, FakeClock(), random.Random(seed)
        self.costs = {False: 1.0, True: channels_last_cost}
        self.sigma, self.spike_rate, self.spike = sigma, spike_rate, spike

    def __call__(self, channels_last):
        assert has_channels_last_strides(self.model[0].weight) is channels_last  # the trial's layout
        noise = math.exp(self.rng.gauss(0, self.sigma)) * (self.spike if self.rng.random() < self.spike_rate else 1)
        self.clock.advance(self.costs[channels_last] * noise)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(8, 8, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def _step(model, x):
    def run(channels_last):
        inputs = x.to(memory_format=torch.channels_last) if channels_last else x
        model(inputs).sum().backward()

    return run


@pytest.mark.parametrize('channels_last_cost,keep,tie', [(0.5, True, False), (1.5, False, False), (0.99, True, True)])
def test_constant_costs_decide_after_the_fewest_rounds_that_give_an_interval(channels_last_cost, keep, tie):
    model = _model()
    clock = LayoutClock(model[0].weight, channels_last_cost=channels_last_cost)
    decision = decide_layout(model, _step(model, torch.randn(4, 3, 8, 8)), margin=0.02, timer=clock)
    assert (decision.channels_last, decision.tie) == (keep, tie)
    assert decision.rounds == 6 and decision.stopped_by == 'evidence'  # 6: the fewest for a 95% interval
    assert has_channels_last_strides(model[0].weight) is keep
    assert decision.speedup == pytest.approx(1 / channels_last_cost)
    assert decision.interval == pytest.approx((1 / channels_last_cost,) * 2)
    assert LayoutDecision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision
    assert f'kept {"channels last" if keep else "channels first"}' in str(decision)
    assert ('the default' in str(decision)) is tie


@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('channels_last_cost,keep', [(1 / 1.41, True), (1 / 0.81, False)])
def test_a_noisy_but_clear_difference_decides(seed, channels_last_cost, keep):
    model = _model()
    steps = NoisySteps(model, channels_last_cost, sigma=0.2, spike_rate=0.15, seed=seed)
    decision = decide_layout(model, steps, max_rounds=60, max_seconds=1e9, timer=steps.clock)
    assert decision.channels_last is keep and not decision.tie and decision.stopped_by == 'evidence'
    low, high = decision.interval
    assert (low > 1.02) if keep else (high < 1 / 1.02)
    assert 6 <= decision.rounds < 60
    assert has_channels_last_strides(model[0].weight) is keep


def test_few_noisy_steps_would_have_decided_wrongly():
    """The failure the evidence rule prevents: with these spikes, the first three rounds put a
    1.41x speedup at 0.81x, as the 3-step trial of the former rule did on a loaded 2-core Xeon."""
    model = _model()
    steps = NoisySteps(model, 1 / 1.41, sigma=0.2, spike_rate=0.15, seed=7)
    decision = decide_layout(model, steps, max_rounds=60, max_seconds=1e9, timer=steps.clock)
    first_three = np.median(decision.nchw_seconds[:3]) / np.median(decision.channels_last_seconds[:3])
    assert first_three == pytest.approx(0.81, abs=0.01)
    assert 1.02 < decision.interval[0] and decision.channels_last and not decision.tie


def test_a_tie_inside_the_band_keeps_the_default_layout():
    model = _model()
    steps = NoisySteps(model, 1.0, sigma=0.002)
    decision = decide_layout(model, steps, timer=steps.clock)
    assert decision.channels_last and decision.tie and decision.stopped_by == 'evidence' and decision.rounds == 6
    assert 1 / 1.02 <= decision.interval[0] <= decision.interval[1] <= 1.02


def test_no_evidence_within_the_rounds_keeps_the_default_layout():
    model = _model()
    steps = NoisySteps(model, 1.0, sigma=0.5, seed=3)  # equal layouts, much noise: the interval straddles the band
    decision = decide_layout(model, steps, max_rounds=12, max_seconds=1e9, timer=steps.clock)
    assert decision.channels_last and decision.tie and decision.stopped_by == 'max_rounds'
    assert decision.rounds == 12 and has_channels_last_strides(model[0].weight)
    low, high = decision.interval
    assert low < 1 < high


def test_deciding_time_is_bounded():
    model = _model()
    steps = NoisySteps(model, 1.0, sigma=0.5, seed=4)
    decision = decide_layout(model, steps, max_rounds=1000, max_seconds=20, timer=steps.clock)
    longest_round = max(n + c for n, c in zip(decision.nchw_seconds, decision.channels_last_seconds))
    assert decision.stopped_by == 'max_seconds' and decision.tie and decision.channels_last
    assert 20 < decision.cost_seconds <= 20 + longest_round
    decision = decide_layout(model, steps, max_rounds=1000, max_seconds=0, timer=steps.clock)
    assert decision.rounds == 1 and decision.interval is None and decision.tie  # one round is always taken
    with pytest.raises(ValueError, match='margin'):
        decide_layout(model, steps, margin=1.5)


def test_trial_steps_leave_no_trace():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()
    optimizer.step()  # momentum state and a gradient exist
    params = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    momentum = [optimizer.state[p]['momentum_buffer'].clone() for p in model.parameters()]
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123), random.seed(123), np.random.seed(123)

    model[1].calls = 0  # a count the forward keeps in an attribute of its own (a warm-up ramp)
    model[1].register_forward_pre_hook(lambda module, args: setattr(module, 'calls', module.calls + 1))
    outputs, total = [], torch.zeros(1)  # what a step collects: a list of outputs, a metric's running total
    model[0].outputs, model[0].total = outputs, total

    def collect(module, args, output):
        module.outputs.append(output.detach())
        module.total += output.detach().sum()
        module.last = output.detach()  # an attribute the step adds

    model[0].register_forward_hook(collect)

    decision = decide_layout(model, _step(model, x), optimizers=optimizer, timer=LayoutClock(model[0].weight))

    assert decision.channels_last and decision.rounds == 6 and model[1].calls == 0
    assert model[0].outputs is outputs == [] and model[0].total is total and total.item() == 0
    assert not hasattr(model[0], 'last')
    assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected[1:]
    torch.manual_seed(123)
    torch.testing.assert_close(torch.rand(3), expected[0])
    for key, value in model.state_dict().items():  # weights and BN running stats / counts
        torch.testing.assert_close(value, params[key], rtol=0, atol=0, msg=key)
    for p, grad, buf in zip(model.parameters(), grads, momentum):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)
        torch.testing.assert_close(optimizer.state[p]['momentum_buffer'], buf, rtol=0, atol=0)
        if p.dim() == 4:  # state follows the chosen layout
            assert p.grad.stride() == p.stride() == optimizer.state[p]['momentum_buffer'].stride()


class _ShuffleNet(nn.Module):
    """A stem, two ShuffleNetV2 blocks, whose concatenate-and-shuffle the repair computes as one NHWC
    interleave (NHWC output whatever the input's layout), and an average pool."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models.shufflenetv2 import InvertedResidual

        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(InvertedResidual(16, 16, 1), InvertedResidual(16, 32, 2))
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))))


@pytest.mark.parametrize('channels_last_cost', [0.5, 2.0])
def test_the_channels_first_trials_and_layout_run_the_model_as_it_was_before_its_swaps(channels_last_cost):
    """Auto mode compares the model as mode 'off' runs it with the model as mode 'on' does: in the NCHW trials the
    swapped layers (repairs, safe paths) run as their original classes, so no activation is NHWC there (kept, the
    interleave and the CUDA average-pool safe path would make the NCHW trials channels last, timed as a tie), and the
    NCHW layout kept keeps them so; with channels last kept the swaps are in."""
    torch.manual_seed(0)
    model, x = _ShuffleNet(), torch.randn(4, 3, 8, 8)
    originals = {name: type(module) for name, module in model.named_modules()}
    cuda_safe_path = SwapRow(
        name='cuda_avg_pool', original=nn.AvgPool2d, replacement=NCHWAvgPool2d, devices=('cpu',), torch_versions=''
    )
    swap_first_match(model, [cuda_safe_path], 'safe_path', lambda row, module: True)  # NHWC out, whatever comes in
    guard = LayoutGuard(mode='auto')
    guard.on_init(model)
    assert {r.reason for r in guard.summary.repaired} == {'shufflenet_channel_shuffle', 'global_avg_pool'}
    seen = set()  # (layout timed, the classes the model has, whether a block hands NHWC on)
    for block in (*model.blocks, model.pool):
        block.register_forward_hook(
            lambda module, args, output: seen.add(
                (
                    has_channels_last_strides(model.stem.weight),
                    tuple(type(m) for m in model.modules()),
                    has_channels_last_strides(output),
                )
            )
        )
    decide = functools.partial(
        decide_layout, timer=LayoutClock(model.stem.weight, channels_last_cost=channels_last_cost)
    )
    auto_mode_module.decide_layout, original = decide, auto_mode_module.decide_layout
    try:
        guard.auto.decide(model, x, lambda m, inputs: m(inputs).sum())
    finally:
        auto_mode_module.decide_layout = original
    unrepaired = tuple(originals.values())
    assert {(layout, classes == unrepaired, nhwc) for layout, classes, nhwc in seen} == {
        (False, True, False),
        (True, False, True),
    }
    kept = {name: type(module) for name, module in model.named_modules()}
    assert (kept == originals) is (not guard.channels_last) and guard.channels_last is (channels_last_cost < 1)
    swapped = len(guard.summary.repaired) + len(guard.summary.made_safe)
    taken_back = f'swaps taken back ({swapped} layers run as their original classes)'
    assert (taken_back in str(guard.start_block)) is (not guard.channels_last)


def test_plain_loop_guard_follows_the_decision():
    model = _model()
    guard = LayoutGuard(mode='auto')
    guard.on_init(model)
    x = torch.randn(4, 3, 8, 8)
    decide = functools.partial(decide_layout, timer=LayoutClock(model[0].weight, channels_last_cost=2.0))
    auto_mode_module.decide_layout, original = decide, auto_mode_module.decide_layout
    try:
        guard.auto.decide(model, x, lambda m, inputs: m(inputs).sum())
    finally:
        auto_mode_module.decide_layout = original
    assert not guard.channels_last and guard.on_batch(x) is x
    assert not has_channels_last_strides(model[0].weight)
    with pytest.raises(RuntimeError, match="mode='auto'"):
        LayoutGuard().auto.decide(model, x, lambda m, inputs: m(inputs).sum())


def test_repr_shows_the_mode_asked_for_and_effective_mode_the_one_acted_in():
    model = _model()
    guard = LayoutGuard(mode='auto')
    guard.on_init(model)
    guard.auto.decide(model, torch.randn(4, 3, 8, 8), lambda m, inputs: m(inputs).sum(), max_rounds=2, warmup=0)
    assert repr(guard) == "LayoutGuard(mode='auto', audit_steps=0, strict=False)"
    assert guard.effective_mode == 'auto' and guard.auto.decision is not None
    contiguous = LayoutGuard(mode='auto')  # weights that must stay contiguous: nothing to time, it acts as 'on'
    contiguous.on_init(_model(), weight_layout=WeightLayoutPlan(contiguous=True, reason='tensor parallel'))
    assert contiguous.mode == 'auto' and contiguous.effective_mode == 'on' and contiguous.channels_last
    assert repr(contiguous) == "LayoutGuard(mode='auto', audit_steps=0, strict=False)"
    with pytest.raises(RuntimeError, match='does not act in auto mode'):
        contiguous.auto.decide(model, torch.randn(4, 3, 8, 8), lambda m, inputs: m(inputs).sum())


def _trainer(mode, place='algorithms', **options):
    """A Composer Trainer of a small classifier with ``ChannelsLast(mode=mode)`` in its ``place`` (its
    algorithms or its callbacks)."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from channels_last_algo import ChannelsLast

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(12, 3, 8, 8, generator=generator), torch.randint(0, 10, (12,), generator=generator)
    )
    algorithm = ChannelsLast(mode=mode)
    trainer = Trainer(
        model=ComposerClassifier(_model(), num_classes=10),
        train_dataloader=DataLoader(data, batch_size=4),
        max_duration='3ba',
        device='cpu',
        **{place: [algorithm]},
        seed=7,
        progress_bar=False,
        optimizers=None,
        **options,
    )
    return trainer, algorithm


def _decide_with_costs(channels_last_cost):
    def decide(model, run_step, **options):
        weight = next(p for p in model.parameters() if p.dim() == 4)
        return decide_layout(
            model, run_step, timer=LayoutClock(weight, channels_last_cost=channels_last_cost), **options
        )

    return decide


@pytest.mark.parametrize('channels_last_cost', [0.5, 2.0])
def test_composer_auto_trains_exactly_as_the_chosen_layout_from_the_start(monkeypatch, channels_last_cost):
    pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')
    monkeypatch.setattr(auto_mode_module, 'decide_layout', _decide_with_costs(channels_last_cost))
    auto, algorithm = _trainer('auto')
    auto.fit()
    chosen = algorithm.decision.channels_last
    assert chosen is (channels_last_cost < 1) and not algorithm.decision.tie
    reference, _ = _trainer('on' if chosen else 'off')
    reference.fit()
    for (name, a), b in zip(reference.state.model.named_parameters(), auto.state.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        if a.dim() == 4:
            assert has_channels_last_strides(b) is chosen


def test_composer_repr_and_checkpoint_show_mode_auto_after_the_decision(monkeypatch):
    pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')
    monkeypatch.setattr(auto_mode_module, 'decide_layout', _decide_with_costs(2.0))
    trainer, algorithm = _trainer('auto')
    trainer.fit()
    assert algorithm.decision is not None and not algorithm.decision.channels_last
    assert repr(algorithm) == "ChannelsLast(mode='auto', audit_steps=0, strict=False)"
    assert algorithm.state_dict() == {'repr': repr(algorithm), 'decision': algorithm.decision.to_dict()}


@pytest.mark.parametrize('place', ['algorithms', 'callbacks'])
def test_resumed_run_keeps_the_decision_without_measuring(place, monkeypatch, tmp_path):
    pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')
    monkeypatch.setattr(auto_mode_module, 'decide_layout', _decide_with_costs(2.0))
    first, algorithm = _trainer('auto', place, save_folder=str(tmp_path), save_interval='3ba')
    first.fit()
    decided = algorithm.decision
    assert decided.channels_last is False and decided.interval is not None

    def must_not_measure(*args, **kwargs):
        raise AssertionError('a resumed run measured again')

    monkeypatch.setattr(auto_mode_module, 'decide_layout', must_not_measure)
    resumed, algorithm = _trainer('auto', place, load_path=str(tmp_path / 'ep0-ba3-rank0.pt'))
    assert algorithm.decision == decided  # the interval and the rounds come back with the layout
    assert not has_channels_last_strides(resumed.state.model.module[0].weight)
    assert type(resumed.state.model.module[5]) is nn.AdaptiveAvgPool2d  # NCHW as the model was: no repair


class _WeightViewingNet(torch.nn.Module):
    """A convolution whose forward views its own weight (a per-filter norm), which NHWC strides refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.conv.weight.view(4, -1)
        weight = (flat / flat.norm(dim=1, keepdim=True)).view_as(self.conv.weight)
        return torch.nn.functional.conv2d(x, weight, self.conv.bias)


def test_a_trial_that_finds_the_weights_viewed_stops_timing_and_every_rank_keeps_them_contiguous():
    """Rank 0's trial finds the weight viewed: the weights go contiguous, nothing is decided, the run acts as
    mode 'on'; the other ranks, which time nothing, take the same outcome from the broadcast."""
    x = torch.randn(2, 3, 8, 8)
    trial = lambda: Trial(lambda: x, lambda m, batch: m(batch).sum())  # noqa: E731
    sent = []
    rank_0, model_0 = LayoutGuard(mode='auto'), _WeightViewingNet()
    rank_0.on_init(model_0)
    rank_0.auto.settle(model_0, trial, rank=0, world_size=2, broadcast=lambda obj: sent.append(obj) or obj)
    assert rank_0.auto.decision is None and rank_0.effective_mode == 'on' and rank_0.weight_layout.contiguous
    assert model_0.conv.weight.is_contiguous() and 'viewed' in sent[0]['stood_down']
    rank_1, model_1 = LayoutGuard(mode='auto'), _WeightViewingNet()
    rank_1.on_init(model_1)
    assert has_channels_last_strides(model_1.conv.weight)
    rank_1.auto.settle(model_1, trial, rank=1, world_size=2, broadcast=lambda obj: sent[0])
    assert rank_1.effective_mode == 'on' and rank_1.weight_layout.contiguous and model_1.conv.weight.is_contiguous()


def test_a_step_that_raises_before_training_leaves_the_run_channels_last_on_every_rank(caplog):
    """A step that cannot run before training (it reads what only the loop sets up) is not timed: rank 0 says
    why and acts as mode 'on', channels last, even where the channels-first trial raised; the other ranks follow."""

    def loss_fn(model, batch):
        if not has_channels_last_strides(model[0].weight):
            raise AttributeError("'list' object has no attribute 'param_groups'")
        return model(batch).sum()

    x = torch.randn(2, 3, 8, 8)
    sent = []
    rank_0, model_0 = LayoutGuard(mode='auto'), _model()
    rank_0.on_init(model_0)
    rank_0.auto.settle(
        model_0, lambda: Trial(lambda: x, loss_fn), world_size=2, broadcast=lambda o: sent.append(o) or o
    )
    assert rank_0.auto.decision is None and rank_0.effective_mode == 'on' and rank_0.channels_last
    assert has_channels_last_strides(model_0[0].weight) and 'param_groups' in sent[0]['untimed']
    assert type(model_0[5]).__name__ == 'ChannelsLastAdaptiveAvgPool2d'  # the swap, taken back for NCHW, is in again
    assert any('param_groups' in r.getMessage() and "acts as mode 'on'" in r.getMessage() for r in caplog.records)
    rank_1, model_1 = LayoutGuard(mode='auto'), _model()
    rank_1.on_init(model_1)
    rank_1.auto.settle(model_1, lambda: Trial(lambda: x, loss_fn), rank=1, world_size=2, broadcast=lambda o: sent[0])
    assert rank_1.effective_mode == 'on' and has_channels_last_strides(model_1[0].weight)


def test_composer_auto_deciding_at_fit_start_keeps_the_runs_data_order_and_draws(monkeypatch):
    """With the train dataloader given to ``fit``, auto mode draws its trial batch at FIT_START: a fresh iterator
    of a shuffled loader draws its seeds, which must not move the run's data order or its dropout masks."""
    pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from channels_last_algo import ChannelsLast

    monkeypatch.setattr(auto_mode_module, 'decide_layout', _decide_with_costs(0.5))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(24, 3, 8, 8, generator=generator), torch.randint(0, 10, (24,), generator=generator)
    )
    runs = {}
    for mode in ('on', 'auto'):
        algorithm = ChannelsLast(mode=mode)
        trainer = Trainer(
            model=ComposerClassifier(_model(), num_classes=10),
            max_duration='4ba',
            device='cpu',
            algorithms=[algorithm],
            seed=7,
            progress_bar=False,
        )
        trainer.fit(train_dataloader=DataLoader(data, batch_size=4, shuffle=True))
        runs[mode] = list(trainer.state.model.parameters())
    assert algorithm.decision is not None and algorithm.decision.channels_last
    for a, b in zip(runs['on'], runs['auto']):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_composer_auto_times_one_microbatch_where_composer_splits_the_batch(monkeypatch):
    """With ``device_train_microbatch_size`` set, a step of the whole batch may not fit on the device: the trial
    steps run the first microbatch, as the training steps do, and the run trains as the chosen layout's."""
    pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from channels_last_algo import ChannelsLast

    monkeypatch.setattr(auto_mode_module, 'decide_layout', _decide_with_costs(0.5))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(12, 3, 8, 8, generator=generator), torch.randint(0, 10, (12,), generator=generator)
    )
    runs, seen = {}, []
    for mode in ('on', 'auto'):
        model, algorithm = _model(), ChannelsLast(mode=mode)
        model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
        trainer = Trainer(
            model=ComposerClassifier(model, num_classes=10),
            train_dataloader=DataLoader(data, batch_size=4),
            device_train_microbatch_size=2,
            max_duration='3ba',
            device='cpu',
            algorithms=[algorithm],
            seed=7,
            progress_bar=False,
        )
        trainer.fit()
        runs[mode] = list(trainer.state.model.parameters())
    assert algorithm.decision is not None and set(seen) == {2}
    for a, b in zip(runs['on'], runs['auto']):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_the_first_microbatch_slices_what_has_the_images_sample_count():
    pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')
    from channels_last_algo.integrations.composer import _first_microbatch

    batch = {'images': torch.zeros(4, 3, 2, 2), 'labels': torch.arange(4), 'scale': torch.ones(3), 'name': 'b'}
    first = _first_microbatch(batch, 2)
    assert first['images'].shape[0] == 2 and first['labels'].tolist() == [0, 1]
    assert first['scale'] is batch['scale'] and first['name'] == 'b'
    assert _first_microbatch(batch, 4) is batch and _first_microbatch(batch, 'auto') is batch
    assert _first_microbatch((torch.arange(4),), 2)[0].tolist() == [0, 1, 2, 3]  # no images: as it came


def test_every_trial_step_gets_its_batch_in_the_layout_it_times(monkeypatch):
    """The first trial step also finds the batch's images: it takes them in the layout its weights have, so the
    warm-up runs each layout as the timed rounds do (a compiled model is not traced again in a timed round)."""
    model = _model()
    guard = LayoutGuard(mode='auto')
    guard.on_init(model)
    seen = []
    model.register_forward_pre_hook(
        lambda module, args: seen.append((is_channels_last(args[0]), has_channels_last_strides(module[0].weight)))
    )
    timer = LayoutClock(model[0].weight)
    monkeypatch.setattr(auto_mode_module, 'decide_layout', functools.partial(decide_layout, timer=timer))
    guard.auto.decide(model, torch.randn(4, 3, 8, 8), lambda m, x: m(x).sum())
    assert len(seen) >= 4 and all(images == weights for images, weights in seen), seen
