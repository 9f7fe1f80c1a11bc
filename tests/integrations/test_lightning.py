"""The Lightning integration: ChannelsLastCallback driving the guard from a Lightning Trainer.

Unit tests call the callback's handlers on a Trainer that never fits; the rest fit small
conv nets on the CPU. The 2-rank DDP test starts two processes itself (LOCAL_RANK, NODE_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT: Lightning then takes them as launched externally, with
gloo); run as that script (``python tests/integrations/test_lightning.py OUT``), this file is the rank's
program. As in tests/integrations/test_distributed.py, the single-process reference trains each global batch
in two microbatches, one rank's half each, so BatchNorm sees what it sees under DDP and the
parameters match.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip('lightning', reason='the Lightning integration needs lightning (the newest-torch environment)')

import lightning as L
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import channels_last_algo.core.auto_mode as auto_mode_module
from channels_last_algo import ChannelsLastCallback, LayoutBreakError, has_channels_last_strides, is_channels_last
from channels_last_algo.core.auto import LayoutDecision, decide_layout
from conftest import (
    STRIDE_WARNING,
    breaking_model,
    free_port,
    leave_rank,
    lightning_trainer,
    nhwc_bucket_views,
    no_dispatch_mode,
    random_images,
    small_net,
)

WORLD = 2
RANK_BATCH = 4
STEPS = 3
IMAGE = 12


class Classifier(L.LightningModule):
    """``net`` with cross-entropy and SGD; notes whether each forward's input was NHWC."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.net = small_net() if net is None else net
        self.lr = lr
        self.inputs_nhwc: list[bool] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.inputs_nhwc.append(is_channels_last(images))
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log('train_loss', loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log('val_loss', nn.functional.cross_entropy(self(images), labels))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Recording(Logger):
    """A logger that keeps what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []
        self.hyperparameters: dict = {}

    name = 'recording'
    version = 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        self.hyperparameters.update(params if isinstance(params, dict) else vars(params))


def loader(n: int = 16, batch_size: int = RANK_BATCH, seed: int = 0) -> DataLoader:
    images, labels = random_images(n=n, size=IMAGE, seed=seed)
    return DataLoader(TensorDataset(images, labels % 4), batch_size=batch_size)


def weights_4d(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in net.named_parameters() if p.dim() == 4}


def set_up(callback: ChannelsLastCallback, net: nn.Module | None = None, **options) -> tuple[L.Trainer, Classifier]:
    """A Trainer that never fits, its strategy holding a Classifier, and ``callback.setup`` called."""
    fit, module = lightning_trainer(**options), Classifier(net)
    fit.strategy.connect(module)
    callback.setup(fit, module, 'fit')
    return fit, module


@pytest.fixture
def quick_decisions(monkeypatch):
    """Auto mode decides on 2 paired rounds: real timing, bounded cost."""
    monkeypatch.setattr(auto_mode_module, 'decide_layout', functools.partial(decide_layout, max_rounds=2, warmup=0))


# --- the handlers, on a Trainer that never fits ----------------------------------------------------


def test_options_repr_and_bad_values():
    assert repr(ChannelsLastCallback(audit_steps=2)) == "ChannelsLastCallback(mode='on', audit_steps=2, strict=False)"
    assert (
        repr(ChannelsLastCallback(fuse_eval=True, repair=False))
        == "ChannelsLastCallback(mode='on', audit_steps=0, strict=False, repair=False, fuse_eval=True)"
    )
    with pytest.raises(ValueError, match='fuse_eval must be True or False'):
        ChannelsLastCallback(fuse_eval='yes')
    with pytest.raises(ValueError, match='mode must be'):
        ChannelsLastCallback(mode='sideways')
    with pytest.raises(ValueError, match='network must be the name'):
        ChannelsLastCallback(network=nn.Linear(2, 2))


def test_setup_follows_the_strategys_moves_and_teardown_unwraps():
    callback = ChannelsLastCallback()
    fit, module = set_up(callback)
    assert {'model_to_device', 'batch_to_device'} <= set(vars(fit.strategy))
    assert not any(has_channels_last_strides(p) for p in weights_4d(module).values())  # not before the move

    fit.strategy.model_to_device()
    assert all(has_channels_last_strides(p) for p in weights_4d(module).values())
    images, labels = random_images(n=2, size=IMAGE)
    moved_images, moved_labels = fit.strategy.batch_to_device((images, labels))
    assert is_channels_last(moved_images) and torch.equal(moved_images, images) and moved_labels is labels

    callback.teardown(fit, module, 'fit')
    assert not {'model_to_device', 'batch_to_device'} & set(vars(fit.strategy))
    assert not is_channels_last(fit.strategy.batch_to_device((images, labels))[0])


def test_mode_off_installs_nothing():
    fit, module = set_up(ChannelsLastCallback(mode='off'))
    fit.strategy.model_to_device()
    assert 'batch_to_device' not in vars(fit.strategy)
    assert not any(has_channels_last_strides(p) for p in weights_4d(module).values())


def test_sharding_strategies_keep_weights_contiguous_and_batches_nhwc():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from channels_last_algo.integrations.lightning import _weight_layout

    callback = ChannelsLastCallback(mode='auto')  # auto would time channels-last weights: 'on'
    fit, module = set_up(callback, strategy=ModelParallelStrategy())
    fit.strategy.model_to_device()
    assert callback.guard.effective_mode == 'on' and 'ModelParallelStrategy' in callback.guard.weight_layout.reason
    assert all(p.is_contiguous() and not has_channels_last_strides(p) for p in weights_4d(module).values())
    assert is_channels_last(fit.strategy.batch_to_device(random_images(n=2, size=IMAGE))[0])
    callback.guard.close()  # the batch's forward never runs: end its first-batch search and view watch
    # Lightning's FSDP needs a GPU to run; the plan for it, from the strategy alone:
    plan = _weight_layout(type('Trainer', (), {'strategy': FSDPStrategy()})(), Classifier())
    assert plan.contiguous and not plan.sharded and 'FSDPStrategy' in plan.reason


def test_audit_handlers_log_each_audited_step_to_the_loggers():
    recording, callback = Recording(), ChannelsLastCallback(audit_steps=1)
    fit, module = set_up(callback, breaking_model(), logger=recording)
    fit.strategy.model_to_device()
    assert recording.hyperparameters['channels_last/weight_layout'] == 'channels_last'
    images, _ = fit.strategy.batch_to_device(random_images(n=2, size=IMAGE))
    for _ in range(2):  # the second step is past audit_steps: not audited, nothing logged
        callback.on_train_batch_start(fit, module, None, 0)
        module(images).sum().backward()
        callback.on_after_backward(fit, module)
    assert recording.metrics == [
        (
            0,
            {
                'channels_last/layout_breaks': 1,
                'channels_last/break_bytes': callback.report.break_bytes,
                'channels_last/exit_bytes': 0,
            },
        )
    ]
    assert callback.report.steps == 1 and callback.report.breaks[0].module_path == 'net.1'


def test_state_dict_holds_the_decision():
    decision = LayoutDecision(
        channels_last=False,
        tie=False,
        interval=(0.5, 0.8),
        nchw_seconds=[1.0],
        channels_last_seconds=[2.0],
        margin=0.02,
        confidence=0.95,
        stopped_by='evidence',
        cost_seconds=3.0,
    )
    callback = ChannelsLastCallback(mode='auto')
    assert callback.state_dict() == {'decision': None}
    callback.load_state_dict({'decision': decision.to_dict()})
    fit, module = set_up(callback)
    fit.strategy.model_to_device()  # the resumed decision, applied before any wrapping: NCHW
    assert callback.decision == decision and callback.state_dict() == {'decision': decision.to_dict()}
    assert not any(has_channels_last_strides(p) for p in weights_4d(module).values())
    assert not is_channels_last(fit.strategy.batch_to_device(random_images(n=2, size=IMAGE))[0])


def test_the_callback_pickles_and_copies_with_its_options_and_a_resumed_decision():
    """Lightning's ``ddp_spawn`` pickles the trainer, callbacks and all, into each process it starts (the callback's
    weak tables failed to pickle): options, console and a loaded decision come through, on a guard of its own."""
    import copy
    import pickle

    decision = LayoutDecision(False, False, (0.5, 0.8), [1.0], [2.0], 0.02, 0.95, 'evidence', 3.0)
    callback = ChannelsLastCallback(mode='auto', audit_steps=1, fuse_eval=True, network='net')
    callback.load_state_dict({'decision': decision.to_dict()})
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert repr(copied) == repr(callback) and copied.network == 'net'
        assert copied.guard is not callback.guard and copied.state_dict() == {'decision': decision.to_dict()}
        assert copied.guard.console is copied._console
        fit, module = set_up(copied)
        fit.strategy.model_to_device()  # the resumed decision, applied: NCHW
        assert copied.decision == decision
        assert not any(has_channels_last_strides(p) for p in weights_4d(module).values())


# --- a Trainer on the CPU -------------------------------------------------------------------------


class BuiltInConfigureModel(Classifier):
    """Builds its network in ``configure_model`` (which runs after ``Callback.setup``) from ``initial``."""

    def __init__(self, initial: dict[str, torch.Tensor]) -> None:
        super().__init__(net=nn.Identity())
        self.initial = initial

    def configure_model(self) -> None:
        if isinstance(self.net, nn.Identity):
            self.net = small_net()
            self.net.load_state_dict(self.initial)


class LayoutRecorder(L.Callback):
    """The 4D weights' layout and devices when fitting starts (after the strategy's setup) and each weight
    gradient's layout."""

    def __init__(self) -> None:
        self.weights: dict[str, bool] = {}
        self.devices: set[str] = set()
        self.grads: list[bool] = []

    def on_fit_start(self, trainer, pl_module):
        self.weights = {name: has_channels_last_strides(p) for name, p in weights_4d(pl_module).items()}
        self.devices = {p.device.type for p in pl_module.parameters()}

    def on_after_backward(self, trainer, pl_module):
        self.grads += [has_channels_last_strides(p.grad) for p in weights_4d(pl_module).values()]


def test_trainer_trains_nhwc_in_fit_validate_test_predict_and_matches_nchw():
    torch.manual_seed(0)
    initial = small_net().state_dict()
    reference = Classifier(small_net())
    reference.net.load_state_dict(initial)
    lightning_trainer(max_steps=STEPS).fit(reference, loader())

    module = BuiltInConfigureModel(initial)
    recorder = LayoutRecorder()
    fit = lightning_trainer(
        max_steps=STEPS, callbacks=[ChannelsLastCallback(), recorder], val_check_interval=2, limit_val_batches=2
    )
    fit.fit(module, loader(), loader())
    assert list(recorder.weights) == ['net.0.weight', 'net.3.weight', 'net.4.weight']
    assert all(recorder.weights.values()), recorder.weights
    assert len(recorder.grads) == 3 * STEPS and all(recorder.grads)
    fit.validate(module, loader(n=8))
    fit.test(module, loader(n=8))
    predictions = fit.predict(module, loader(n=8))
    assert len(module.inputs_nhwc) == STEPS + 2 + 2 + 2 + 2 and all(module.inputs_nhwc)
    assert [p.shape for p in predictions] == [(RANK_BATCH, 4)] * 2
    trained = dict(module.net.named_parameters())
    for name, value in reference.net.named_parameters():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.cuda
def test_on_a_gpu_the_weights_go_nhwc_on_the_device_and_training_matches_nchw_at_every_step():
    torch.manual_seed(0)
    initial = small_net().state_dict()
    runs = {}
    for name, callbacks in (('nchw', []), ('channels_last', [ChannelsLastCallback(audit_steps=1)])):
        module, recorder, losses = Classifier(small_net()), LayoutRecorder(), LossRecorder()
        module.net.load_state_dict(initial)
        fit = lightning_trainer(
            max_steps=STEPS, callbacks=[*callbacks, recorder, losses], accelerator='gpu', precision='64-true'
        )
        fit.fit(module, loader())
        runs[name] = module, recorder, losses.losses
    module, recorder, losses = runs['channels_last']
    assert recorder.weights and all(recorder.weights.values()), recorder.weights
    assert len(recorder.grads) == 3 * STEPS and all(recorder.grads)
    assert recorder.devices == {'cuda'} and module.inputs_nhwc == [True] * STEPS
    # Lightning's teardown moves the model back to the CPU; the weights stay NHWC
    assert all(has_channels_last_strides(p) for p in weights_4d(module).values())
    reference, _, expected = runs['nchw']
    torch.testing.assert_close(losses, expected, rtol=1e-9, atol=0)
    trained = dict(reference.net.named_parameters())
    for name, value in module.net.named_parameters():
        torch.testing.assert_close(value, trained[name], rtol=1e-9, atol=1e-12, msg=name)


class LossRecorder(L.Callback):
    """Each training step's loss, as a float64 CPU tensor."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs['loss'].detach().cpu())


def test_strict_stops_fit_with_the_break_and_leaves_nothing_installed():
    fit = lightning_trainer(max_steps=2, callbacks=[ChannelsLastCallback(audit_steps=1, strict=True)])
    with pytest.raises(LayoutBreakError, match="'net.1'"):
        fit.fit(Classifier(breaking_model()), loader())
    assert no_dispatch_mode() and 'batch_to_device' not in vars(fit.strategy)


class NetworkNoted(Classifier):
    """Notes the type of ``net`` at each validation step."""

    networks: list[str] = []

    def validation_step(self, batch, batch_idx):
        self.networks.append(type(self.net).__name__)
        return super().validation_step(batch, batch_idx)


def test_fuse_eval_validates_on_a_fused_copy_and_puts_the_network_back():
    torch.manual_seed(0)
    module = NetworkNoted()
    network = module.net
    callback = ChannelsLastCallback(fuse_eval=True)
    fit = lightning_trainer(callbacks=[callback])
    fused = fit.validate(module, loader(n=8))[0]['val_loss']
    assert module.networks == ['InferenceModel'] * 2 and module.net is network
    callback.fuse_eval = False
    unfused = fit.validate(module, loader(n=8))[0]['val_loss']
    assert module.networks[2:] == ['Sequential'] * 2
    assert fused == pytest.approx(unfused, rel=1e-5)


def test_fuse_eval_validates_a_torchscript_network_unfused_with_a_warning(caplog):
    module = NetworkNoted()
    module.networks = []
    module.net = torch.jit.script(module.net)
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.fuse.evaluation'):
        lightning_trainer(callbacks=[ChannelsLastCallback(fuse_eval=True)]).validate(module, loader(n=8))
    assert module.networks == ['RecursiveScriptModule'] * 2
    said = [r.getMessage() for r in caplog.records]
    assert said == ['fuse_eval: evaluating unfused, since the network is TorchScript, which has no code to fuse']


def test_fuse_eval_names_the_network_to_fuse_when_there_is_no_single_one():
    module = Classifier()
    module.head = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r'2 such children \(net, head\).*network='):
        lightning_trainer(callbacks=[ChannelsLastCallback(fuse_eval=True)]).validate(module, loader(n=4))
    fused = lightning_trainer(callbacks=[ChannelsLastCallback(fuse_eval=True, network='net')]).validate(
        module, loader(n=4)
    )
    assert 'val_loss' in fused[0]


def test_fuse_eval_is_checked_before_training():
    module = Classifier()
    module.head = nn.Linear(4, 4)
    fit = lightning_trainer(max_steps=2, callbacks=[ChannelsLastCallback(fuse_eval=True)])
    with pytest.raises(ValueError, match=r'2 such children'):
        fit.fit(module, loader())
    assert fit.global_step == 0


def test_repr_shows_the_mode_asked_for_after_the_decision(quick_decisions):
    from lightning.pytorch.strategies import ModelParallelStrategy

    asked = "ChannelsLastCallback(mode='auto', audit_steps=0, strict=False)"
    callback = ChannelsLastCallback(mode='auto')
    lightning_trainer(max_steps=1, callbacks=[callback]).fit(Classifier(), loader(n=4))
    assert callback.decision is not None and callback.guard.effective_mode == 'auto'
    assert repr(callback) == asked
    sharded = ChannelsLastCallback(mode='auto')  # the weights must stay contiguous: it acts as 'on'
    set_up(sharded, strategy=ModelParallelStrategy())[0].strategy.model_to_device()
    assert sharded.guard.effective_mode == 'on' and repr(sharded) == asked


def test_auto_decision_is_logged_checkpointed_and_resumed_without_measuring(quick_decisions, monkeypatch, tmp_path):
    recording = Recording()
    callback = ChannelsLastCallback(mode='auto')
    fit = lightning_trainer(max_steps=2, callbacks=[callback], logger=recording)
    fit.fit(Classifier(), loader())
    decision = callback.decision
    assert decision is not None and decision.rounds == 2
    assert recording.hyperparameters['channels_last/auto_layout'] == decision.layout
    fit.save_checkpoint(tmp_path / 'run.ckpt')
    checkpoint = torch.load(tmp_path / 'run.ckpt', weights_only=False)
    assert checkpoint['callbacks']['ChannelsLastCallback'] == {'decision': decision.to_dict()}

    def no_measuring(*args, **kwargs):
        raise AssertionError('a resumed run measured again')

    monkeypatch.setattr(auto_mode_module, 'decide_layout', no_measuring)
    resumed = ChannelsLastCallback(mode='auto')
    lightning_trainer(max_steps=4, callbacks=[resumed]).fit(Classifier(), loader(), ckpt_path=tmp_path / 'run.ckpt')
    assert resumed.decision == decision

    # A checkpoint that kept NCHW: the resumed run trains NCHW, weights, gradients and inputs.
    checkpoint['callbacks']['ChannelsLastCallback']['decision']['channels_last'] = False
    torch.save(checkpoint, tmp_path / 'nchw.ckpt')
    module, recorder = Classifier(), LayoutRecorder()
    lightning_trainer(max_steps=4, callbacks=[ChannelsLastCallback(mode='auto'), recorder]).fit(
        module, loader(), ckpt_path=tmp_path / 'nchw.ckpt'
    )
    assert recorder.weights and not any(recorder.weights.values())
    assert recorder.grads and not any(recorder.grads)
    assert module.inputs_nhwc and not any(module.inputs_nhwc)


@pytest.fixture
def console():
    """The messages Lightning's console (``rank_zero_info``, under the ``lightning.pytorch`` logger) shows."""

    class Messages(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    handler, lightning_log = Messages(), logging.getLogger('lightning.pytorch')
    lightning_log.addHandler(handler)
    yield handler.messages
    lightning_log.removeHandler(handler)


def test_console_shows_the_start_block_and_the_breaks_left_once(console):
    recording = Recording()
    fit = lightning_trainer(max_steps=2, callbacks=[ChannelsLastCallback(audit_steps=1)], logger=recording)
    fit.fit(Classifier(breaking_model()), loader(n=8))  # a break at net.1, global pooling at net.3
    starts = [m for m in console if m.startswith('channels last: Classifier: weights channels last')]
    assert len(starts) == 1 and '\n  repaired    1 layer: global_avg_pool at net.3\n' in starts[0]
    audits = [m for m in console if m.startswith('channels last: layout audit')]
    assert len(audits) == 1 and audits[0].startswith(
        'channels last: layout audit of 1 training step: 1 layout break left in the model'
    )
    assert '\n  net.1  aten.clone.default (forward)  1x' in audits[0]
    assert recording.hyperparameters['channels_last/repair_rules'] == 'global_avg_pool'
    assert recording.hyperparameters['channels_last/audit_breaks'] == 1


def test_the_breaks_left_are_printed_above_the_progress_bar(capfd, console):
    fit = lightning_trainer(max_steps=1, callbacks=[ChannelsLastCallback(audit_steps=1)], enable_progress_bar=True)
    fit.fit(Classifier(breaking_model()), loader(n=4))
    printed = capfd.readouterr()
    lines = (printed.out + printed.err).splitlines()  # \r ends a line too: the bar's redraws
    audit = 'channels last: layout audit of 1 training step: 1 layout break left in the model'
    assert [line.startswith(audit) for line in lines if audit in line] == [True]  # on its own line, once
    assert not any(m.startswith('channels last: layout audit') for m in console)  # not also through the log


def test_auto_mode_says_what_it_times_then_what_it_kept(quick_decisions, console):
    callback = ChannelsLastCallback(mode='auto')
    lightning_trainer(max_steps=1, callbacks=[callback]).fit(Classifier(), loader(n=4))
    timing = next(i for i, m in enumerate(console) if m.startswith('auto layout: timing channels first (NCHW)'))
    assert console[timing + 1] == str(callback.decision)
    assert (
        console[timing + 2].startswith('channels last: Classifier:') and '\n  auto        kept ' in console[timing + 2]
    )


class MomentumAtTrainStart(L.Callback):
    """Notes the 4D momentum buffers (and their layout) when training starts, after a resume."""

    def on_train_start(self, trainer, pl_module):
        self.momentum = [s['momentum_buffer'].clone() for s in trainer.optimizers[0].state.values() if s]
        self.momentum = [m for m in self.momentum if m.dim() == 4]
        self.channels_last = [is_channels_last(m) for m in self.momentum]


def test_checkpoints_are_canonical_and_resume_into_channels_last(tmp_path):
    fit = lightning_trainer(max_steps=2, callbacks=[ChannelsLastCallback()])
    fit.fit(Classifier(), loader())
    fit.save_checkpoint(tmp_path / 'run.ckpt')
    checkpoint = torch.load(tmp_path / 'run.ckpt', weights_only=False)
    saved_weights = {k: v for k, v in checkpoint['state_dict'].items() if v.dim() == 4}
    saved_momentum = [s['momentum_buffer'] for s in checkpoint['optimizer_states'][0]['state'].values()]
    saved_momentum = [m for m in saved_momentum if m.dim() == 4]
    assert saved_weights and saved_momentum
    assert all(t.is_contiguous() for t in [*saved_weights.values(), *saved_momentum])
    saved_weights['net.0.weight'].view(8, -1)

    watcher = MomentumAtTrainStart()
    module = Classifier()
    lightning_trainer(max_steps=3, callbacks=[ChannelsLastCallback(), watcher]).fit(
        module, loader(), ckpt_path=tmp_path / 'run.ckpt'
    )
    assert watcher.channels_last and all(watcher.channels_last)
    assert all(torch.equal(a, b) for a, b in zip(watcher.momentum, saved_momentum))
    assert all(is_channels_last(w) for w in weights_4d(module.net).values())


# --- 2 ranks, DDP on gloo -------------------------------------------------------------------------


def global_dataset() -> TensorDataset:
    """STEPS global batches of WORLD * RANK_BATCH images, the same in every process."""
    images, labels = random_images(n=STEPS * WORLD * RANK_BATCH, size=IMAGE, seed=3)
    return TensorDataset(images, labels % 4)


class DDPRecorder(L.Callback):
    """What DDP saw: the wrapper and the weights' layout at fit start, each step's gradient
    layouts, and (through a comm hook) whether each bucket holds its 4D gradients in NHWC order."""

    def __init__(self) -> None:
        self.record: dict = {'buckets': [], 'grads': []}

    def on_fit_start(self, trainer, pl_module):
        self.record['wrapped_model'] = type(trainer.strategy.model).__name__
        self.record['weights'] = {name: has_channels_last_strides(p) for name, p in weights_4d(pl_module).items()}
        trainer.strategy.model.register_comm_hook(None, self.comm_hook)  # Lightning registers its own on CUDA only

    def on_after_backward(self, trainer, pl_module):
        self.record['grads'].append(all(has_channels_last_strides(p.grad) for p in weights_4d(pl_module).values()))

    def comm_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.record['buckets'].append(nhwc_bucket_views(bucket))
        return default_hooks.allreduce_hook(state, bucket)


def _run_rank(out: Path) -> None:
    """One rank: ``mode='on'`` with an audit, then ``mode='auto'``, each under DDP from the initial weights."""
    from lightning.pytorch.strategies import DDPStrategy

    auto_mode_module.decide_layout = functools.partial(decide_layout, max_rounds=2, warmup=0)
    initial = torch.load(out / 'initial.pt')
    result = {}
    for run, callback in (('on', ChannelsLastCallback(audit_steps=STEPS)), ('auto', ChannelsLastCallback(mode='auto'))):
        net = small_net()
        net.load_state_dict(initial)
        module, recorder = Classifier(net), DDPRecorder()
        ddp = DDPStrategy(process_group_backend='gloo')
        # Lightning's own distributed sampler shuffles: this one gives rank r the samples r, r + WORLD, ...
        fit = lightning_trainer(
            devices=WORLD, strategy=ddp, max_steps=STEPS, callbacks=[callback, recorder], use_distributed_sampler=False
        )
        data = global_dataset()
        sampler = DistributedSampler(data, num_replicas=WORLD, rank=int(os.environ['LOCAL_RANK']), shuffle=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            fit.fit(module, DataLoader(data, batch_size=RANK_BATCH, sampler=sampler))
        result[run] = {
            **recorder.record,
            'inputs_nhwc': module.inputs_nhwc,
            'warnings': [str(w.message) for w in caught if STRIDE_WARNING in str(w.message)],
            'parameters': {name: p.detach().clone() for name, p in net.named_parameters()},
            'audit': None if callback.report is None else (callback.report.steps, callback.report.ok),
            'decision': None if callback.decision is None else callback.decision.to_dict(),
        }
    torch.save(result, out / f'rank{fit.global_rank}.pt')
    leave_rank()


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    """Start both ranks of the program; their records."""
    out = tmp_path_factory.mktemp('lightning_ddp')
    torch.manual_seed(0)
    torch.save(small_net().state_dict(), out / 'initial.pt')
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')}
    env.update(OMP_NUM_THREADS='1', WORLD_SIZE=str(WORLD), NODE_RANK='0', MASTER_ADDR='127.0.0.1')
    env['MASTER_PORT'] = str(free_port())
    output = {'stdout': subprocess.PIPE, 'stderr': subprocess.STDOUT, 'text': True}
    command = [sys.executable, __file__, str(out)]
    ranks = [subprocess.Popen(command, env={**env, 'LOCAL_RANK': str(r)}, cwd=out, **output) for r in range(WORLD)]
    try:
        outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, output in zip(ranks, outputs):
        assert rank.returncode == 0, f'rank exit {rank.returncode}\n{output[-5000:]}'
    return [torch.load(out / f'rank{r}.pt', weights_only=False) for r in range(WORLD)], out


def _reference(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One process, NCHW, no callback: each global batch as two microbatches, one rank's samples each."""
    data = global_dataset()
    per_rank = [list(DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=False)) for r in range(WORLD)]
    net = small_net()
    net.load_state_dict(initial)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        for indices in per_rank:
            images, labels = data[indices[step * RANK_BATCH : (step + 1) * RANK_BATCH]]
            (nn.functional.cross_entropy(net(images), labels) / WORLD).backward()
        optimizer.step()
    return {name: p.detach() for name, p in net.named_parameters()}


@pytest.mark.distributed
def test_ddp_on_two_ranks_is_nhwc_throughout_and_matches_one_nchw_process(two_ranks):
    ranks, out = two_ranks
    expected = _reference(torch.load(out / 'initial.pt'))
    for run in ('on', 'auto'):
        for record in ranks:
            mine = record[run]
            assert mine['wrapped_model'] == 'DistributedDataParallel'
            # Restrided before DDP built its buckets: the 3x3, depthwise and 1x1 weights.
            assert mine['weights'] == {'net.0.weight': True, 'net.3.weight': True, 'net.4.weight': True}, run
            assert mine['warnings'] == [], run
            assert mine['grads'] == [True] * STEPS, run
            # rank 0 timed 2 rounds of both layouts: the trials leave no trace in the module's list of inputs
            assert len(mine['inputs_nhwc']) == STEPS and all(mine['inputs_nhwc']), run
            assert sum(len(seen) for seen in mine['buckets']) == 3 * STEPS
            assert all(all(seen.values()) for seen in mine['buckets']), mine['buckets']
            for name, value in expected.items():
                close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-5)
                close(mine['parameters'][name], value, msg=f'{run} {name} differs from one NCHW process')
    assert [record['on']['audit'] for record in ranks] == [(STEPS, True)] * WORLD
    decisions = [record['auto']['decision'] for record in ranks]
    assert decisions[0] is not None and decisions[0] == decisions[1]  # rank 0 decided, rank 1 took it


if __name__ == '__main__':
    _run_rank(Path(sys.argv[1]))


class _ReadsItsOptimizers(Classifier):
    """Logs its learning rate from ``self.optimizers()`` and ``self.lr_schedulers()``: the fit loop sets them up."""

    def training_step(self, batch, batch_idx):
        self.log('lr', self.optimizers().param_groups[0]['lr'])
        self.log('scheduled_lr', self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1)]


def test_auto_mode_trains_a_step_that_reads_its_optimizers_channels_last_untimed(quick_decisions):
    """Auto mode times training_step before the optimizers exist: one that reads them is not timed, and the fit
    trains channels last as mode 'on' does, to the same numbers."""
    results = {}
    for mode in ('on', 'auto'):
        torch.manual_seed(0)
        callback, module = ChannelsLastCallback(mode=mode), _ReadsItsOptimizers()
        lightning_trainer(max_steps=2, callbacks=[callback]).fit(module, loader(n=8))
        results[mode] = weights_4d(module.net)
        assert callback.guard.effective_mode == 'on' and callback.decision is None
        assert all(module.inputs_nhwc) and all(has_channels_last_strides(w) for w in results[mode].values())
    for name, weight in results['on'].items():
        torch.testing.assert_close(results['auto'][name], weight, rtol=0, atol=0)


class _CollectsItsSteps(Classifier):
    """The Lightning 2 way to an epoch-end metric: each training_step appends its loss to a list and updates a
    torchmetrics accuracy; the epoch end reads both."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.accuracy = torchmetrics.Accuracy(task='multiclass', num_classes=4)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.accuracy(logits, labels)
        loss = nn.functional.cross_entropy(logits, labels)
        self.losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch = (len(self.losses), self.accuracy.compute().item(), torch.stack(self.losses).mean().item())


def test_auto_modes_trial_steps_leave_what_training_step_collects_as_it_was(quick_decisions):
    """The trial steps run training_step before training: the epoch's list of losses and its accuracy hold the
    epoch's steps only, as under mode 'on'."""
    epochs = {}
    for mode in ('on', 'auto'):
        torch.manual_seed(0)
        module = _CollectsItsSteps()
        lightning_trainer(max_epochs=1, callbacks=[ChannelsLastCallback(mode=mode)]).fit(module, loader(n=8))
        epochs[mode] = module.epoch
    assert epochs['auto'] == epochs['on'] and epochs['on'][0] == 8 // RANK_BATCH
