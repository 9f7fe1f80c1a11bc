"""Batches of every container kind: the images reach the model NHWC, and training computes what NCHW training does.

A data loader may yield dataclasses, namedtuples, dicts of lists, ``SimpleNamespace``, ``UserDict``
subclasses (HuggingFace's ``BatchFeature``), dict subclasses (EasyDict), or an object of its own. Each
case trains a small conv net 3 SGD steps (float64, fixed data) through :class:`LayoutGuard` in a plain
loop; every step's loss and every parameter after it must equal those of the same net trained in NCHW
without the package, and the batch the loader gave must come back unchanged. An object the package
cannot copy is left as it came, with one warning. A dense ``(N, 3, H, W)`` target, which the first
batch's guess takes for an image, must be channels first again when the loss ``.view()``s it (plain
loop, Composer, Lightning).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layout import batch_to_channels_last, is_channels_last

STEPS = 3
BATCH = 2
CLASSES = 3
TOLERANCE = dict(rtol=1e-10, atol=1e-10)


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    """Frozen, its image an ``init=False`` field made from an ``InitVar``: no constructor can rebuild it."""

    pixels: dataclasses.InitVar[torch.Tensor]
    label: torch.Tensor
    image: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self, pixels: torch.Tensor) -> None:
        object.__setattr__(self, 'image', pixels)


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


class Features(collections.UserDict):
    """Like HuggingFace's ``BatchFeature``: a ``UserDict`` whose items read as attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


class EasyDict(dict):
    """Like ``easydict.EasyDict``: a dict whose items are attributes too."""

    def __init__(self, **items: Any) -> None:
        super().__init__()
        for key, value in items.items():
            setattr(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        super().__setitem__(name, value)

    __setitem__ = __setattr__


class Sealed:
    """A batch object of its own that refuses to be copied."""

    def __init__(self, image: torch.Tensor, label: torch.Tensor) -> None:
        self.image, self.label = image, label

    def __copy__(self) -> Sealed:
        raise TypeError('Sealed batches cannot be copied')


Pack = Callable[[torch.Tensor, torch.Tensor], Any]
Unpack = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
CONTAINERS: dict[str, tuple[Pack, Unpack]] = {
    'dataclass': (Sample, lambda b: (b.image, b.label)),
    'frozen-dataclass': (FrozenSample, lambda b: (b.image, b.label)),
    'namedtuple': (Pair, lambda b: (b.image, b.label)),
    'dict-of-lists': (lambda x, y: {'images': [x], 'labels': [y]}, lambda b: (b['images'][0], b['labels'][0])),
    'namespace': (lambda x, y: types.SimpleNamespace(image=x, label=y), lambda b: (b.image, b.label)),
    'userdict': (lambda x, y: Features(image=x, label=y), lambda b: (b.image, b['label'])),
    'easydict': (lambda x, y: EasyDict(image=x, label=y), lambda b: (b.image, b['label'])),
}


def build(out_channels: int = 0) -> nn.Module:
    """A float64 conv net on 3-channel images: class scores, or a dense ``out_channels`` map."""
    torch.manual_seed(0)
    if out_channels:
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, out_channels, 3, padding=1)
        ).double()
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, CLASSES),
    ).double()


def data(dense: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` fixed NCHW float64 images, with labels or with dense ``(N, 3, H, W)`` targets."""
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(BATCH, 3, 8, 8, generator=generator, dtype=torch.float64) for _ in range(STEPS)]
    if dense:
        return [(x, torch.randn(x.shape, generator=generator, dtype=torch.float64)) for x in images]
    return [(x, torch.randint(0, CLASSES, (BATCH,), generator=generator)) for x in images]


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    return {key: p.detach().clone() for key, p in net.named_parameters()}


def label_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, labels)


def dense_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss views the target flat, as many dense losses do."""
    n = target.shape[0]
    return (out.reshape(n, -1) - target.view(n, -1)).square().mean()


def train(
    net: nn.Module, pack: Pack, unpack: Unpack, guard: LayoutGuard | None = None, dense: bool = False
) -> tuple[list[tuple[torch.Tensor, dict]], list[bool]]:
    """``STEPS`` SGD steps in a plain loop: each step's loss and parameters, and whether the net got NHWC images."""
    seen: list[bool] = []
    net.register_forward_pre_hook(lambda module, args: seen.append(is_channels_last(args[0])))
    if guard is not None:
        guard.on_init(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    steps = []
    for images, labels in data(dense):
        given = pack(images, labels)
        batch = guard.on_batch(given) if guard is not None else given
        assert all(a is b for a, b in zip(unpack(given), (images, labels))), "on_batch changed the loader's batch"
        opt.zero_grad()
        with guard.step() if guard is not None else contextlib.nullcontext():
            x, y = unpack(batch)
            loss = (dense_loss if dense else label_loss)(net(x), y)
            loss.backward()
        opt.step()
        steps.append((loss.detach().clone(), snapshot(net)))
    return steps, seen


def differs(step: int, what: str) -> Callable[[str], str]:
    """``assert_close``'s message, naming the step and the tensor."""
    return lambda text: f'step {step}: {what} differs from NCHW training. {text}'


def assert_same_run(steps: list, expected: list) -> None:
    """Every step's loss, and every parameter after it, equal to the NCHW run's."""
    assert len(steps) == len(expected) == STEPS
    for step, ((loss, tensors), (nchw_loss, nchw_tensors)) in enumerate(zip(steps, expected)):
        torch.testing.assert_close(loss, nchw_loss, **TOLERANCE, msg=differs(step, 'loss'))
        for key, value in nchw_tensors.items():
            torch.testing.assert_close(tensors[key], value, **TOLERANCE, msg=differs(step, key))


def reference(dense: bool = False) -> list:
    """The net trained on tuples in NCHW, without the package."""
    return train(build(CLASSES if dense else 0), lambda x, y: (x, y), lambda b: b, dense=dense)[0]


@pytest.mark.parametrize('name', list(CONTAINERS))
def test_a_container_batch_reaches_the_model_nhwc_and_trains_as_nchw(name):
    pack, unpack = CONTAINERS[name]
    steps, seen = train(build(), pack, unpack, LayoutGuard())
    assert seen == [True] * STEPS, f'{name}: the images did not reach the model NHWC at every step'
    assert_same_run(steps, reference())


@pytest.mark.parametrize('name', ['dataclass', 'frozen-dataclass', 'namespace', 'easydict'])
def test_inputs_names_a_field_or_an_attribute(name):
    pack, unpack = CONTAINERS[name]
    images, labels = data()[0]
    out = LayoutGuard(inputs=['image']).on_batch(pack(images, labels))
    assert type(out) is type(pack(images, labels)) and is_channels_last(unpack(out)[0])
    assert unpack(out)[1] is labels


def test_batch_to_channels_last_opens_a_dataclass():
    images, labels = data()[0]
    given = Sample(images, labels)
    out = batch_to_channels_last(given)
    assert is_channels_last(out.image) and out.label is labels
    assert given.image is images


def test_an_object_that_cannot_be_copied_is_left_as_it_came_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger='channels_last_algo')
    steps, seen = train(build(), Sealed, lambda b: (b.image, b.label), LayoutGuard())
    assert seen == [False] * STEPS
    assert_same_run(steps, reference())
    warnings = [r.getMessage() for r in caplog.records if 'Sealed' in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert 'Sealed batches cannot be copied' in warnings[0]
    assert 'stay as they came' in warnings[0] and 'tuple, list or dict' in warnings[0]


def test_a_dense_target_the_first_guess_restrided_is_viewed_in_the_loss():
    """Its channel count is a convolution's, so the first batch's guess makes it NHWC; no convolution
    takes it, so it is channels first again, in the batch's own tensor, before the loss views it."""
    steps, seen = train(build(CLASSES), lambda x, y: (x, y), lambda b: b, LayoutGuard(), dense=True)
    assert seen == [True] * STEPS
    assert_same_run(steps, reference(dense=True))


@pytest.mark.parametrize('integration', ['composer', 'lightning'])
@pytest.mark.parametrize('mode', ['on', 'auto'])
def test_a_trainer_dense_target_viewed_in_the_loss(integration, mode):
    """The same through the Composer algorithm and the Lightning callback: the loss views the target; auto
    mode's trial steps (some channels first, unwatched) get the batch as it came, its target not guessed NHWC."""
    from guarded_runs import Run, guarded

    run = Run(lambda: build(CLASSES), data(dense=True), lambda out, batch: dense_loss(out, batch[1]))
    steps, _, _ = guarded(run, integration, mode=mode)
    assert_same_run(steps, reference(dense=True))


def test_lightning_trains_on_dataclass_batches_as_nchw():
    """A data loader yielding dataclasses, through the Lightning callback: the same run as NCHW's."""
    pytest.importorskip('lightning')
    from guarded_runs import Run, assert_same_run, guarded, nchw

    generator = torch.Generator().manual_seed(1)
    batches = [
        Sample(
            torch.randn(BATCH, 3, 8, 8, generator=generator, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,))
        )
        for _ in range(STEPS)
    ]
    seen = []

    def forward(net, batch):
        seen.append(is_channels_last(batch.image))
        return net(batch.image)

    run = Run(build, batches, lambda out, batch: F.cross_entropy(out, batch.label), forward=forward)
    expected = nchw(run)
    seen.clear()
    steps, _, _ = guarded(run, 'lightning')
    assert_same_run(steps, expected, 'dataclass batches through Lightning')
    assert seen == [True] * STEPS
