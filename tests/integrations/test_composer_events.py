"""The Composer adapters event by event, on a minimal State (as Composer's own algorithm tests do):
``ChannelsLast`` and ``FusedEval`` map each event onto the guard or the fused evaluation, and the
one place that reaches past Composer's events (``composer_adapter.save_canonical``) holds against
Composer's own ``save_checkpoint``. No ``fit()``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip('composer', reason='the Composer integration needs composer (the torch 2.7 environment)')

from composer.core import Event, State
from composer.devices import DeviceCPU
from composer.loggers import InMemoryLogger, Logger
from composer.models import ComposerClassifier
from composer.utils.checkpoint import save_checkpoint

from channels_last_algo import ChannelsLast, FusedEval
from channels_last_algo.core.fuse import InferenceModel
from channels_last_algo.integrations.composer_adapter import SAVE_METHODS, save_canonical

NHWC = torch.channels_last


def _network() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


def _state() -> State:
    model = ComposerClassifier(_network(), num_classes=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return State(model=model, rank_zero_seed=0, run_name='events', device=DeviceCPU(), optimizers=optimizer)


def _logger(state: State) -> tuple[Logger, InMemoryLogger]:
    memory = InMemoryLogger()
    logger = Logger(state, destinations=[memory])
    memory.init(state, logger)
    return logger, memory


def _run(algorithm, event: Event, state: State, logger: Logger) -> bool:
    """What Composer's engine does for one event: apply where the algorithm matches, then run the callbacks
    (those the algorithm added at ``INIT`` included); whether the algorithm matched."""
    matched = algorithm.match(event, state)
    if matched:
        algorithm.apply(event, state, logger)
    for callback in state.callbacks:
        callback.run_event(event, state, logger)
    return matched


def test_init_converts_the_model_logs_the_start_and_saves_canonical_tensors(tmp_path):
    state = _state()
    logger, memory = _logger(state)
    assert _run(ChannelsLast(), Event.INIT, state, logger)
    assert state.model.module[0].weight.is_contiguous(memory_format=NHWC)
    assert memory.hyperparameters['channels_last/weight_layout'] == 'channels_last'
    save_checkpoint(state, str(tmp_path / 'whole.pt'))
    save_checkpoint(state, str(tmp_path / 'weights.pt'), weights_only=True)
    for name in ('whole.pt', 'weights.pt'):
        saved = torch.load(tmp_path / name, weights_only=False)['state']['model']['module.0.weight']
        assert saved.is_contiguous() and not saved.is_contiguous(memory_format=NHWC)


def test_save_canonical_wraps_the_methods_composer_saves_through_once():
    state = _state()
    for name in SAVE_METHODS:
        assert callable(getattr(State, name)), f'Composer State has no {name}: the adapter needs a new place'
    save_canonical(state)
    wrapped = state.state_dict
    save_canonical(state)
    assert state.state_dict is wrapped and hasattr(wrapped, '__wrapped__')


def test_batch_events_convert_the_batch_and_an_audited_step_logs_its_metrics():
    state = _state()
    logger, memory = _logger(state)
    algorithm = ChannelsLast(audit_steps=1)
    _run(algorithm, Event.INIT, state, logger)
    state.batch = (torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    assert _run(algorithm, Event.BEFORE_FORWARD, state, logger)
    assert state.batch[0].is_contiguous(memory_format=NHWC)
    loss = state.model.loss(state.model(state.batch), state.batch)
    loss.backward()
    assert _run(algorithm, Event.AFTER_BACKWARD, state, logger)
    assert algorithm.report is not None and algorithm.report.ok
    assert 'channels_last/layout_breaks' in memory.data
    _run(algorithm, Event.FIT_END, state, logger)  # its callback closes the guard, after the user's


def test_mode_off_matches_no_event():
    state = _state()
    algorithm = ChannelsLast(mode='off')
    assert not any(algorithm.match(event, state) for event in Event)


def _evaluation_pass(algorithm, state: State, logger: Logger) -> type:
    """One evaluation batch as Composer's engine runs it, then the Trainer's close; the network's type
    during the pass."""
    state.model.eval()
    _run(algorithm, Event.EVAL_START, state, logger)
    state.batch = (torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    _run(algorithm, Event.EVAL_BEFORE_FORWARD, state, logger)
    during = type(state.model.module)
    with torch.no_grad():
        state.outputs = state.model(state.batch)
    _run(algorithm, Event.EVAL_AFTER_FORWARD, state, logger)
    _run(algorithm, Event.EVAL_END, state, logger)
    for callback in state.callbacks:
        callback.close(state, logger)
    return during


@pytest.mark.parametrize('algorithm', [FusedEval, lambda: ChannelsLast(fuse_eval=True)], ids=['FusedEval', 'alias'])
def test_fused_evaluation_swaps_a_fused_copy_in_for_one_pass(algorithm):
    state = _state()
    logger, _ = _logger(state)
    algorithm = algorithm()
    network = state.model.module
    _run(algorithm, Event.INIT, state, logger)
    assert _evaluation_pass(algorithm, state, logger) is InferenceModel
    assert state.model.module is network


def test_fuse_eval_off_leaves_evaluation_alone_and_fused_eval_refuses_a_model_without_module():
    state = _state()
    logger, _ = _logger(state)
    algorithm = ChannelsLast()
    _run(algorithm, Event.INIT, state, logger)
    assert _evaluation_pass(algorithm, state, logger) is nn.Sequential
    state.model.module = None
    with pytest.raises(ValueError, match='keeps in .module'):
        _run(FusedEval(), Event.INIT, state, logger)
