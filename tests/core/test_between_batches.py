"""Code between training batches that views NHWC tensors trains as in NCHW.

A pruning pass (``torch.nn.utils.prune``: ``torch.abs(weight).view(-1)``), a max-norm constraint
through ``weight.data.view(n, -1)`` or ``weight.reshape(n, -1)`` (a copy of an NHWC weight, whose writes
were lost) after the optimizer step, a write through a reshape NCHW copies and NHWC views, ``parameters_to_vector`` /
``vector_to_parameters``, a read of the step's output through ``.view(-1)`` and a write through a
view of an NHWC buffer: each raised "view size is not compatible" under channels last, where NCHW
runs. A random pruning ranks ``torch.rand_like(weight)``, which an NHWC weight draws in another order. Each
trains 3 float64 steps through LayoutGuard, the Composer algorithm and the Lightning
callback, with the code run at every batch's end, equal to the NCHW run on every step.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, prune, vector_to_parameters

from channels_last_algo.core.between_batches import BetweenBatches
from channels_last_algo.core.guard import LayoutGuard
from conftest import lightning_trainer


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


class WithMemory(nn.Module):
    """A running map of the first convolution's outputs (NHWC under channels last), added to them in the
    next forward; code between batches clears part of it through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.register_buffer('memory', torch.zeros(1, 8, 8, 8))

    def forward(self, x):
        z = self.net[1](self.net[0](x)) + self.memory
        self.memory = 0.5 * (z.detach()[:1] + self.memory)
        return self.net[6](self.net[5](self.net[4](self.net[3](self.net[2](z)))))


def _batches(n: int = 3) -> list[tuple]:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(2, 3, 8, 8, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (2,), generator=generator),
        )
        for _ in range(n)
    ]


def _cross_entropy(output, batch):
    return F.cross_entropy(output, batch[1])


def _pruned(net, output) -> None:
    prune.l1_unstructured(net[2], 'weight', amount=0.2)


def _pruned_at_random(net, output) -> None:
    """``prune.random_unstructured`` ranks ``torch.rand_like(weight)``, drawn in memory order: seeded here, since the
    trainers draw from the generator between steps."""
    torch.manual_seed(5)
    prune.random_unstructured(net[0], 'weight', amount=0.3)


def _pruned_globally(net, output) -> None:
    prune.global_unstructured([(net[0], 'weight'), (net[2], 'weight')], prune.L1Unstructured, amount=0.2)


def _max_normed(net, output) -> None:
    with torch.no_grad():
        for conv in (net[0], net[2]):
            rows = conv.weight.data.view(len(conv.weight), -1)
            rows.mul_((0.5 / rows.norm(dim=1, keepdim=True)).clamp(max=1.0))


def _max_normed_through_reshapes(net, output) -> None:
    """The same through ``weight.reshape(n, -1)`` under ``no_grad``, a view in NCHW (a copy of an NHWC weight)."""
    with torch.no_grad():
        for conv in (net[0], net[2]):
            rows = conv.weight.reshape(len(conv.weight), -1)
            rows.mul_((0.5 / rows.norm(dim=1, keepdim=True)).clamp(max=1.0))


def _rows_of_filters_scaled(net, output) -> None:
    """Scales each filter's first row through ``.permute(0, 2, 3, 1).reshape(-1, c)`` of a copy of the weight:
    NCHW copies there, so the weight must not change (an NHWC weight's rows are a view)."""
    with torch.no_grad():
        weight = net[2].weight
        rows = weight.permute(0, 2, 3, 1).reshape(-1, weight.shape[1])
        rows[0].mul_(100.0)
        weight.mul_(0.99)


def _decayed_as_a_vector(net, output) -> None:
    with torch.no_grad():
        vector_to_parameters(parameters_to_vector(net.parameters()) * 0.9, net.parameters())


def _memory_cleared(net, output) -> None:
    with torch.no_grad():
        flat = net.memory.view(-1)
        flat[::3] = 0.0


def _conv_output_net() -> nn.Module:
    """A net whose output is the last convolution's NHWC map; its loss flattens with ``.reshape``."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1), nn.ReLU(), nn.Conv2d(3, 3, 1))


def _read_output(net, output) -> None:
    with torch.no_grad():
        net[4].bias.add_(output.detach().view(-1)[:3] * 0.01)


def _read_through_3d_views(net, output) -> None:
    """``flatten(2)`` and a channel slice of the NHWC output keep NHWC strides, which ``.view(n, -1)`` refuses."""
    with torch.no_grad():
        rows, first = output.detach().flatten(2).view(len(output), -1), output.detach()[:, :2].view(len(output), -1)
        net[4].bias.add_((rows[:, :3] + first[:, :3]).sum(0) * 0.01)


def _map_loss(output, batch):
    return output.reshape(len(output), -1).pow(2).mean()


RUNS = {
    'pruned': Run(_net, _batches(), _cross_entropy, batch_end=_pruned),
    'pruned-globally': Run(_net, _batches(), _cross_entropy, batch_end=_pruned_globally),
    'pruned-at-random': Run(_net, _batches(), _cross_entropy, batch_end=_pruned_at_random),
    'max-normed-after-the-step': Run(_net, _batches(), _cross_entropy, batch_end=_max_normed),
    'max-normed-through-reshapes': Run(_net, _batches(), _cross_entropy, batch_end=_max_normed_through_reshapes),
    'rows-of-a-permuted-weight-written': Run(_net, _batches(), _cross_entropy, batch_end=_rows_of_filters_scaled),
    'decayed-as-a-vector': Run(_net, _batches(), _cross_entropy, batch_end=_decayed_as_a_vector),
    'buffer-written-through-a-view': Run(WithMemory, _batches(), _cross_entropy, batch_end=_memory_cleared),
    'output-read-through-a-view': Run(_conv_output_net, _batches(), _map_loss, batch_end=_read_output),
    'output-read-through-3d-views': Run(_conv_output_net, _batches(), _map_loss, batch_end=_read_through_3d_views),
}


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('name', sorted(RUNS))
def test_code_between_batches_that_views_trains_as_in_nchw(name, integration):
    run = RUNS[name]
    expected = nchw(run)
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, expected, f'{name} via {integration}')


class _EverySecondStep:
    """Gradient code a trainer runs after each backward, acting on every second step only (never the first,
    which the first step's watch covers): a gradient norm through ``p.grad.view(-1)``, and a clip written
    through those views."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, net: nn.Module) -> None:
        self.calls += 1
        if self.calls % 2:
            return
        with torch.no_grad():
            flat = [p.grad.view(-1) for p in net.parameters()]
            norm = torch.cat(flat).norm()
            for g in flat:
                g.mul_(0.5 / norm.clamp(min=0.5))


@pytest.mark.parametrize('integration', ['composer', 'lightning'])
def test_gradient_code_on_later_steps_trains_as_in_nchw(integration):
    """The first step's watch ends with its optimizer step; a trainer's hooks after a later backward (Composer's
    ``AFTER_BACKWARD``, Lightning's ``on_before_optimizer_step``) view the gradients under the watch between
    batches, which resumes at each step's end."""
    expected = nchw(Run(_net, _batches(5), _cross_entropy, after_backward=_EverySecondStep()))
    steps, _, _ = guarded(Run(_net, _batches(5), _cross_entropy, after_backward=_EverySecondStep()), integration)
    assert_same_run(steps, expected, f'gradient code on every second step via {integration}')


def _plain_loop(channels_last: bool) -> list:
    """A plain loop whose gradient code follows the step's block, on every second step."""
    torch.manual_seed(0)
    net, clip = _net().double(), _EverySecondStep()
    guard = LayoutGuard() if channels_last else None
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if guard is not None:
        guard.on_init(net, optimizer)
    weights = []
    for images, labels in _batches(5):
        if guard is not None:
            images = guard.on_batch(images)
        with guard.step() if guard is not None else contextlib.nullcontext():
            F.cross_entropy(net(images), labels).backward()
        clip(net)
        optimizer.step()
        optimizer.zero_grad()
        if guard is not None:
            guard.on_batch_end()
        weights.append([p.detach().clone() for p in net.parameters()])
    if guard is not None:
        guard.close()
    return weights


def test_gradient_code_after_a_later_steps_block_trains_as_in_nchw():
    for step, (actual, expected) in enumerate(zip(_plain_loop(True), _plain_loop(False), strict=True)):
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=f'step {step}')


def test_each_place_is_named_once_and_the_watch_ends_with_close(caplog):
    net = _conv_output_net().double()
    guard = LayoutGuard()
    guard.on_init(net)
    caplog.set_level(logging.INFO)
    for batch in _batches():
        with guard.step():
            out = net(guard.on_batch(batch)[0])
            out.sum().backward()
        guard.on_batch_end()
        out.detach().view(-1)
    guard.close()
    lines = [r.getMessage() for r in caplog.records if 'between batches' in r.getMessage()]
    assert len(lines) == 1 and 'test_between_batches.py' in lines[0], lines
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        out.detach().view(-1)  # closed: nothing runs it any more


def _nhwc(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(memory_format=torch.channels_last)


def test_views_nchw_refuses_too_still_raise_and_nothing_runs_while_paused():
    between = BetweenBatches(lambda tensor: False, lambda why: False, lambda line: None)
    between.begin()
    try:
        with pytest.raises(RuntimeError, match='view size is not compatible'):
            torch.randn(4, 6).t().view(-1)  # no channels-last tensor: as torch has it
        with pytest.raises(RuntimeError, match='view size is not compatible'):
            _nhwc(2, 4, 3, 3)[:, :2].view(-1)  # a channel slice: not channels-last dense
        between.pause()
        with pytest.raises(RuntimeError, match='view size is not compatible'):
            _nhwc(2, 4, 3, 3).view(-1)  # a batch runs: no watch
        between.resume()
        assert _nhwc(2, 4, 3, 3).view(-1).shape == (72,)
        assert _nhwc(2, 4, 3, 3).flatten(2).view(2, -1).shape == (2, 36)  # NCHW's flatten(2) is contiguous
        with pytest.raises(RuntimeError, match='view size is not compatible'):
            _nhwc(2, 4, 3, 3).flatten(2)[:, :2].view(-1)  # and its channel slice is not: NCHW refuses too
    finally:
        between.end()


def test_a_view_of_a_weight_makes_the_weights_contiguous_and_is_a_true_view():
    conv = nn.Conv2d(3, 4, 3).double().to(memory_format=torch.channels_last)
    asked = []

    def weights_viewed(why: str) -> bool:
        asked.append(why)
        conv.to(memory_format=torch.contiguous_format)
        return True

    between = BetweenBatches(lambda tensor: False, weights_viewed, lambda line: None)
    between.begin()
    try:
        flat = conv.weight.view(-1)
        with torch.no_grad():
            flat[0] = 7.0
    finally:
        between.end()
    assert conv.weight[0, 0, 0, 0].item() == 7.0 and conv.weight.is_contiguous()
    assert len(asked) == 1 and 'between batches' in asked[0] and 'test_between_batches.py' in asked[0]


class _ModesInTheWorker(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        return torch._C._len_torch_function_stack()


@pytest.mark.skipif(not hasattr(torch.multiprocessing, 'get_all_start_methods'), reason='no multiprocessing')
def test_dataloader_workers_forked_between_batches_run_without_the_watch():
    if 'fork' not in torch.multiprocessing.get_all_start_methods():
        pytest.skip('no fork on this platform')
    between = BetweenBatches(lambda tensor: False, lambda why: False, lambda line: None)
    between.begin()
    try:
        assert torch._C._len_torch_function_stack() == 1
        loader = torch.utils.data.DataLoader(_ModesInTheWorker(), num_workers=1, multiprocessing_context='fork')
        assert [int(n) for n in loader] == [0]
    finally:
        between.end()


def _lightning_weights(callbacks: list, channels_last: bool, recorded_at: str, batches: int, epochs: int) -> list:
    """The weights of ``_net()`` trained by Lightning with ``callbacks`` (and the channels-last callback, last),
    recorded at the LightningModule's hook ``recorded_at``."""
    import lightning as L

    from channels_last_algo.integrations.lightning import ChannelsLastCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _net().double()
            self.weights: list = []

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def record(self, *args: object) -> None:
            self.weights.append({k: v.detach().clone() for k, v in self.net.named_parameters()})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    setattr(Module, recorded_at, Module.record)
    module, data = Module(), _batches(batches)
    data = torch.utils.data.TensorDataset(torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data]))
    ours = [ChannelsLastCallback()] if channels_last else []
    trainer = lightning_trainer(callbacks=[*callbacks, *ours], max_epochs=epochs)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module.weights


def _assert_same_weights(actual: list, expected: list, count: int) -> None:
    assert len(actual) == len(expected) == count
    for index, (got, want) in enumerate(zip(actual, expected), 1):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-10, msg=f'record {index}: {name}')


@pytest.mark.parametrize('method', ['l1_unstructured', 'random_unstructured'])
def test_lightning_model_pruning_trains_as_in_nchw(method):
    pytest.importorskip('lightning')
    from lightning.pytorch.callbacks import ModelPruning

    def pruning() -> list:
        return [ModelPruning(method, amount=0.3, use_global_unstructured=method.startswith('l1'), verbose=0)]

    expected = _lightning_weights(pruning(), False, 'on_train_epoch_end', batches=2, epochs=3)
    _assert_same_weights(_lightning_weights(pruning(), True, 'on_train_epoch_end', batches=2, epochs=3), expected, 3)


def test_lightning_callbacks_listed_before_the_channels_last_one_view_as_in_nchw():
    """A callback ahead of ``ChannelsLastCallback`` runs its ``on_train_batch_end`` first: the watch between
    batches begins when the optimizer step ends, not at the channels-last callback's own hook."""
    pytest.importorskip('lightning')
    import lightning as L

    class MaxNorm(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            _max_normed(pl_module.net, None)

    expected = _lightning_weights([MaxNorm()], False, 'on_train_batch_end', batches=3, epochs=1)
    _assert_same_weights(_lightning_weights([MaxNorm()], True, 'on_train_batch_end', batches=3, epochs=1), expected, 3)


def test_composer_callbacks_at_fit_end_view_the_weights_as_in_nchw():
    """Composer runs algorithms before callbacks: the guard closes after the callbacks' ``FIT_END``, not before."""
    pytest.importorskip('composer')
    from composer import Callback, Trainer
    from composer.models import ComposerModel

    from channels_last_algo.integrations.composer import ChannelsLast

    class Model(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net, self.read = _net().double(), []

        def forward(self, batch):
            return self.net(batch[0])

        def loss(self, outputs, batch):
            return F.cross_entropy(outputs, batch[1])

    class Summed(Callback):
        def fit_end(self, state, logger) -> None:
            state.model.read.append(parameters_to_vector(state.model.parameters()).clone())

    def trained(*algorithms) -> list:
        model, batches = Model(), _batches(2)
        data = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        trainer = Trainer(
            model=model,
            train_dataloader=torch.utils.data.DataLoader(data, batch_size=2),
            max_duration='2ba',
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            device='cpu',
            algorithms=list(algorithms),
            callbacks=[Summed()],
            progress_bar=False,
        )
        try:
            trainer.fit()
        finally:
            trainer.close()
        return model.read

    expected, actual = trained(), trained(ChannelsLast())
    assert len(actual) == len(expected) == 1
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-10, atol=1e-10)
