"""What an extra pass (auto mode's trials, the repair check, a rehearsal) must leave as it found it: the random
states, and what the modules keep in attributes of their own."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from guarded_runs import Run, assert_same_run, guarded, nchw
from torch import nn

from channels_last_algo.core.saved_state import AttributeState, random_states_kept


def test_attributes_a_pass_rebinds_fills_updates_or_adds_are_put_back():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    head = net[0]
    losses, seen, total, names = [], {'steps': 0}, torch.zeros(2), {'a'}
    head.losses, head.seen, head.total, head.names, head.calls, head.hook_fn = losses, seen, total, names, 0, print
    state = AttributeState(net)
    head.losses.append(torch.ones(1))
    head.seen['steps'] += 1
    head.total += 3  # in place, as a metric's update does
    head.names.add('b')
    head.calls += 1
    head.last = torch.ones(1)  # added by the pass
    head.hook_fn = len  # a function: left as the pass set it
    state.put_back()
    assert head.losses is losses == [] and head.seen is seen == {'steps': 0} and head.names is names == {'a'}
    assert head.total is total and total.tolist() == [0.0, 0.0] and head.calls == 0
    assert not hasattr(head, 'last') and head.hook_fn is len


class _FrozenDict(dict):
    """diffusers' ``FrozenDict`` (a model's config): items set once, every change refused."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(f'{type(self).__name__} refuses changes')

    clear = update = pop = popitem = setdefault = __setitem__ = __delitem__ = _refuse


def test_a_container_the_pass_left_alone_is_not_refilled_and_one_refusing_changes_keeps_its_items():
    module = nn.Identity()
    config = _FrozenDict()
    dict.update(config, {'channels': 3, 'layers': [1, 2]})
    module.config, module.steps = config, [1, 2]
    state = AttributeState(module)
    module.steps[0] = 5  # changed in place: refilled
    state.put_back()
    assert module.config is config and config == {'channels': 3, 'layers': [1, 2]} and module.steps == [1, 2]


def test_a_large_collection_keeps_its_items_but_is_not_copied_by_value():
    module = nn.Identity()
    module.dataset = [torch.zeros(1 << 20), torch.zeros(4)]  # more elements in all than copied by value
    module.table = torch.zeros(1 << 21)
    state = AttributeState(module)
    module.dataset[1] += 1
    module.dataset.append(torch.zeros(1))
    module.table += 1
    state.put_back()
    assert len(module.dataset) == 2 and module.dataset[1].sum() == 4 and module.table.sum() == 1 << 21


def test_every_random_state_is_put_back_after_a_draw():
    with random_states_kept():
        drawn = (torch.rand(2), random.random(), np.random.rand())
    again = (torch.rand(2), random.random(), np.random.rand())
    torch.testing.assert_close(again[0], drawn[0], rtol=0, atol=0)
    assert again[1:] == drawn[1:]


class _Cached(nn.Module):
    """Registers a buffer on its first call (a cache), so the buffers after a pass are not those before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 'cache' not in self._buffers:
            self.register_buffer('cache', torch.full((x.shape[1],), 0.5))
        return x + self.cache.view(1, -1, 1, 1)


class _RebindingAverage(nn.Module):
    """Keeps a running mean by binding a new tensor to its buffer's name, as many hand-written norms do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer('mean', torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean((0, 2, 3))
        return x


def test_auto_modes_trials_put_each_buffer_back_by_where_it_is_held():
    """A buffer registered by the first trial must not shift the others (BatchNorm's statistics were written
    into each other's places), and a buffer a trial rebinds gets its object and values back."""
    from channels_last_algo.core.auto import decide_layout

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _Cached(), _RebindingAverage(), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(4, 3, 8, 8)
    average, before = model[2].mean, {k: v.clone() for k, v in model.state_dict().items()}

    def step(channels_last: bool) -> None:
        model(x.contiguous(memory_format=torch.channels_last) if channels_last else x).sum().backward()

    decide_layout(model, step, max_rounds=2, warmup=0)
    after = model.state_dict()
    assert model[2].mean is average and after.pop('1.cache').tolist() == [0.5] * 8
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)


def test_an_extra_pass_on_buffer_copies_leaves_the_buffers_a_real_pass_bound():
    """A real call rebinds its buffer after the state was saved; an extra pass runs on copies of the saved
    values and leaves the buffer the real call bound, with its values."""
    from channels_last_algo.core.saved_state import SavedState

    average, x = _RebindingAverage(), torch.ones(2, 8, 3, 3)
    before = SavedState(average)
    average(x)  # the real call
    bound = average.mean
    with before.buffer_copies():
        average(x)  # the extra pass
        assert average.mean is not bound
    assert average.mean is bound and torch.allclose(bound, torch.full((8,), 0.1))


class _EmaCodebook(nn.Module):
    """A VQ-VAE quantizer whose codebook is a frozen ``Parameter`` its training forward moves towards the codes it
    picked (an exponential moving average), with a trainable gain it clamps through ``.data``: a training pass
    writes parameters in place, which the optimizer never sees."""

    def __init__(self, codes: int, channels: int) -> None:
        super().__init__()
        self.codebook = nn.Parameter(torch.randn(codes, channels), requires_grad=False)
        self.gain = nn.Parameter(torch.ones(channels))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        picked = torch.cdist(flat, self.codebook).argmin(1)
        if self.training:
            with torch.no_grad():
                onehot = nn.functional.one_hot(picked, len(self.codebook)).to(flat.dtype)
                sums, counts = onehot.t() @ flat, onehot.sum(0)[:, None].clamp(min=1)
                self.codebook.mul_(0.9).add_(0.1 * sums / counts)
                self.gain.data.clamp_(max=0.95)
        quantized = self.codebook[picked].view(z.shape[0], z.shape[2], z.shape[3], -1).permute(0, 3, 1, 2)
        return (z + (quantized - z).detach()) * self.gain[None, :, None, None]


def _vq_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _EmaCodebook(5, 4), nn.Conv2d(4, 3, 1))


def test_auto_modes_trials_put_back_parameters_a_forward_writes_in_place():
    """The trials' training forwards move the codebook and clamp the gain; the parameters must be as found after,
    the same objects."""
    from channels_last_algo.core.auto import decide_layout

    torch.manual_seed(0)
    model, x = _vq_net(), torch.randn(2, 3, 6, 6)
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}

    def step(channels_last: bool) -> None:
        model(x.contiguous(memory_format=torch.channels_last) if channels_last else x).sum().backward()

    decide_layout(model, step, max_rounds=2, warmup=0)
    for name, p in model.named_parameters():
        assert p is params[name], name
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=name)


def test_an_extra_pass_leaving_no_trace_puts_back_the_parameters_it_wrote():
    from channels_last_algo.core.saved_state import leaving_no_trace

    torch.manual_seed(0)
    model = _vq_net()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad(), leaving_no_trace(model):
        model(torch.randn(2, 3, 6, 6))
        assert not torch.equal(model[1].codebook, before['1.codebook'])  # the pass did write it
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize('integration', ['composer', 'lightning'])
def test_auto_mode_trains_a_model_writing_its_parameters_in_its_forward_as_nchw(integration):
    """Auto mode's trials run inside the trainers' fit: a codebook they moved changed every step after (the loss
    0.04 off from the first step)."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, 3, 6, 6, dtype=torch.float64),) for _ in range(3)]
    frozen = []
    run = Run(
        build=_vq_net,
        batches=batches,
        loss=lambda output, batch: nn.functional.mse_loss(output, batch[0]),
        batch_end=lambda net, output: frozen.append(net[1].codebook.detach().clone()),
    )
    expected = nchw(run)
    expected_codebooks, frozen[:] = list(frozen), []
    steps, _, _ = guarded(run, integration, mode='auto')
    assert_same_run(steps, expected, f'{integration}, auto')
    for step, (codebook, nchw_codebook) in enumerate(zip(frozen, expected_codebooks, strict=True), 1):
        torch.testing.assert_close(codebook, nchw_codebook, rtol=1e-10, atol=1e-10, msg=f'codebook after step {step}')
