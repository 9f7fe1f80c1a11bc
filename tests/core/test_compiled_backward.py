"""Inductor's layout optimisation in a converted model's training steps: forced on where this torch
leaves backward graphs without it, only inside the steps, never against the user's own setting.
(Compiled steps with inductor for real: tests/integrations/test_compile.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from channels_last_algo import LayoutGuard
from channels_last_algo.core import compiled_backward
from channels_last_algo.core.compiled_backward import CompiledBackwardLayout, backward_layout_left_off
from channels_last_algo.core.runtime import version_in

inductor_config = pytest.importorskip('torch._inductor.config')


def test_needed_exactly_where_torch_lowers_convolution_backward_by_a_decision_that_skips_it():
    skips = compiled_backward._inductor_skips_backward_graphs()
    assert isinstance(skips, bool)
    assert backward_layout_left_off() == (version_in(torch.__version__, '>=2.13') and skips)


@pytest.mark.parametrize('setting', [{'layout_optimization': False}, {'force_layout_optimization': True}])
def test_not_needed_where_the_user_set_inductors_layout_optimisation(setting):
    with inductor_config.patch(setting):
        assert not backward_layout_left_off()
        assert CompiledBackwardLayout().note is None


def test_start_forces_it_once_and_stop_puts_back_what_was_there(monkeypatch):
    monkeypatch.setattr(compiled_backward, 'backward_layout_left_off', lambda: True)
    layout = CompiledBackwardLayout()
    layout.start()
    layout.start()  # a second start (a microbatch's) enters nothing more
    assert inductor_config.force_layout_optimization is True
    layout.stop()
    assert inductor_config.force_layout_optimization is False
    layout.stop()  # safe twice
    assert 'pytorch#189239' in layout.note


def test_nothing_is_set_where_this_torch_does_not_need_it(monkeypatch):
    monkeypatch.setattr(compiled_backward, 'backward_layout_left_off', lambda: False)
    layout = CompiledBackwardLayout()
    layout.start()
    assert inductor_config.force_layout_optimization is False
    assert layout.note is None


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())


@pytest.mark.parametrize('mode', ['on', 'off'])
def test_the_guard_forces_it_in_a_converted_models_steps_only(monkeypatch, mode):
    monkeypatch.setattr(compiled_backward, 'backward_layout_left_off', lambda: True)
    model, guard = _net(), LayoutGuard(mode=mode)
    guard.on_init(model)
    seen = []
    with guard.step():
        model(guard.on_batch(torch.randn(2, 3, 8, 8))).sum().backward()
        seen.append(inductor_config.force_layout_optimization)
    assert seen == [mode == 'on']
    assert inductor_config.force_layout_optimization is False
    if mode == 'on':
        assert any(line.startswith('  compile     what training steps compile') for line in guard.start_block.lines)


def test_a_failed_step_leaves_inductors_setting_as_it_was(monkeypatch):
    monkeypatch.setattr(compiled_backward, 'backward_layout_left_off', lambda: True)
    model, guard = _net(), LayoutGuard()
    guard.on_init(model)
    with pytest.raises(RuntimeError, match='in the step'):
        with guard.step():
            raise RuntimeError('in the step')
    assert inductor_config.force_layout_optimization is False
