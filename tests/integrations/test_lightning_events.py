"""The Lightning adapters hook by hook, on a Trainer that never fits: ``ChannelsLastCallback`` and
``FusedEvalCallback`` map each hook onto the guard or the fused evaluation, and the one module that
reaches past Lightning's hooks (``lightning_adapter``) holds against a real Trainer and strategy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip('lightning', reason='the Lightning integration needs lightning (the newest environment)')

import lightning.pytorch as pl

from channels_last_algo import ChannelsLastCallback, FusedEvalCallback
from channels_last_algo.core.fuse import InferenceModel
from channels_last_algo.integrations.lightning_adapter import first_training_batch, follow_strategy

NHWC = torch.channels_last


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator='cpu', devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)


def _connected() -> tuple[pl.Trainer, _Module]:
    trainer, module = _trainer(), _Module()
    trainer.strategy.connect(module)
    return trainer, module


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 8, 8), torch.zeros(2)


def test_setup_follows_the_strategy_moves_and_teardown_unwraps_them():
    trainer, module = _connected()
    callback = ChannelsLastCallback()
    callback.setup(trainer, module, 'fit')
    trainer.strategy.model_to_device()
    assert module.net[0].weight.is_contiguous(memory_format=NHWC)
    images, _ = trainer.strategy.batch_to_device(_batch())
    assert images.is_contiguous(memory_format=NHWC)
    callback.teardown(trainer, module, 'fit')
    assert 'batch_to_device' not in vars(trainer.strategy) and 'model_to_device' not in vars(trainer.strategy)
    images, _ = trainer.strategy.batch_to_device(_batch())
    assert not images.is_contiguous(memory_format=NHWC)


def test_follow_strategy_calls_back_after_each_move_of_a_real_strategy():
    trainer, _ = _connected()
    seen = []
    undo = follow_strategy(trainer.strategy, lambda: seen.append('model'), lambda batch: seen.append(batch) or batch)
    trainer.strategy.model_to_device()
    batch = trainer.strategy.batch_to_device(torch.ones(1))
    assert seen[0] == 'model' and seen[1] is batch
    undo()
    assert vars(trainer.strategy).keys().isdisjoint({'model_to_device', 'batch_to_device'})


def test_first_training_batch_asks_the_fit_loops_data_source_and_keeps_the_random_state():
    trainer, module = _connected()
    loader = DataLoader(TensorDataset(*_batch()), batch_size=2, shuffle=True)
    trainer._data_connector.attach_data(module, train_dataloaders=loader)
    state = torch.get_rng_state()
    images, _ = first_training_batch(trainer)
    assert images.shape == (2, 3, 8, 8) and torch.equal(torch.get_rng_state(), state)


def test_an_audited_step_between_batch_start_and_after_backward():
    trainer, module = _connected()
    callback = ChannelsLastCallback(audit_steps=1)
    callback.setup(trainer, module, 'fit')
    trainer.strategy.model_to_device()
    batch = trainer.strategy.batch_to_device(_batch())
    callback.on_train_batch_start(trainer, module, batch, 0)
    loss = module.training_step(batch, 0)
    callback.on_before_backward(trainer, module, loss)
    loss.backward()
    callback.on_after_backward(trainer, module)
    assert callback.report is not None and callback.report.ok
    callback.teardown(trainer, module, 'fit')


def _validation_pass(callback, trainer: pl.Trainer, module: _Module) -> type:
    """on_validation_start, the first batch, on_validation_end; the network's type during the pass."""
    module.eval()
    callback.on_validation_start(trainer, module)
    callback.on_validation_batch_start(trainer, module, _batch(), 0)
    during = type(module.net)
    callback.on_validation_end(trainer, module)
    return during


@pytest.mark.parametrize(
    'callback', [FusedEvalCallback, lambda: ChannelsLastCallback(fuse_eval=True)], ids=['FusedEvalCallback', 'alias']
)
def test_fused_evaluation_swaps_a_fused_copy_in_for_one_pass(callback):
    trainer, module = _connected()
    callback = callback()
    network = module.net
    assert _validation_pass(callback, trainer, module) is InferenceModel
    assert module.net is network


def test_fuse_eval_off_leaves_validation_alone_and_a_wrong_network_is_named():
    trainer, module = _connected()
    assert _validation_pass(ChannelsLastCallback(), trainer, module) is nn.Sequential
    with pytest.raises(ValueError, match=r'_Module.head is NoneType, not the network to fuse'):
        FusedEvalCallback(network='head').on_fit_start(trainer, module)
    with pytest.raises(ValueError, match='network must be the name'):
        FusedEvalCallback(network=3)
