"""``ChannelsLastCallback`` beside Lightning's own training callbacks and Trainer options: each trains as
it does alone.

Lightning's callbacks average the weights (EMA, SWA, whose last epoch recomputes BatchNorm statistics in
an extra pass), prune them between epochs (ModelPruning's ``l1_unstructured`` views each weight), unfreeze
a backbone into new parameter groups (BackboneFinetuning), change the accumulation (a scheduler, or
``accumulate_grad_batches`` with clipping), or run trial fits before training and restore the model after
(LearningRateFinder, BatchSizeFinder); ModelCheckpoint and EarlyStopping watch a validation loss, and
``detect_anomaly`` runs every backward under anomaly mode. A float64 net of two bottleneck blocks trains
2 epochs with each, alone and with the callback in either mode; every step's loss and parameters must
equal the run without it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip('lightning', reason='the Lightning integration needs lightning (the newest-torch environment)')

import lightning as L
from guarded_runs import assert_same_run
from lightning.pytorch import callbacks
from torch import nn
from torch.nn import functional as F
from torchvision.models.resnet import Bottleneck

from channels_last_algo import ChannelsLastCallback
from conftest import lightning_trainer

CASES = {
    'ema': (lambda tmp: [callbacks.EMAWeightAveraging(decay=0.5)], {}),
    'swa': (lambda tmp: [callbacks.StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)], {}),
    'pruning': (lambda tmp: [callbacks.ModelPruning('l1_unstructured', amount=0.3, use_global_unstructured=False)], {}),
    'backbone_finetuning': (lambda tmp: [callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)], {}),
    'accumulation_scheduler': (lambda tmp: [callbacks.GradientAccumulationScheduler({0: 2})], {}),
    'accumulate_and_clip': (lambda tmp: [], {'accumulate_grad_batches': 2, 'gradient_clip_val': 0.1}),
    'clip_values': (lambda tmp: [], {'gradient_clip_val': 0.05, 'gradient_clip_algorithm': 'value'}),
    'checkpoint_and_early_stopping': (
        lambda tmp: [
            callbacks.ModelCheckpoint(dirpath=tmp, monitor='val_loss'),
            callbacks.EarlyStopping('val_loss', patience=5),
        ],
        {'enable_checkpointing': True, 'limit_val_batches': 2},
    ),
    'learning_rate_finder': (lambda tmp: [callbacks.LearningRateFinder(num_training_steps=4)], {}),
    'batch_size_finder': (lambda tmp: [callbacks.BatchSizeFinder(steps_per_trial=1, init_val=2, max_trials=2)], {}),
    'detect_anomaly': (lambda tmp: [], {'detect_anomaly': True}),
}


class _Classifier(L.LightningModule):
    """A stem and two of torchvision's bottleneck blocks as ``backbone``, a linear ``head``; 16 32-px
    images in batches of ``batch_size``. It keeps each training step's loss and parameters."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        downsample = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
        self.backbone = nn.Sequential(
            *(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)),
            *(Bottleneck(16, 4), Bottleneck(16, 8, stride=2, downsample=downsample)),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
        self.batch_size, self.lr, self.steps = batch_size, 0.01, []
        generator = torch.Generator().manual_seed(1)
        images = torch.randn(16, 3, 32, 32, generator=generator, dtype=torch.float64)
        self.data = torch.utils.data.TensorDataset(images, torch.randint(0, 10, (16,), generator=generator))

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log('train_loss', loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log('val_loss', F.cross_entropy(self(batch[0]), batch[1]))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        parameters = {name: p.detach().clone() for name, p in self.named_parameters()}
        self.steps.append((outputs['loss'].detach().clone(), parameters))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=4)


def _fit(name: str, folder, channels_last: ChannelsLastCallback | None) -> _Classifier:
    make, options = CASES[name]
    L.seed_everything(0, verbose=False)
    module = _Classifier().double()
    listed = make(folder) + ([channels_last] if channels_last is not None else [])
    lightning_trainer(callbacks=listed, max_epochs=2, **{'limit_val_batches': 0, **options}).fit(module)
    return module


@pytest.mark.parametrize('mode', ['on', 'auto'])
@pytest.mark.parametrize('name', list(CASES))
def test_channels_last_beside_a_lightning_callback_trains_as_the_callback_alone(name, mode, tmp_path):
    expected = _fit(name, tmp_path / 'alone', None).steps
    module = _fit(name, tmp_path / 'with', ChannelsLastCallback(mode=mode))
    assert len(expected) >= 8, 'two epochs of 4 batches, and any trial steps'
    assert_same_run(module.steps, expected, f'ChannelsLastCallback({mode!r}) beside {name}')
    if mode == 'on':  # auto keeps the layout it timed faster, which differs between machines
        weights = [p for p in module.parameters() if p.dim() == 4 and p.shape[-1] > 1]
        viewed = name == 'pruning'  # the pruning views the weights: the package makes them contiguous, saying so
        assert weights and all(w.is_contiguous() == viewed for w in weights), f'weights contiguous: {not viewed}'
