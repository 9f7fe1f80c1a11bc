"""Kernel safe paths by what a layer computes: an RGB 1x1 stride-2 stem (the oneDNN weight-gradient
bug, which corrupts the heap) goes on its safe path as a subclass of ``nn.Conv2d`` that only
initialises itself differently and under a ``weight_norm`` parametrization, as it does as an
``nn.Conv2d``; a subclass with its own ``forward`` is not swapped, is named as not covered, and keeps
the model NCHW.

The training runs are child processes, one per case (a crash is a result, not a dead test runner),
through ``LayoutGuard``, Composer's ``ChannelsLast`` and Lightning's ``ChannelsLastCallback``, each
against the same net trained NCHW. Where the bug does not apply (another CPU, torch or device),
the runs check the numbers only, and the matching is checked for a runtime the bug affects.
"""

from __future__ import annotations

import functools
import importlib.util
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import LayoutGuard
from channels_last_algo.core.layers.safe_paths import SubsampledConv2d
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety import (
    KNOWN_BUGS,
    ProbeResult,
    make_safe,
    matching_bugs,
    run_isolated,
    unsafe_subclasses,
)
from channels_last_algo.core.swap import swap_back, swappable
from channels_last_algo.core.swap_records import UncoveredLayer

ONEDNN = next(bug for bug in KNOWN_BUGS if bug.name == 'onednn_1x1_strided_weight_grad')
XEON = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX512')
APPLIES_HERE = ONEDNN.affects(Runtime.current('cpu'))
STEPS = 3


class InitStem(nn.Conv2d):
    """A stem that only initialises its weight its own way: its forward is ``nn.Conv2d``'s."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class OwnForwardStem(nn.Conv2d):
    """A stem with its own forward, which a safe path would drop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def stem(case: str) -> nn.Module:
    """The RGB 1x1 stride-2 stem of each case: as its subclass, under weight_norm, with its own forward."""
    if case == 'reset_parameters':
        return InitStem(3, 16, 1, stride=2)
    if case == 'weight_norm':
        return weight_norm(nn.Conv2d(3, 16, 1, stride=2))
    return OwnForwardStem(3, 16, 1, stride=2)


def stem_net(case: str) -> nn.Module:
    """The stem, a 3x3 convolution and a linear head, the same weights for every call."""
    torch.manual_seed(0)
    layers = OrderedDict(
        stem=stem(case),
        act=nn.ReLU(),
        conv=nn.Conv2d(16, 16, 3, padding=1),
        pool=nn.AdaptiveAvgPool2d(1),
        flat=nn.Flatten(),
        head=nn.Linear(16, 10),
    )
    return nn.Sequential(layers)


def batches() -> DataLoader:
    """:data:`STEPS` batches of 2 x 3 x 128 x 128 (a shape that dies within a step without the safe path)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2 * STEPS, 3, 128, 128, generator=generator)
    return DataLoader(TensorDataset(images, torch.randint(0, 10, (2 * STEPS,), generator=generator)), batch_size=2)


def train_nchw(net: nn.Module) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for images, labels in batches():
        nn.functional.cross_entropy(net(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def train_guarded(net: nn.Module, **options: Any) -> LayoutGuard:
    guard = LayoutGuard(**options)
    guard.on_init(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for batch in batches():
        images, labels = guard.on_batch(batch)
        with guard.step():
            nn.functional.cross_entropy(net(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    guard.close()
    return guard


def train_composer(net: nn.Module) -> LayoutGuard:
    from composer import Trainer
    from composer.models import ComposerClassifier

    from channels_last_algo import ChannelsLast

    algorithm = ChannelsLast()
    trainer = Trainer(
        model=ComposerClassifier(net, num_classes=10),
        train_dataloader=batches(),
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        max_duration=f'{STEPS}ba',
        device='cpu',
        algorithms=[algorithm],
        progress_bar=False,
    )
    trainer.fit()
    trainer.close()
    return algorithm.guard


def train_lightning(net: nn.Module) -> LayoutGuard:
    import lightning as L

    from channels_last_algo import ChannelsLastCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = ChannelsLastCallback()
    trainer = L.Trainer(
        accelerator='cpu',
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Classifier(), train_dataloaders=batches())
    return callback.guard


TRAINERS = {'guard': train_guarded, 'composer': train_composer, 'lightning': train_lightning}


def relative_difference(trained: nn.Module, reference: nn.Module) -> float:
    """The largest difference between the two nets' parameters, relative to the largest reference value."""
    ours, theirs = dict(trained.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in theirs)


def train_case(case: str, trainers: list[str]) -> dict[str, Any]:
    """In a child process: ``stem_net(case)`` trained NCHW, then by each of ``trainers`` with channels last; per
    trainer, what the conversion did to the stem and how far the trained parameters are apart, or what it raised."""
    reference = stem_net(case)
    train_nchw(reference)
    results: dict[str, Any] = {}
    for trainer in trainers:
        net = stem_net(case)
        try:
            guard = TRAINERS[trainer](net)
        except Exception:  # the other trainers still run; the test of this one shows it
            results[trainer] = traceback.format_exc()
            continue
        results[trainer] = {
            'made_safe': [(r.path, r.reason, r.original, r.replacement) for r in guard.summary.made_safe],
            'not_covered': guard.summary.not_covered,
            'stem_classes': [cls.__name__ for cls in type(net.stem).__mro__[:4]],
            'parametrized': parametrize.is_parametrized(net.stem),
            'difference': relative_difference(net, reference),
            'channels_last_weights': net.conv.weight.is_contiguous(memory_format=torch.channels_last),
            'start_block': guard.start_block.lines,
        }
    return results


@pytest.fixture(scope='module')
def trained() -> Callable[[str], ProbeResult]:
    """``train_case`` of a case with every installed trainer, in one child process per case (a crash is a result)."""
    trainers = [name for name in TRAINERS if name == 'guard' or importlib.util.find_spec(name) is not None]
    return functools.cache(lambda case: run_isolated(train_case, case, trainers))


def convert_case(case: str) -> dict[str, Any]:
    """In a child process: ``stem_net(case)`` converted by ``LayoutGuard``, nothing trained."""
    guard = LayoutGuard()
    guard.on_init(stem_net(case))
    return {'summary': guard.summary, 'start_block': guard.start_block.lines}


ORIGINALS = {
    'reset_parameters': f'{__name__}.InitStem',
    'weight_norm': 'torch.nn.utils.parametrize.ParametrizedConv2d',
}


@pytest.mark.parametrize('trainer', TRAINERS)
@pytest.mark.parametrize('case', ORIGINALS)
def test_a_stem_that_computes_as_conv2d_trains_on_the_safe_path_with_nchw_numbers(case, trainer, trained):
    if trainer != 'guard':
        pytest.importorskip(trainer)
    result = trained(case)
    assert result.ok, f'{case}: {result}\n{result.detail}'
    value = result.value[trainer]
    assert not isinstance(value, str), f'{case} under {trainer}: {value}'
    assert value['difference'] < 1e-4, value['difference']
    assert value['not_covered'] == []
    if not APPLIES_HERE:
        assert value['made_safe'] == []
        return
    [(path, reason, original, replacement)] = value['made_safe']
    assert path.rpartition('.')[2] == 'stem' and (reason, original) == (ONEDNN.name, ORIGINALS[case])
    assert replacement == 'SubsampledConv2d' and value['stem_classes'][1] == 'SubsampledConv2d'
    assert value['parametrized'] is (case == 'weight_norm')
    assert value['stem_classes'][3] == ORIGINALS[case].rpartition('.')[2]  # after the safe path and Replacement
    assert any(
        line.startswith('  safe paths  1 layer: onednn_1x1_strided_weight_grad') for line in value['start_block']
    )


def test_a_stem_with_its_own_forward_is_not_swapped_and_named_as_not_covered():
    result = run_isolated(convert_case, 'own_forward')
    assert result.ok, f'{result}\n{result.detail}'
    summary, lines = result.value['summary'], result.value['start_block']
    assert summary.made_safe == []
    if not APPLIES_HERE:
        assert summary.not_covered == [] and not any('not covered' in line for line in lines)
        return
    assert summary.not_covered == [
        UncoveredLayer('stem', 'safe_path', ONEDNN.name, f'{__name__}.OwnForwardStem', ('forward',))
    ]
    assert (
        '  not covered 1 layer: onednn_1x1_strided_weight_grad at stem (OwnForwardStem.forward): its class '
        "overrides what the swap replaces; keep the base class's forward to have it swapped"
    ) in lines
    assert summary.kept_channels_first == summary.not_covered and summary.converted == []
    assert lines[0].endswith(': kept NCHW') and any(line.startswith('  kept NCHW   layer stem') for line in lines)


@pytest.mark.parametrize('trainer', TRAINERS)
def test_a_stem_with_its_own_forward_trains_nchw_where_it_would_crash_channels_last(trainer, trained):
    """No safe path replaces it, and channels last there corrupts the heap (a crash, or a hang with AVX2): the
    model stays NCHW, its batches as they come, and trains as NCHW does, in every integration."""
    if trainer != 'guard':
        pytest.importorskip(trainer)
    result = trained('own_forward')
    assert result.ok, f'{result}\n{result.detail}'
    value = result.value[trainer]
    assert not isinstance(value, str), f'own_forward under {trainer}: {value}'
    assert value['difference'] < 1e-4, value['difference']
    assert value['made_safe'] == [] and value['stem_classes'][0] == 'OwnForwardStem'
    assert value['channels_last_weights'] == (not APPLIES_HERE)
    assert any(line.startswith('  kept NCHW') for line in value['start_block']) is APPLIES_HERE


def test_matching_treats_a_subclass_that_keeps_the_forward_as_its_base():
    """For a runtime the bug affects, whatever the machine running this."""
    stems = {case: stem(case) for case in ('reset_parameters', 'weight_norm', 'own_forward')}
    plain = nn.Conv2d(3, 16, 1, stride=2)
    assert ONEDNN.matches(plain, XEON) and swappable(plain, ONEDNN)
    assert ONEDNN.matches(stems['reset_parameters'], XEON) and ONEDNN.matches(stems['weight_norm'], XEON)
    assert ONEDNN.reaches(stems['own_forward'], XEON) and not ONEDNN.matches(stems['own_forward'], XEON)
    model = nn.Sequential(OrderedDict(stems))
    assert [(path, bug.name) for path, _, bug in matching_bugs(model, [XEON])] == [
        ('reset_parameters', ONEDNN.name),
        ('weight_norm', ONEDNN.name),
    ]
    assert [u.path for u in unsafe_subclasses(model, [XEON])] == ['own_forward']


def test_a_swapped_subclass_keeps_its_class_parametrizations_and_overrides_and_swaps_back_exactly():
    model = nn.Sequential(InitStem(3, 16, 1, stride=2), weight_norm(InitStem(3, 16, 1, stride=2)))
    before = [type(m) for m in model]
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    model.double()
    expected = model[1](x)
    assert [r.original for r in make_safe(model, runtimes=[XEON])] == [
        f'{__name__}.InitStem',
        'torch.nn.utils.parametrize.ParametrizedInitStem',
    ]
    for module, cls in zip(model, before):
        assert isinstance(module, cls) and isinstance(module, SubsampledConv2d)
    assert parametrize.is_parametrized(model[1], 'weight')
    torch.testing.assert_close(model[1](x), expected)
    assert type(model[0]).reset_parameters is InitStem.reset_parameters
    assert make_safe(model, runtimes=[XEON]) == [] and unsafe_subclasses(model, [XEON]) == []
    for module, cls in zip(model, before):
        swap_back(module, cls)
    assert [type(m) for m in model] == before


def train_with_contiguous_weights(case: str) -> dict[str, Any]:
    """In a child process: ``stem_net(case)`` trained by ``LayoutGuard(weights='contiguous')`` (contiguous weights,
    NHWC activations, as under sharding) and NCHW: what went on a safe path, and how far the two are apart."""
    reference, net = stem_net(case), stem_net(case)
    train_nchw(reference)
    guard = train_guarded(net, weights='contiguous')
    return {
        'made_safe': [(r.path, r.reason) for r in guard.summary.made_safe],
        'kept_channels_first': [u.path for u in guard.summary.kept_channels_first],
        'difference': relative_difference(net, reference),
        'contiguous': net.conv.weight.is_contiguous(),
        'start_block': guard.start_block.lines,
    }


def test_contiguous_weights_with_nhwc_activations_put_the_stem_on_its_safe_path():
    """NHWC activations reach the kernel bug with NCHW weights too: the run died with SIGSEGV before."""
    result = run_isolated(train_with_contiguous_weights, 'reset_parameters')
    assert result.ok, f'{result}\n{result.detail}'
    value = result.value
    assert value['difference'] < 1e-4 and value['contiguous'], value
    assert value['made_safe'] == ([('stem', ONEDNN.name)] if APPLIES_HERE else [])


def test_contiguous_weights_keep_nhwc_batches_from_a_stem_that_would_crash_and_keeps_its_class():
    result = run_isolated(train_with_contiguous_weights, 'own_forward')
    assert result.ok, f'{result}\n{result.detail}'
    value = result.value
    assert value['difference'] < 1e-4 and value['contiguous'] and value['made_safe'] == [], value
    assert value['kept_channels_first'] == (['stem'] if APPLIES_HERE else [])
    assert any(line.startswith('  batches     as they come') for line in value['start_block']) is APPLIES_HERE
