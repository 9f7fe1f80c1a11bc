"""An evaluation or prediction step's own code that views the NHWC output evaluates as in NCHW.

``validation_step``'s ``out.view(n, -1)`` after ``self.net(x)``, ``predict_step``'s
``self(x).view(n, -1)``, a Composer ``eval_forward`` or ``update_metric`` that views the outputs, a
callback reading ``state.outputs.view(n, -1)`` at ``EVAL_BATCH_END``: each raised "view size is not
compatible" under channels last, where NCHW runs, because the watch of an evaluation batch ended
with its forward. Each loop below (fit with validation, validate, test, predict, Composer's eval
and predict) runs a float64 segmentation net with and without the package: what the steps read and
the trained weights are equal.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.guard import LayoutGuard
from conftest import lightning_trainer

TOLERANCE = dict(rtol=1e-10, atol=1e-10)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4)
    ).double()


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 6, 6, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 4, (8, 6, 6), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=2)


def _flat(output: torch.Tensor) -> torch.Tensor:
    return output.view(len(output), -1)  # channels and pixels in one row: NHWC strides refuse it


def _assert_same(actual: tuple, expected: tuple) -> None:
    """The values the steps read, in order, and the weights after the run."""
    (read, weights), (expected_read, expected_weights) = actual, expected
    assert len(read) == len(expected_read) > 0
    for index, (got, want) in enumerate(zip(read, expected_read)):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m, index=index: f'read {index}: {m}')
    for name, want in expected_weights.items():
        torch.testing.assert_close(weights[name], want, **TOLERANCE, msg=lambda m, name=name: f'{name}: {m}')


# (loops, fuse_eval): a fused copy is built at each pass, its first batch watched anew
LIGHTNING_LOOPS = [(loops, False) for loops in ('fit', 'validate', 'test', 'predict', 'fit, then predict')]
LIGHTNING_LOOPS += [('fit', True), ('fit, then predict', True)]


@pytest.mark.parametrize(('loops', 'fuse_eval'), LIGHTNING_LOOPS)
def test_lightning_steps_that_view_the_output_after_the_forward_match_nchw(loops, fuse_eval):
    pytest.importorskip('lightning')
    import lightning as L

    from channels_last_algo.integrations.lightning import ChannelsLastCallback

    class Segmenter(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.read = _net(), []
            self.stem = self.net[0]  # the training network's, also while a fused copy evaluates

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            output = self.net(batch[0])
            self.read.append(F.cross_entropy(output, batch[1]) + _flat(output).pow(2).mean())

        def test_step(self, batch, batch_idx):
            self.read.append(_flat(self(batch[0])).sum(1))

        def predict_step(self, batch, batch_idx):
            return _flat(self(batch[0]))

        def on_validation_epoch_start(self) -> None:
            self.kept = []

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            self.kept.append(self.stem(batch[0]).detach())  # NHWC: nothing views this module's outputs

        def on_validation_epoch_end(self) -> None:
            self.read.append(torch.cat(self.kept).view(-1).pow(2).mean())  # NHWC, as what it joins

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(*callbacks) -> tuple:
        module = Segmenter()
        trainer = lightning_trainer(
            callbacks=list(callbacks), max_epochs=2, limit_val_batches=2, num_sanity_val_steps=1
        )
        if loops.startswith('fit'):
            trainer.fit(module, train_dataloaders=_loader(), val_dataloaders=_loader())
        if loops in ('validate', 'test'):
            getattr(trainer, loops)(module, _loader())
        if loops.endswith('predict'):
            module.read.extend(trainer.predict(module, _loader()))
        return [value.detach() for value in module.read], module.net.state_dict()

    _assert_same(run(ChannelsLastCallback(fuse_eval=fuse_eval, network='net' if fuse_eval else None)), run())


COMPOSER_RUNS = [
    ('update_metric', 'fit'),
    ('update_metric', 'eval'),
    ('eval_forward', 'fit'),
    ('eval_forward', 'eval'),
    ('a callback at EVAL_BATCH_END', 'eval'),
    ('a callback at EVAL_END', 'eval'),
    ('a callback at EVAL_END', 'fit'),
    ('a callback at PREDICT_BATCH_END', 'predict'),
    ('a callback at PREDICT_BATCH_END', 'fit, then predict'),
]
COMPOSER_RUNS = [(reader, loops, False) for reader, loops in COMPOSER_RUNS]
COMPOSER_RUNS += [('eval_forward', 'fit', True), ('a callback at PREDICT_BATCH_END', 'fit, then predict', True)]


@pytest.mark.parametrize(('reader', 'loops', 'fuse_eval'), COMPOSER_RUNS)
def test_composer_evaluation_code_that_views_the_outputs_matches_nchw(reader, loops, fuse_eval):
    pytest.importorskip('composer')
    from composer import Callback, Trainer
    from composer.models import ComposerModel
    from torchmetrics import MeanMetric

    from channels_last_algo.integrations.composer import ChannelsLast

    class Segmenter(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.module, self.metric, self.read = _net(), MeanMetric(), []  # .module: what fused evaluation fuses

        def forward(self, batch):
            return self.module(batch[0])

        def loss(self, outputs, batch):
            return F.cross_entropy(outputs, batch[1])

        def eval_forward(self, batch, outputs=None):
            outputs = self(batch)
            if reader == 'eval_forward':
                self.read.append(_flat(outputs).sum(1))
            return outputs

        def get_metrics(self, is_train=False):
            return {} if is_train else {'sums': self.metric}

        def update_metric(self, batch, outputs, metric) -> None:
            if reader == 'update_metric':
                self.read.append(_flat(outputs).sum(1))
                metric.update(self.read[-1])

    class Reader(Callback):
        def __init__(self, model: Segmenter) -> None:
            self.model = model

        def eval_start(self, state, logger) -> None:
            self.kept = []

        def eval_batch_end(self, state, logger) -> None:
            if reader.endswith('EVAL_BATCH_END'):
                self.model.read.append(_flat(state.outputs).sum(1))
            self.kept.append(state.outputs)

        def eval_end(self, state, logger) -> None:
            if reader.endswith('EVAL_END'):
                self.model.read.append(torch.cat(self.kept).view(-1).pow(2).mean())  # NHWC, as what it joins

        def predict_batch_end(self, state, logger) -> None:
            self.model.read.append(_flat(state.outputs).sum(1))

    def run(*algorithms) -> tuple:
        model = Segmenter()
        trainer = Trainer(
            model=model,
            train_dataloader=_loader(),
            eval_dataloader=_loader(),
            eval_interval='2ba',
            max_duration='4ba',
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            device='cpu',
            algorithms=list(algorithms),
            callbacks=[Reader(model)],
            progress_bar=False,
        )
        try:
            if loops.startswith('fit'):
                trainer.fit()
            if loops == 'eval':
                trainer.eval()
            if loops.endswith('predict'):
                trainer.predict(_loader())
        finally:
            trainer.close()
        return [value.detach().clone() for value in model.read], model.module.state_dict()

    _assert_same(run(ChannelsLast(fuse_eval=fuse_eval)), run())


def _evaluated(guard: LayoutGuard, net: nn.Module, loop, batches: int = 2) -> list[torch.Tensor]:
    """Evaluation batches in a plain loop, each read through ``.view`` after its forward."""
    read = []
    with torch.no_grad():
        for images, _ in list(_loader())[:batches]:
            read.append(_flat(net(guard.on_batch(images, loop=loop))).sum(1))
            guard.on_batch_end()
    return read


def _placed_in_a_named_loop(caplog, compiled: bool = False) -> list[str]:
    """Two evaluation batches of a plain loop named 'validate', read through ``.view`` after the forward (of
    the network compiled, or not) and checked against NCHW; the console lines that placed a module."""
    reference, net = _net().eval(), _net().eval()
    guard = LayoutGuard()
    guard.on_init(net)
    with caplog.at_level(logging.INFO, logger='channels_last_algo'):
        read = _evaluated(guard, torch.compile(net, backend='aot_eager') if compiled else net, loop='validate')
    guard.close()
    with torch.no_grad():
        expected = [_flat(reference(images)).sum(1) for images, _ in list(_loader())[:2]]
    for got, want in zip(read, expected):
        torch.testing.assert_close(got, want, **TOLERANCE)
    return [record.getMessage() for record in caplog.records if 'outputs made channels first' in record.getMessage()]


def test_a_plain_loop_that_names_its_loop_gets_its_step_code_watched(caplog):
    placed = _placed_in_a_named_loop(caplog)
    assert len(placed) == 1 and placed[0].startswith('channels last: 4 outputs made channels first (viewed at ')
    assert torch._C._len_torch_function_stack() == 0


def test_a_write_through_a_reshape_in_an_evaluation_step_reaches_the_output_as_in_nchw():
    """``out.reshape(n, -1)`` aliases an NCHW output but copies an NHWC one: a write through it was lost."""
    reference, net = _net().eval(), _net().eval()
    guard = LayoutGuard()
    guard.on_init(net)
    read, expected = [], []
    with torch.no_grad():
        for images, _ in list(_loader())[:3]:
            output = net(guard.on_batch(images, loop='validate'))
            output.reshape(len(output), -1)[:, :5] = 0
            read.append(output.sum((1, 2, 3)))
            guard.on_batch_end()
            output = reference(images)
            output.reshape(len(output), -1)[:, :5] = 0
            expected.append(output.sum((1, 2, 3)))
    guard.close()
    for got, want in zip(read, expected):
        torch.testing.assert_close(got, want, **TOLERANCE)


def test_each_loop_watches_its_first_batch_and_code_after_its_batches():
    net = _net().eval()
    guard = LayoutGuard()
    guard.on_init(net)
    images = next(iter(_loader()))[0]
    with torch.no_grad():
        net(guard.on_batch(images, loop='validate'))  # no view here: nothing placed
        guard.on_batch_end()
        output = net(guard.on_batch(images, loop='validate'))
        assert torch._C._len_torch_function_stack() == 0  # the loop's first batch was the one watched
        assert _flat(output).shape == (2, 144)  # a view first reached later: watched from there to the batch's end
        assert torch._C._len_torch_function_stack() == 1
        guard.on_batch_end()
        assert _flat(output).shape == (2, 144)  # after the batch, until the next: as at an epoch's end
        output = net(guard.on_batch(images))  # no loop named: its forward only, and no watch after it
        assert torch._C._len_torch_function_stack() == 0
        with pytest.raises(RuntimeError, match='view size is not compatible'):
            _flat(output)
        assert len(_evaluated(guard, net, loop='predict')) == 2  # another loop's step code: watched
    guard.close()
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        _flat(output)


def test_lightning_example_input_array_forwards_before_training_match_nchw():
    """The model summary runs ``example_input_array`` through the model at ``on_fit_start``, before any batch; a
    view in the forward raised there. The callback runs that forward first, watched; a trace of it works after."""
    pytest.importorskip('lightning')
    import lightning as L

    from channels_last_algo.integrations.lightning import ChannelsLastCallback

    class LeNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.norm, self.fc = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Linear(6 * 4 * 4, 4)
            self.example_input_array = torch.randn(2, 3, 6, 6, dtype=torch.float64)

        def forward(self, x):
            z = F.relu(self.norm(self.conv(x)))
            return self.fc(z.view(z.size(0), -1))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1].flatten(1)[:, 0] % 4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(*callbacks) -> tuple:
        module = LeNet().double()
        trainer = lightning_trainer(callbacks=list(callbacks), max_steps=3, enable_model_summary=True)
        trainer.fit(module, train_dataloaders=_loader())
        traced = module.to_torchscript(method='trace').eval()
        with torch.no_grad():
            return [traced(module.example_input_array)], module.state_dict()

    _assert_same(run(ChannelsLastCallback()), run())


def test_a_loop_named_by_anything_but_a_str_is_refused_naming_the_call():
    guard = LayoutGuard()
    guard.on_init(_net())
    with pytest.raises(TypeError, match=r"LayoutGuard.on_batch: loop names the batch's loop with a str"):
        guard.on_batch(next(iter(_loader()))[0], loop=['validate'])


def test_a_view_of_a_compiled_models_output_places_the_wrapper_named_by_its_network(caplog):
    placed = _placed_in_a_named_loop(caplog, compiled=True)
    assert len(placed) == 1 and placed[0].startswith('channels last: Sequential outputs made channels first'), placed


class ViewsInEvaluation(nn.Module):
    """Flattens with ``torch.flatten`` in training and with ``.view`` in evaluation: two graphs for dynamo."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):
        z = F.relu(self.stem(x))
        return self.head(torch.flatten(z, 1) if self.training else z.view(z.size(0), -1))


def test_a_compiled_models_evaluation_path_is_rehearsed_as_its_training_path():
    """Dynamo refuses a view NHWC strides cannot take as it traces, so a compiled model's first forward runs eagerly
    once, watched. Training and evaluation trace different graphs (``self.training``): the first forward in each mode
    is rehearsed, so a view only evaluation takes is placed before dynamo traces it."""
    torch.manual_seed(0)
    net = ViewsInEvaluation().double()
    reference = ViewsInEvaluation().double()
    reference.load_state_dict(net.state_dict())
    guard = LayoutGuard()
    guard.on_init(net)
    compiled = torch.compile(net, backend='aot_eager')
    images, labels = next(iter(_loader()))
    for _ in range(2):
        batch = guard.on_batch((images, labels[:, 0, 0]))
        with guard.step():
            F.cross_entropy(compiled(batch[0]), batch[1]).backward()
        guard.on_batch_end()
        F.cross_entropy(reference(images), labels[:, 0, 0]).backward()
        with torch.no_grad():
            for parameter in [*net.parameters(), *reference.parameters()]:
                parameter -= 0.1 * parameter.grad
                parameter.grad = None
    net.eval(), reference.eval()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(
                compiled(guard.on_batch(images, loop='validate')), reference(images), **TOLERANCE
            )
            guard.on_batch_end()
    guard.close()
    assert guard._viewed.placed == ['stem']
