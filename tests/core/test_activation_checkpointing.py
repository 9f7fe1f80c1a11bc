"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and not, and ``checkpoint_sequential``, as
timm's ``set_grad_checkpointing`` and transformers' ``gradient_checkpointing_enable`` run blocks) recomputes each
block's forward in the backward. A block that views its activations as a non-local attention does, and drops out
(the recomputation must draw the same mask), followed by a head that flattens its map with ``.view``, trains
3 float64 steps through every integration, every step equal to the NCHW run's; the stem stays channels last. So
does a selectively checkpointed block (``context_fn``), whose backward replays its forward's ops one by one.
"""

from __future__ import annotations

import functools

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, classification_batches, guarded, nchw
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)


class AttentionBlock(nn.Module):
    """Non-local attention over ``.view``-flattened maps, then a convolution and dropout."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        n, c, h, w = x.shape
        query, key, value = (layer(x).view(n, c, h * w) for layer in (self.query, self.key, self.value))
        attention = torch.softmax(query.transpose(1, 2) @ key, -1)
        mixed = (value @ attention.transpose(1, 2)).view(n, c, h, w)
        return self.drop(F.relu(self.conv(x + mixed)))


class Checkpointed(nn.Module):
    """A stem, two checkpointed attention blocks, a head over the flattened map. The global generator is seeded
    at each forward (the trainers draw from it themselves between steps), so every run draws the same masks."""

    def __init__(self, reentrant: bool, sequential: bool) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(AttentionBlock(8), AttentionBlock(8))
        self.head = nn.Linear(8 * 8 * 8, 5)
        self.reentrant, self.sequential, self.calls = reentrant, sequential, 0

    def forward(self, x):
        self.calls += 1
        torch.manual_seed(self.calls)
        x = self.stem(x)
        if self.sequential:
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=self.reentrant)
        else:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x.view(x.size(0), -1))


def _run(reentrant: bool, sequential: bool) -> Run:
    return Run(
        build=lambda: Checkpointed(reentrant, sequential),
        batches=classification_batches(classes=5, seed=4),
        loss=lambda output, batch: F.cross_entropy(output, batch[1]),
    )


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('sequential', [False, True], ids=['checkpoint', 'checkpoint_sequential'])
@pytest.mark.parametrize('reentrant', [False, True], ids=['non-reentrant', 'reentrant'])
def test_checkpointed_blocks_recompute_as_in_nchw(reentrant, sequential, integration):
    run = _run(reentrant, sequential)
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{integration}, reentrant={reentrant}, sequential={sequential}')
    assert net.stem.weight.is_contiguous(memory_format=torch.channels_last) and not net.stem.weight.is_contiguous()


def _saving_convolutions(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective activation checkpointing's policy: keep the convolutions' outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.convolution.default else CheckpointPolicy.PREFER_RECOMPUTE


class SelectivelyCheckpointed(nn.Module):
    """Two convolutions checkpointed selectively (``context_fn``), then a head that ``.view``s their map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = (
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.Conv2d(8, 8, 3, padding=1),
        )
        self.head = nn.Linear(8 * 8 * 8, 5)

    def body(self, x):
        return F.relu(self.conv2(F.relu(self.norm(self.conv1(x)))))

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, _saving_convolutions)
        y = checkpoint(self.body, x, use_reentrant=False, context_fn=context)
        return self.head(y.view(y.size(0), -1))


@pytest.mark.parametrize('integration', INTEGRATIONS)
def test_selectively_checkpointed_blocks_replay_the_ops_of_their_forward(integration):
    """Selective checkpointing replays the forward's ops one by one in the backward: the head's view, found in the
    first step's forward, must not add an op (the copy that makes ``conv2``'s output channels first) to that step's
    recomputation; from the next step on the forward has it too."""
    run = Run(
        SelectivelyCheckpointed, classification_batches(classes=5, seed=4), lambda out, b: F.cross_entropy(out, b[1])
    )
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{integration}, selective checkpointing')
    assert net.conv1.weight.is_contiguous(memory_format=torch.channels_last) and not net.conv1.weight.is_contiguous()


def test_without_the_package_the_flattening_head_fails_in_channels_last():
    """What the runs above guard against: plain channels last cannot ``.view`` the last map."""
    net = Checkpointed(reentrant=False, sequential=False).double().to(memory_format=torch.channels_last)
    x = classification_batches(classes=5, seed=4)[0][0].to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        net(x).sum().backward()
