"""The Composer integration: ChannelsLast driving the guard from Trainer events."""

import functools
import logging

import pytest

pytest.importorskip('composer')

import torch
from composer import Trainer
from composer.algorithms import ChannelsLast as ComposersChannelsLast
from composer.loggers import InMemoryLogger
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import ChannelsLast, LayoutBreakError, has_channels_last_strides, is_channels_last
from channels_last_algo.app.runs.demo import TinyResNet
from channels_last_algo.core import auto_mode as auto_mode_module
from channels_last_algo.core.auto import decide_layout
from conftest import breaking_model, no_dispatch_mode, random_images, tiny_loader


@pytest.mark.parametrize('place', ['algorithms', 'callbacks'])
def test_composer_trainer_feeds_nhwc_in_train_eval_and_predict(place):
    """As one of the Trainer's algorithms or its callbacks."""
    images, labels = random_images(n=24)
    loader = DataLoader(TensorDataset(images, labels), batch_size=8)
    module = TinyResNet()
    seen, grads = [], []
    module.register_forward_pre_hook(lambda mod, args: seen.append(is_channels_last(args[0])))
    for p in module.parameters():
        if p.dim() == 4:
            p.register_post_accumulate_grad_hook(lambda p: grads.append(has_channels_last_strides(p.grad)))
    model = ComposerClassifier(module, num_classes=10)
    algorithm = ChannelsLast()
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        eval_dataloader=loader,
        max_duration='2ba',
        device='cpu',
        **{place: [algorithm]},
        progress_bar=False,
    )
    assert all(has_channels_last_strides(p) for p in module.parameters() if p.dim() == 4)
    trainer.fit()
    train_and_eval = len(seen)
    assert train_and_eval >= 2 + 3  # two training batches and the three evaluation batches
    trainer.predict(loader)
    assert len(seen) == train_and_eval + 3
    assert all(seen)
    assert len(grads) == 2 * len([p for p in module.parameters() if p.dim() == 4])
    assert all(grads)


@pytest.mark.parametrize(
    'places',
    [
        {'algorithms': [ChannelsLast, ChannelsLast]},
        {'algorithms': [ChannelsLast], 'callbacks': [ChannelsLast]},
        {'callbacks': [ChannelsLast, ChannelsLast]},
        {'algorithms': [ChannelsLast, ComposersChannelsLast]},
        {'algorithms': [ComposersChannelsLast], 'callbacks': [ChannelsLast]},
    ],
    ids=['AA', 'AC', 'CC', "A + Composer's A", "Composer's A + C"],
)
def test_a_trainer_with_channels_last_twice_is_refused_before_the_model_is_touched(places):
    """Twice this project's, or beside Composer's (which, listed first among the algorithms, restrides the model
    before this one refuses: Composer runs callbacks first at ``Event.INIT``, then the algorithms in order)."""
    module = TinyResNet()
    weights = [p for p in module.parameters() if p.dim() == 4]
    with pytest.raises(
        ValueError, match=r"ChannelsLast 2 times \(\w+\[0\]( \(Composer's\))?, \w+\[\d\]( \(Composer's\))?\): keep one"
    ):
        Trainer(
            model=ComposerClassifier(module, num_classes=10),
            train_dataloader=tiny_loader(),
            max_duration='1ba',
            device='cpu',
            progress_bar=False,
            **{place: [algorithm() for algorithm in algorithms] for place, algorithms in places.items()},
        )
    assert all(w.is_contiguous() for w in weights)


def test_repr_rebuilds_the_algorithm():
    algorithm = ChannelsLast()
    assert repr(eval(repr(algorithm), {'ChannelsLast': ChannelsLast})) == repr(algorithm)


def test_the_algorithm_pickles_and_copies_on_a_guard_of_its_own():
    """A trainer pickled or deep-copied with its algorithms (the guard's weak tables failed to pickle) keeps the
    options; the copy converts a model as the original would."""
    import copy
    import pickle

    algorithm = ChannelsLast(mode='on', audit_steps=1, fuse_eval=True)
    for copied in (pickle.loads(pickle.dumps(algorithm)), copy.deepcopy(algorithm)):
        assert repr(copied) == repr(algorithm) and copied.guard is not algorithm.guard
        model = TinyResNet()
        copied.guard.on_init(model)
        assert all(has_channels_last_strides(p) for p in model.parameters() if p.dim() == 4)


def test_audit_steps_zero_installs_nothing_in_composer():
    module = TinyResNet()
    modes = []
    module.register_forward_pre_hook(lambda mod, args: modes.append(no_dispatch_mode()))
    trainer = Trainer(
        model=ComposerClassifier(module, num_classes=10),
        train_dataloader=tiny_loader(),
        max_duration='2ba',
        device='cpu',
        algorithms=[ChannelsLast()],
        progress_bar=False,
    )
    trainer.fit()
    assert modes == [True, True]


@pytest.mark.parametrize('place', ['algorithms', 'callbacks'])
def test_composer_audit_logs_each_audited_step_and_keeps_the_report(place):
    in_memory = InMemoryLogger()
    algorithm = ChannelsLast(audit_steps=1)
    trainer = Trainer(
        model=ComposerClassifier(breaking_model(), num_classes=10),
        train_dataloader=tiny_loader(),
        max_duration='2ba',
        device='cpu',
        **{place: [algorithm]},
        loggers=[in_memory],
        progress_bar=False,
    )
    trainer.fit()
    breaks = in_memory.data['channels_last/layout_breaks']
    assert len(breaks) == 1 and breaks[0][1] >= 1
    assert in_memory.data['channels_last/break_bytes'][0][1] > 0
    assert algorithm.report.steps == 1
    assert algorithm.report.breaks[0].module_path == 'module.1'


@pytest.mark.parametrize('place', ['algorithms', 'callbacks'])
def test_composer_strict_raises_out_of_fit_with_the_module_path(place):
    trainer = Trainer(
        model=ComposerClassifier(breaking_model(), num_classes=10),
        train_dataloader=tiny_loader(),
        max_duration='2ba',
        device='cpu',
        **{place: [ChannelsLast(audit_steps=2, strict=True)]},
        progress_bar=False,
    )
    with pytest.raises(LayoutBreakError, match="module 'module.1'.*aten.clone"):
        trainer.fit()
    assert no_dispatch_mode()


def test_resnet_trains_clean_under_strict_audit_in_composer():
    from torchvision.models import resnet18

    algorithm = ChannelsLast(audit_steps=1, strict=True)
    trainer = Trainer(
        model=ComposerClassifier(resnet18(weights=None, num_classes=10), num_classes=10),
        train_dataloader=tiny_loader(n=4),
        max_duration='1ba',
        device='cpu',
        algorithms=[algorithm],
        progress_bar=False,
    )
    trainer.fit()
    assert algorithm.report.ok and algorithm.report.steps == 1


def test_fuse_eval_without_a_network_in_module_or_one_child_with_parameters_is_refused_at_init():
    """Refused when the Trainer is built (Event.INIT), before any training is spent."""
    from composer.models import ComposerModel
    from torch import nn

    class TwoNetworks(ComposerModel):
        def __init__(self):
            super().__init__()
            self.net, self.head = TinyResNet(), nn.Linear(10, 10)

        def forward(self, batch):
            return self.head(self.net(batch[0]))

        def loss(self, outputs, batch):
            return nn.functional.cross_entropy(outputs, batch[1])

    with pytest.raises(ValueError, match=r'keeps in .module.*one child that holds parameters.*2 such children'):
        Trainer(
            model=TwoNetworks(),
            train_dataloader=tiny_loader(),
            max_duration='1ba',
            device='cpu',
            algorithms=[ChannelsLast(fuse_eval=True)],
            progress_bar=False,
        )


def test_fuse_eval_fuses_the_one_child_with_parameters_of_a_model_called_with_a_batch_mapping(monkeypatch):
    """transformers' models in Composer's HuggingFaceModel: the network in ``.model``, called ``self.model(**batch)``;
    the fused copy is checked on the batch's ``pixel_values``, its forward's first argument."""
    from composer.metrics import CrossEntropy
    from composer.models import ComposerModel
    from torch import nn

    class Network(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = TinyResNet()

        def forward(self, pixel_values, labels=None):
            return self.net(pixel_values)

    class MappingModel(ComposerModel):
        def __init__(self):
            super().__init__()
            self.model, self.metric = Network(), CrossEntropy()

        def forward(self, batch):
            return self.model(**batch)

        def loss(self, outputs, batch):
            return nn.functional.cross_entropy(outputs, batch['labels'])

        def get_metrics(self, is_train=False):
            return {'CrossEntropy': self.metric}

        def update_metric(self, batch, outputs, metric):
            metric.update(outputs, batch['labels'])

    from channels_last_algo.core.fuse import evaluation

    fused, fuse = [], evaluation.fuse_for_inference
    monkeypatch.setattr(evaluation, 'fuse_for_inference', lambda *args: fused.append(args) or fuse(*args))
    images, labels = random_images(8)
    batches = [{'pixel_values': image, 'labels': label} for image, label in zip(images, labels)]
    losses = {}
    for fuse_eval in (False, True):
        torch.manual_seed(0)
        model = MappingModel()
        trainer = Trainer(
            model=model,
            train_dataloader=DataLoader(batches, batch_size=4),
            eval_dataloader=DataLoader(batches, batch_size=4),
            max_duration='2ba',
            device='cpu',
            algorithms=[ChannelsLast(fuse_eval=fuse_eval)],
            progress_bar=False,
        )
        trainer.fit()
        losses[fuse_eval] = float(trainer.state.eval_metric_values['CrossEntropy'])
    ((network, example),) = fused  # one evaluation pass, on a copy checked on the first batch's images
    assert isinstance(network, Network) and example.shape == (4, 3, 16, 16)
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


@pytest.mark.parametrize('place', ['algorithms', 'callbacks'])
def test_composer_console_shows_the_start_block_once_before_its_config_and_the_breaks_left(place, capfd, caplog):
    caplog.set_level(logging.INFO, logger='channels_last_algo')
    in_memory = InMemoryLogger()
    trainer = Trainer(
        model=ComposerClassifier(breaking_model(), num_classes=10),  # a break at module.1, global pooling at module.3
        train_dataloader=tiny_loader(),
        max_duration='2ba',
        device='cpu',
        **{place: [ChannelsLast(audit_steps=1)]},
        loggers=[in_memory],
    )
    trainer.fit()
    captured = capfd.readouterr()
    assert captured.out == ''
    console = captured.err  # Composer's console stream, the progress bar's too
    start = 'channels last: ComposerClassifier: weights channels last (no sharding'
    assert console.count(start) == 1 and console.index(start) < console.index('Config:')
    assert '  repaired    1 layer: global_avg_pool at module.3\n' in console
    assert 'channels last: layout audit of 1 training step: 1 layout break left in the model' in console
    assert 'module.1  aten.clone.default (forward)  1x' in console
    hyperparameters = in_memory.hyperparameters
    assert hyperparameters['channels_last/repair_rules'] == 'global_avg_pool'
    assert hyperparameters['channels_last/weight_layout'] == 'channels_last'
    assert hyperparameters['channels_last/restrided_tensors'] == 2
    assert hyperparameters['channels_last/audit_breaks'] == 1
    summaries = [r for r in caplog.records if 'tensors restrided' in r.getMessage()]
    assert [r.name for r in summaries] == ['channels_last_algo.core.convert']  # logged once, by the conversion


def test_composer_auto_mode_says_what_it_times_and_what_it_kept(capsys, monkeypatch):
    monkeypatch.setattr(auto_mode_module, 'decide_layout', functools.partial(decide_layout, max_rounds=2, warmup=0))
    algorithm = ChannelsLast(mode='auto')
    trainer = Trainer(
        model=ComposerClassifier(TinyResNet(), num_classes=10),
        train_dataloader=tiny_loader(),
        max_duration='1ba',
        device='cpu',
        algorithms=[algorithm],
        progress_bar=False,
        log_to_console=True,
    )
    built = capsys.readouterr().err  # auto mode decides in the constructor (Event.AFTER_LOAD)
    timing = 'auto layout: timing channels first (NCHW) against channels last on the first training batch'
    assert built.index(timing) < built.index(str(algorithm.decision))
    trainer.fit()
    assert '  auto        kept channels last' in capsys.readouterr().err


def test_composer_console_writes_on_rank_zero_only(monkeypatch, capsys):
    from composer.loggers import ConsoleLogger, Logger

    from channels_last_algo.integrations import composer as integration

    logger = Logger(state=None, destinations=[ConsoleLogger(stream='stderr')])
    integration._write_to_console(logger, 'shown')
    monkeypatch.setattr(integration.dist, 'get_global_rank', lambda: 1)
    integration._write_to_console(logger, 'not shown')
    assert capsys.readouterr().err == 'shown\n'


class _FailsInTraining(TinyResNet):
    def forward(self, x):
        if self.training:
            raise RuntimeError('the model broke')
        return super().forward(x)


def test_an_audited_step_that_raises_leaves_no_audit_behind_once_the_trainer_closes():
    """The audit of the first step is a dispatch mode over every op: a step that raises must not leave
    it on for the rest of the process (a later ONNX export of another model failed under it)."""
    trainer = Trainer(
        model=ComposerClassifier(_FailsInTraining(), num_classes=10),
        train_dataloader=tiny_loader(),
        max_duration='2ba',
        device='cpu',
        algorithms=[ChannelsLast(audit_steps=1)],
        progress_bar=False,
    )
    with pytest.raises(RuntimeError, match='the model broke'):
        trainer.fit()
    trainer.close()
    assert no_dispatch_mode()
