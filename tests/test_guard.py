"""The guard's audit of training steps, in a plain loop and through Composer's events."""

import pytest
import torch
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils import _python_dispatch
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import ChannelsLast, LayoutBreakError, LayoutGuard
from channels_last_algo.app.demo import TinyResNet


class _DropsNHWC(nn.Module):
    """A layer that hands its NHWC input on as NCHW: one break in forward."""

    def forward(self, x):
        return x.contiguous()


def _breaking_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _DropsNHWC(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _loader(n=8):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 16, 16, generator=generator), torch.randint(0, 10, (n,), generator=generator))
    return DataLoader(data, batch_size=4)


def _no_dispatch_mode():
    return _python_dispatch._get_current_dispatch_mode() is None


def test_plain_loop_audits_the_first_steps_then_installs_nothing():
    model = TinyResNet()
    guard = LayoutGuard(audit_steps=2)
    guard.on_init(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    modes = []
    model.register_forward_pre_hook(lambda mod, args: modes.append(not _no_dispatch_mode()))
    for images, labels in _loader(n=12):
        images, labels = guard.on_batch((images, labels))
        with guard.step():
            nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert modes == [True, True, False]
    report = guard.report
    assert report.steps == 2 and report.ok
    # the flatten of the globally pooled N x C x 1 x 1 tensor: a free exit, once per step
    assert [(e.module_path, e.op, e.nbytes) for e in report.exits] == [('', 'aten.view.default', 0)] * 2
    assert _no_dispatch_mode()


def test_plain_loop_strict_names_the_module_and_leaves_nothing_installed():
    model = _breaking_model()
    guard = LayoutGuard(audit_steps=1, strict=True)
    guard.on_init(model)
    images, labels = guard.on_batch(next(iter(_loader())))
    with pytest.raises(LayoutBreakError, match="module '1'"):
        with guard.step():
            nn.functional.cross_entropy(model(images), labels).backward()
    assert _no_dispatch_mode()
    assert guard.report.breaks[0].module_path == '1'


def test_an_exception_inside_an_audited_step_stops_the_audit():
    model = TinyResNet()
    guard = LayoutGuard(audit_steps=3)
    guard.on_init(model)
    with pytest.raises(ZeroDivisionError):
        with guard.step():
            model(guard.on_batch(torch.randn(2, 3, 16, 16)))
            1 / 0
    assert _no_dispatch_mode()


def test_audit_steps_zero_installs_nothing_in_composer():
    module = TinyResNet()
    modes = []
    module.register_forward_pre_hook(lambda mod, args: modes.append(_no_dispatch_mode()))
    trainer = Trainer(model=ComposerClassifier(module, num_classes=10), train_dataloader=_loader(),
                      max_duration='2ba', device='cpu', algorithms=[ChannelsLast()], progress_bar=False)
    trainer.fit()
    assert modes == [True, True]


def test_composer_audit_logs_each_audited_step_and_keeps_the_report():
    in_memory = InMemoryLogger()
    algorithm = ChannelsLast(audit_steps=1)
    trainer = Trainer(model=ComposerClassifier(_breaking_model(), num_classes=10), train_dataloader=_loader(),
                      max_duration='2ba', device='cpu', algorithms=[algorithm], loggers=[in_memory],
                      progress_bar=False)
    trainer.fit()
    breaks = in_memory.data['channels_last/layout_breaks']
    assert len(breaks) == 1 and breaks[0][1] >= 1
    assert in_memory.data['channels_last/break_bytes'][0][1] > 0
    assert algorithm.report.steps == 1
    assert algorithm.report.breaks[0].module_path == 'module.1'


def test_composer_strict_raises_out_of_fit_with_the_module_path():
    trainer = Trainer(model=ComposerClassifier(_breaking_model(), num_classes=10), train_dataloader=_loader(),
                      max_duration='2ba', device='cpu', algorithms=[ChannelsLast(audit_steps=2, strict=True)],
                      progress_bar=False)
    with pytest.raises(LayoutBreakError, match="module 'module.1'.*aten.clone"):
        trainer.fit()
    assert _no_dispatch_mode()


def test_resnet_trains_clean_under_strict_audit_in_composer():
    from torchvision.models import resnet18

    algorithm = ChannelsLast(audit_steps=1, strict=True)
    trainer = Trainer(model=ComposerClassifier(resnet18(weights=None, num_classes=10), num_classes=10),
                      train_dataloader=_loader(n=4), max_duration='1ba', device='cpu', algorithms=[algorithm],
                      progress_bar=False)
    trainer.fit()
    assert algorithm.report.ok and algorithm.report.steps == 1
