"""Train a float64 model a few steps in NCHW without the package, and through each integration.

``Run`` says what to train: the model, the batches, the loss and the optimizer. :func:`nchw` trains it
plainly; :func:`guarded` through :class:`LayoutGuard` in a plain loop, the Composer algorithm or the
Lightning callback (each skipped where its trainer is not installed). Both return every step's loss
and a snapshot of the parameters after it, for :func:`assert_same_run`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from channels_last_algo.core.guard import LayoutGuard
from conftest import lightning_trainer

TOLERANCE = dict(rtol=1e-10, atol=1e-10)  # float64: what a different summation order leaves
INTEGRATIONS = ('guard', 'composer', 'lightning')


@dataclasses.dataclass
class Run:
    """A model (built fresh by ``build``), its batches (tuples of tensors, or containers a loader yields as
    they are), ``loss(output, batch)`` and ``optimizer(params)``."""

    build: Callable[[], nn.Module]
    batches: list[tuple]
    loss: Callable[[Any, tuple], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    forward: Callable[[nn.Module, tuple], Any] = lambda net, batch: net(batch[0])
    after_backward: Callable[[nn.Module], None] = lambda net: None  # code between the backward and the optimizer
    batch_end: Callable[[nn.Module, Any], None] = lambda net, output: None  # code after the step, given its output
    options: dict = dataclasses.field(default_factory=dict)  # the integration's options this run needs


def classification_batches(
    shape: tuple = (2, 3, 8, 8), classes: int = 10, steps: int = 3, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` float64 batches of ``shape`` with labels below ``classes``, drawn from a generator seeded ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(shape, generator=generator, dtype=torch.float64),
            torch.randint(0, classes, (shape[0],), generator=generator),
        )
        for _ in range(steps)
    ]


def _snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in net.named_parameters()}


def _step(run: Run, net: nn.Module, opt: torch.optim.Optimizer, batch: tuple, guard: LayoutGuard | None):
    """One step; LBFGS-style optimizers take a closure that runs forward and backward."""
    losses, outputs = [], []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        outputs.append(run.forward(net, batch))
        loss = run.loss(outputs[-1], batch)
        loss.backward()
        losses.append(loss.detach().clone())
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        with guard.step() if guard is not None else _nothing():
            opt.step(closure)
    else:
        with guard.step() if guard is not None else _nothing():
            closure()
            run.after_backward(net)  # in a plain loop, inside the guard's step: its watch covers it
        opt.step()
    return losses[-1], outputs[-1]  # LBFGS calls the closure more than once: its last, as Lightning records


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _fresh(batches: list) -> list:
    """Copies of the batches, so that a model writing its batch in place (CutMix) finds each run's
    batches as made, as the trainers' loaders give them."""
    return copy.deepcopy(batches)


def nchw(run: Run) -> list[tuple[torch.Tensor, dict]]:
    """The model trained without the package."""
    torch.manual_seed(0)
    net = run.build().double()
    opt = run.optimizer(net.parameters())
    steps = []
    for batch in _fresh(run.batches):
        loss, output = _step(run, net, opt, batch, None)
        run.batch_end(net, output)
        steps.append((loss, _snapshot(net)))
    return steps


def guarded(run: Run, integration: str, **options: Any) -> tuple[list[tuple[torch.Tensor, dict]], nn.Module, Any]:
    """The model trained through ``integration`` (one of :data:`INTEGRATIONS`, or ``'composer_callback'``: the
    Composer algorithm among the Trainer's callbacks) with ``options``: the steps, the network, the guard's owner."""
    torch.manual_seed(0)
    net = run.build().double()
    options = {**run.options, **options}
    if integration == 'guard':
        guard = LayoutGuard(**options)
        opt = run.optimizer(net.parameters())
        guard.on_init(net, opt)
        steps = []
        for batch in _fresh(run.batches):
            loss, output = _step(run, net, opt, guard.on_batch(batch), guard)
            guard.on_batch_end()  # as the trainers call it
            run.batch_end(net, output)
            steps.append((loss, _snapshot(net)))
        guard.close()
        return steps, net, guard
    if integration in ('composer', 'composer_callback'):
        return _composer(run, net, options, as_callback=integration == 'composer_callback')
    return _lightning(run, net, options)


def _composer(run: Run, net: nn.Module, options: dict, as_callback: bool) -> tuple[list, nn.Module, Any]:
    """Through Composer's Trainer, with ``ChannelsLast`` in its algorithms or, ``as_callback``, its callbacks."""
    pytest.importorskip('composer')
    from composer import Callback, Trainer
    from composer.models import ComposerModel

    from channels_last_algo.integrations.composer import ChannelsLast

    class Model(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, batch):
            return run.forward(self.net, batch)

        def loss(self, outputs, batch):
            return run.loss(outputs, batch)

    class Record(Callback):
        def __init__(self) -> None:
            self.steps = []

        def after_backward(self, state, logger) -> None:
            run.after_backward(net)

        def batch_end(self, state, logger) -> None:
            run.batch_end(net, state.outputs)
            self.steps.append((state.loss.detach().clone(), _snapshot(net)))

    record, algorithm = Record(), ChannelsLast(**options)
    trainer = Trainer(
        model=Model(),
        train_dataloader=_loader(run),
        optimizers=run.optimizer(net.parameters()),
        max_duration=f'{len(run.batches)}ba',
        device='cpu',
        algorithms=[] if as_callback else [algorithm],
        callbacks=[algorithm, record] if as_callback else [record],
        progress_bar=False,
        seed=0,  # the same seed for every run, so that runs of a model that draws random numbers compare
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return record.steps, net, algorithm


def _lightning(run: Run, net: nn.Module, options: dict) -> tuple[list, nn.Module, Any]:
    pytest.importorskip('lightning')
    import lightning as L

    from channels_last_algo.integrations.lightning import ChannelsLastCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.steps: list = []

        def training_step(self, batch, batch_idx):
            output = run.forward(self.net, batch)
            return {'loss': run.loss(output, batch), 'output': output}

        def on_before_optimizer_step(self, optimizer) -> None:
            run.after_backward(self.net)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            run.batch_end(self.net, outputs['output'])
            self.steps.append((outputs['loss'].detach().clone(), _snapshot(self.net)))

        def configure_optimizers(self):
            return run.optimizer(self.net.parameters())

    module, callback = Module(), ChannelsLastCallback(**options)
    trainer = lightning_trainer(
        callbacks=[callback],
        max_steps=len(run.batches),
    )
    trainer.fit(module, train_dataloaders=_loader(run))
    return module.steps, net, callback


def _loader(run: Run) -> torch.utils.data.DataLoader:
    """The batches in order, one per step."""
    if not isinstance(run.batches[0], tuple):  # a container the loader yields as it is
        return torch.utils.data.DataLoader(run.batches, batch_size=None)
    columns = [torch.cat(column) for column in zip(*run.batches)]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*columns), batch_size=len(run.batches[0][0]))


def assert_same_run(steps: list, expected: list, where: str) -> None:
    """Every step's loss and every parameter after it equal to the NCHW run's."""
    assert len(steps) == len(expected), f'{where}: {len(steps)} steps, not {len(expected)}'
    for step, ((loss, tensors), (nchw_loss, nchw_tensors)) in enumerate(zip(steps, expected), 1):
        torch.testing.assert_close(
            loss, nchw_loss, **TOLERANCE, msg=lambda m, step=step: f'{where}, step {step}: loss. {m}'
        )
        for key, value in nchw_tensors.items():
            torch.testing.assert_close(
                tensors[key], value, **TOLERANCE, msg=lambda m, step=step, key=key: f'{where}, step {step}: {key}. {m}'
            )
