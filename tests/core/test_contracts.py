"""PyTorch's contracts hold for a model trained under the package: it computes what the NCHW model computes.

Each model drops NHWC in its own forward (a break: a channels-first copy, or ``contiguous()``) and then
relies on a contract of PyTorch's: a write into a tensor it allocated lands in that tensor (by index, by
channel slice, by mask), ``contiguous()`` returns a contiguous tensor whose memory an extension kernel may
read in order, and ``view`` works on it. A ``torch.library`` extension op reads its input's raw memory
(and its backward op its gradient's) without ``contiguous()``, as NCHW never made it need one. A (2+1)D
video block (5D, ``channels_last_3d``) runs alike. A map that is NHWC in NCHW too (a ConvNeXt-style permute
back from tokens) keeps NCHW's copies: a write into its ``contiguous()`` or ``reshape`` stays there; and
dropout draws NCHW's mask on it (in a plain loop: the trainers draw random numbers of their own).
Each model trains 3 SGD steps (momentum, float64, fixed data) through :class:`LayoutGuard` in a plain loop,
the Composer algorithm and the Lightning callback, with 1 and 2 audited steps, and every step's loss and
every parameter and BatchNorm statistic after it must equal those of the same model trained in NCHW without
the package; its convolution weights must be channels last after the conversion.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import pytest
import torch
from extension_kernels import ramp_over_memory, registered_ramp
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layers import safe_paths
from conftest import lightning_trainer

STEPS = 3
BATCH = 2
CLASSES = 3
LR = 0.1
MOMENTUM = 0.9
TOLERANCE = dict(rtol=1e-10, atol=1e-10)  # float64: what a different summation order leaves
AUDITS = pytest.mark.parametrize('audit_steps', [1, 2], ids=lambda n: f'audit{n}')


def _head(channels: int) -> nn.Sequential:
    """Convolutions after the interesting part, so the model stays a conv net to its end, and a linear head."""
    return nn.Sequential(
        nn.Conv2d(channels, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, CLASSES),
    )


class FreshWrites(nn.Module):
    """Writes a convolution's output into a tensor it allocates (``x.new_zeros`` or ``torch.zeros``),
    after a channels-first staging copy of its input (the break); the result feeds the head.

    ``write``: ``'index'`` assigns per-level pooled features of regions by an index tensor along the
    batch dimension (multi-scale ROI pooling), ``'slice'`` fills a preallocated concatenation by channel
    slices (DenseNet's shared buffer), ``'mask'`` copies the positive values by a boolean mask.
    """

    ROI_IMAGES = (0, 1, 1, 0)  # the image of each region
    ROI_LEVELS = (0, 1, 0, 1)  # the feature level each region is pooled from
    POOLED = 4

    def __init__(self, write: str, alloc: str) -> None:
        super().__init__()
        self.write, self.alloc = write, alloc
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.branch = nn.Conv2d(4, 4, 3, padding=1)
        self.coarse = nn.Conv2d(4, 4, 3, padding=1)
        self.head = _head(8 if write == 'slice' else 4)

    def _zeros(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if self.alloc == 'new_zeros':
            return like.new_zeros(shape)
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)  # the break: a channels-first copy
        n, c, h, w = x.shape
        if self.write == 'index':
            return self._regions(x)
        if self.write == 'slice':
            out = self._zeros(x, (n, 2 * c, h, w))
            out[:, :c] = x
            out[:, c:] = self.branch(x)
            return self.head(out)
        y = self.branch(x)
        out = self._zeros(x, tuple(y.shape))
        keep = y > 0
        out[keep] = y[keep]
        return self.head(out)

    def _regions(self, x: torch.Tensor) -> torch.Tensor:
        levels = (self.branch(x), self.coarse(F.avg_pool2d(x, 2)))
        images = torch.tensor(self.ROI_IMAGES, device=x.device)
        assigned = torch.tensor(self.ROI_LEVELS, device=x.device)
        out = self._zeros(x, (len(self.ROI_IMAGES), x.shape[1], self.POOLED, self.POOLED))
        for level, features in enumerate(levels):
            idx = torch.nonzero(assigned == level).flatten()
            out[idx] = F.adaptive_avg_pool2d(features[images[idx]], self.POOLED)
        per_region = self.head(out)  # regions x classes, regions in image order 0, 1, 1, 0
        order = torch.argsort(images, stable=True)
        return per_region[order].view(x.shape[0], -1, CLASSES).sum(1)


class RampOp(torch.autograd.Function):
    """An extension-style op: makes its input contiguous, checks it is, and reads raw memory
    (:func:`ramp_over_memory`, its own adjoint), in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        assert x.is_contiguous(), f'x.contiguous() is not contiguous: strides {x.stride()}'
        return ramp_over_memory(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        assert grad.is_contiguous(), f'grad.contiguous() is not contiguous: strides {grad.stride()}'
        return ramp_over_memory(grad)


class AroundAnOp(nn.Module):
    """A convolution, ``op`` (an extension kernel), the head: the op must see NCHW memory."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.op = op
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = _head(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.op(self.stem(x)))


class ContiguousView(nn.Module):
    """A non-local block written on ``y = x.contiguous()`` (the break): checks that ``y`` is contiguous
    and its memory is in ``y.view(-1)``'s order, then views it as channels x positions."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.proj = nn.Conv2d(4, 4, 1)
        self.head = _head(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = x.contiguous()
        assert y.is_contiguous(), f'x.contiguous() is not contiguous: strides {y.stride()}'
        memory = torch.as_strided(y, (y.numel(),), (1,), y.storage_offset())
        assert torch.equal(memory, y.view(-1)), "y's memory is not in y.view(-1)'s order"
        n, c, h, w = y.shape
        tokens = y.view(n, c, h * w)
        attention = torch.softmax(tokens.transpose(1, 2) @ tokens / c, dim=-1)
        mixed = (tokens @ attention).view(n, c, h, w)
        return self.head(self.proj(mixed) + x)


class Video2Plus1D(nn.Module):
    """A (2+1)D video block after a break (``contiguous()``): spatial (1, 3, 3) then temporal (3, 1, 1)
    Conv3d with BatchNorm3d and ReLU, a residual add, a separable block (depthwise Conv3d, pointwise
    1x1x1) and a pooled linear head; input N x 3 x T x H x W."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(3, 4, (1, 3, 3), padding=(0, 1, 1))
        self.spatial = nn.Conv3d(4, 6, (1, 3, 3), padding=(0, 1, 1), bias=False)
        self.bn1 = nn.BatchNorm3d(6)
        self.temporal = nn.Conv3d(6, 4, (3, 1, 1), padding=(1, 0, 0), bias=False)
        self.bn2 = nn.BatchNorm3d(4)
        self.depthwise = nn.Conv3d(4, 4, 3, padding=1, groups=4, bias=False)
        self.pointwise = nn.Conv3d(4, 8, 1, bias=False)
        self.bn3 = nn.BatchNorm3d(8)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).contiguous()  # the break
        residual = F.relu(self.bn1(self.spatial(x)))
        x = F.relu(x + self.bn2(self.temporal(residual)))
        x = F.relu(self.bn3(self.pointwise(self.depthwise(x))))
        return self.fc(x.mean((2, 3, 4)))


class NhwcInNchwToo(nn.Module):
    """A ConvNeXt-style block: a permute to channels-last tokens, LayerNorm, a permute back, which leaves a map
    whose memory is NHWC in NCHW too; then ``use`` of it: ``'contiguous'`` zeroes two channels of
    ``m.contiguous()``, ``'reshape'`` the first values of ``m.reshape(n, -1)`` (copies in NCHW as well, so
    neither write may reach the map); ``'dropout'`` drops from it, and from a convolution of it (NCHW draws
    both masks in NHWC memory order)."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.mix = nn.Conv2d(4, 4, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.head = _head(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        if self.use == 'dropout':
            return self.head(self.drop(m) + self.drop(F.relu(self.mix(m))))
        if self.use == 'contiguous':
            copy = m.contiguous()
            copy[:, :2] = 0.0
        else:
            copy = m.reshape(len(m), -1)
            copy[:, :5] = 0.0
            copy = copy.reshape(m.shape)
        return self.head(m + 2.0 * copy)


MODELS = {
    **{
        f'{write}-{alloc}': functools.partial(FreshWrites, write, alloc)
        for write in ('index', 'slice', 'mask')
        for alloc in ('new_zeros', 'zeros')
    },
    'extension': functools.partial(AroundAnOp, RampOp.apply),  # makes its input contiguous: the break
    'registered-extension': functools.partial(AroundAnOp, registered_ramp),  # a torch.library op that does not
    'contiguous-view': ContiguousView,
    'video': Video2Plus1D,
    'nhwc-in-nchw-too-contiguous': functools.partial(NhwcInNchwToo, 'contiguous'),
    'nhwc-in-nchw-too-reshape': functools.partial(NhwcInNchwToo, 'reshape'),
    'nhwc-in-nchw-too-dropout': functools.partial(NhwcInNchwToo, 'dropout'),
}
EACH_MODEL = pytest.mark.parametrize('name', list(MODELS))
RANDOM = ('nhwc-in-nchw-too-dropout',)  # a plain loop only: the trainers draw random numbers of their own
EACH_DETERMINISTIC_MODEL = pytest.mark.parametrize('name', [name for name in MODELS if name not in RANDOM])


def build(name: str) -> nn.Module:
    """The model ``name`` in float64, its weights fixed by a seed."""
    torch.manual_seed(0)
    return MODELS[name]().double()


def batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` fixed float64 batches of ``BATCH`` NCHW images (N x 3 x T x H x W clips for video) and labels."""
    generator = torch.Generator().manual_seed(1)
    shape = (BATCH, 3, 4, 8, 8) if name == 'video' else (BATCH, 3, 8, 8)
    return [
        (torch.randn(shape, generator=generator, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,)))
        for _ in range(STEPS)
    ]


def loader(name: str) -> DataLoader:
    """:func:`batches` in their order (no shuffle)."""
    images, labels = zip(*batches(name))
    return DataLoader(TensorDataset(torch.cat(images), torch.cat(labels)), batch_size=BATCH)


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, the same for every run."""
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters and floating-point buffers (BatchNorm's running statistics)."""
    tensors = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    return {key: t.detach().clone() for key, t in tensors.items() if t.is_floating_point()}


def train(net: nn.Module, name: str, guard: LayoutGuard | None = None) -> list[tuple[torch.Tensor, dict]]:
    """``STEPS`` steps in a plain loop, through ``guard`` where given: each step's loss, :func:`snapshot` after it."""
    opt = optimizer(net)
    steps = []
    for images, labels in batches(name):
        if guard is not None:
            images, labels = guard.on_batch((images, labels))
        opt.zero_grad()
        with guard.step() if guard is not None else contextlib.nullcontext():
            loss = F.cross_entropy(net(images), labels)
            loss.backward()
        opt.step()
        steps.append((loss.detach().clone(), snapshot(net)))
    return steps


@functools.cache
def reference(name: str) -> list[tuple[torch.Tensor, dict]]:
    """The model trained in NCHW, without the package."""
    return train(build(name), name)


def assert_converted(net: nn.Module) -> None:
    """Every convolution weight channels last (channels_last_3d for Conv3d), and some of them restrided:
    not the ambiguous kind (1x1, depthwise) that is both."""
    weights = [m.weight for m in net.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    for w in weights:
        assert w.is_contiguous(memory_format=torch.channels_last if w.dim() == 4 else torch.channels_last_3d)
    assert any(not w.is_contiguous() for w in weights), 'no convolution weight was restrided'


def differs(where: str, step: int, what: str) -> Callable[[str], str]:
    """``assert_close``'s message, naming the run, the step and the tensor."""
    return lambda text: f'{where}, step {step}: {what} differs from NCHW training. {text}'


def assert_same_run(steps: list[tuple[torch.Tensor, dict]], name: str, where: str) -> None:
    """Every step's loss, and every parameter and statistic after it, equal to the NCHW run's."""
    expected = reference(name)
    assert len(steps) == len(expected) == STEPS, f'{where}: {len(steps)} steps recorded'
    for step, ((loss, tensors), (nchw_loss, nchw_tensors)) in enumerate(zip(steps, expected), 1):
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, nchw_loss, **TOLERANCE, msg=differs(where, step, 'loss'))
        assert tensors.keys() == nchw_tensors.keys()
        for key, value in nchw_tensors.items():
            torch.testing.assert_close(tensors[key], value, **TOLERANCE, msg=differs(where, step, key))


def test_the_extension_op_reads_memory_order():
    """RampOp's raw read gives other numbers for NHWC memory: it would catch an NHWC tensor claiming contiguity."""
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    nhwc = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(nhwc, x)
    assert not torch.allclose(ramp_over_memory(nhwc), ramp_over_memory(x))


@AUDITS
@EACH_MODEL
def test_plain_loop_with_layout_guard_matches_nchw(name, audit_steps):
    """LayoutGuard in a plain loop: on_init, on_batch, step() around forward, loss and backward."""
    net = build(name)
    guard = LayoutGuard(audit_steps=audit_steps)
    guard.on_init(net)
    assert_converted(net)
    assert_same_run(train(net, name, guard), name, f'LayoutGuard(audit_steps={audit_steps})')
    assert guard.report is not None and guard.report.steps == audit_steps


@AUDITS
def test_the_dropout_path_cuda_takes_matches_nchw_under_the_guard(audit_steps, monkeypatch):
    """CUDA's dropout safe path (the kernel run on a copy laid out as NCHW's input), here through the CPU's
    kernel: a view watch, which re-draws what the model's code draws itself, leaves that draw alone."""
    monkeypatch.setattr(safe_paths, '_FUSED_DROPOUT_DEVICES', ('cpu',))
    test_plain_loop_with_layout_guard_matches_nchw('nhwc-in-nchw-too-dropout', audit_steps)


@AUDITS
@EACH_DETERMINISTIC_MODEL
def test_composer_algorithm_matches_nchw(name, audit_steps):
    """The Composer algorithm in a Trainer, the same optimizer and data order as the NCHW run."""
    pytest.importorskip('composer')
    from composer import Callback, Trainer
    from composer.models import ComposerModel

    from channels_last_algo.integrations.composer import ChannelsLast

    class Classifier(ComposerModel):
        """``net`` on the batch's images, cross-entropy on its labels."""

        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, batch):
            return self.net(batch[0])

        def loss(self, outputs, batch):
            return F.cross_entropy(outputs, batch[1])

    class Record(Callback):
        """Each batch's loss and the network's tensors after its optimizer step."""

        def __init__(self, net: nn.Module) -> None:
            self.net, self.steps = net, []

        def batch_end(self, state, logger) -> None:
            self.steps.append((state.loss.detach().clone(), snapshot(self.net)))

    net = build(name)
    record = Record(net)
    algorithm = ChannelsLast(audit_steps=audit_steps)
    trainer = Trainer(
        model=Classifier(net),
        train_dataloader=loader(name),
        optimizers=optimizer(net),
        max_duration=f'{STEPS}ba',
        device='cpu',
        algorithms=[algorithm],
        callbacks=[record],
        progress_bar=False,
    )
    assert_converted(net)
    try:
        trainer.fit()
    finally:
        trainer.close()  # now, not when the Trainer is collected during another test
    assert_same_run(record.steps, name, f'ChannelsLast(audit_steps={audit_steps})')
    assert algorithm.report is not None and algorithm.report.steps == audit_steps


@AUDITS
@EACH_DETERMINISTIC_MODEL
def test_lightning_callback_matches_nchw(name, audit_steps):
    """The Lightning callback in a Trainer, the same optimizer and data order as the NCHW run."""
    pytest.importorskip('lightning')
    import lightning as L

    from channels_last_algo.integrations.lightning import ChannelsLastCallback

    class Classifier(L.LightningModule):
        """Cross-entropy and SGD; each batch's loss and the network's tensors after its optimizer step."""

        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            self.steps: list[tuple[torch.Tensor, dict]] = []
            self.converted_at_start: bool | None = None

        def on_train_start(self) -> None:
            assert_converted(self.net)
            self.converted_at_start = True

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return F.cross_entropy(self.net(images), labels)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.steps.append((outputs['loss'].detach().clone(), snapshot(self.net)))

        def configure_optimizers(self):
            return optimizer(self.net)

    module = Classifier(build(name))
    callback = ChannelsLastCallback(audit_steps=audit_steps)
    trainer = lightning_trainer(
        callbacks=[callback],
        max_steps=STEPS,
    )
    trainer.fit(module, train_dataloaders=loader(name))
    assert module.converted_at_start
    assert_same_run(module.steps, name, f'ChannelsLastCallback(audit_steps={audit_steps})')
    assert callback.report is not None and callback.report.steps == audit_steps
