"""What a user sees: the start block, auto mode's timing line and the audit block, built in the
core (channels_last_algo.core.console) and shown by the guard in a plain loop, once each."""

import logging

import pytest
import torch
from torch import nn

from channels_last_algo import LayoutGuard
from channels_last_algo.core.auto import LayoutDecision
from channels_last_algo.core.console import audit_block, start_block
from channels_last_algo.core.convert import ConversionSummary
from channels_last_algo.core.weight_layout import WeightLayoutPlan
from conftest import DropsNHWC, tiny_loader

GUARD_LOG = 'channels_last_algo.core.guard'


def pooled_net() -> nn.Module:
    """Conv, ReLU, global average pooling ('2': the global_avg_pool rule swaps it), a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
    )


def train(model: nn.Module, guard: LayoutGuard, steps: int = 2) -> None:
    """``steps`` SGD steps of ``model`` on tiny batches in a plain loop driven by ``guard``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _, (images, labels) in zip(range(steps), tiny_loader(n=4 * steps)):
        images, labels = guard.on_batch((images, labels))
        with guard.step():
            nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_start_block_names_the_repaired_layer_its_rule_and_the_weight_layout():
    guard = LayoutGuard(audit_steps=1)
    guard.on_init(pooled_net())
    block = guard.start_block
    assert block.lines[0].startswith('channels last: Sequential: weights channels last (no sharding')
    assert '  restrided   1 tensor to channels last (0 already, 0 optimizer state tensors)' in block.lines
    assert '  repaired    1 layer: global_avg_pool at 2' in block.lines
    assert block.lines[-1] == '  audit       the first training step; the breaks left are shown after them'
    assert block.hyperparameters == {
        'channels_last/mode': 'on',
        'channels_last/weight_layout': 'channels_last',
        'channels_last/restrided_tensors': 1,
        'channels_last/channels_last_tensors': 1,
        'channels_last/repaired_layers': 1,
        'channels_last/repair_rules': 'global_avg_pool',
        'channels_last/safe_paths': 0,
        'channels_last/not_covered': 0,
        'channels_last/audit_steps': 1,
    }
    assert str(block) == '\n'.join(block.lines)
    assert LayoutGuard(mode='off').start_block is None


def test_plain_loop_logs_the_start_block_once_and_the_conversion_summary_once(caplog):
    caplog.set_level(logging.INFO, logger='channels_last_algo')
    model, guard = pooled_net(), LayoutGuard(audit_steps=1)
    summary = guard.on_init(model)
    train(model, guard, steps=2)
    messages = [record.getMessage() for record in caplog.records]
    assert sum(str(summary) in message for message in messages) == 1  # apply_channels_last's line, no other
    starts = [m for m in messages if m.startswith('channels last: Sequential:')]
    assert starts == [str(guard.start_block)]
    audits = [r for r in caplog.records if r.getMessage().startswith('channels last: layout audit')]
    assert [(r.levelno, r.getMessage()) for r in audits] == [
        (logging.INFO, 'channels last: layout audit of 1 training step: no layout breaks')
    ]


def test_audit_block_lists_the_breaks_left_by_module_and_op_with_bytes(caplog):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), DropsNHWC(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten())
    guard = LayoutGuard(audit_steps=2, repair=False)
    guard.on_init(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger=GUARD_LOG):
        for step, (images, _) in enumerate(tiny_loader(n=12)):
            assert (guard.audit_block is None) is (step < 2)  # from the last audited step on
            with guard.step():
                model(guard.on_batch(images)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    block = guard.audit_block
    nbytes = 4 * 8 * 16 * 16 * 4  # the last step's one NCHW copy of a 4 x 8 x 16 x 16 float tensor
    assert (
        block.lines[0]
        == 'channels last: layout audit of 2 training steps: the last left 1 layout break in the model (32.0 KiB)'
    )
    assert block.lines[1].split() == ['1', 'aten.clone.default', '(forward)', '1x', '32.0', 'KiB']
    assert len(block.lines) == 2  # both steps had the one break: no line on the first
    assert block.hyperparameters['channels_last/audit_breaks'] == 1
    assert block.hyperparameters['channels_last/audit_break_bytes'] == nbytes
    assert block.hyperparameters['channels_last/audited_steps'] == 2
    shown = [r for r in caplog.records if r.getMessage() == str(block)]
    assert [r.levelno for r in shown] == [logging.WARNING]  # breaks left: a warning, once


class BreaksOnItsFirstCall(nn.Module):
    """Drops NHWC on its first call only (a lazily built buffer, a warm-up branch)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.contiguous() if self.calls == 1 else x


def test_audit_block_says_what_the_last_step_left_and_apart_what_the_first_had():
    """The breaks of the last audited step are what is left; a sum over the steps is not."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BreaksOnItsFirstCall(), nn.Conv2d(8, 8, 3, padding=1))
    guard = LayoutGuard(audit_steps=2)
    guard.on_init(model)
    for images, _ in tiny_loader(n=8):
        with guard.step():
            model(guard.on_batch(images)).sum().backward()
    assert guard.audit_block.lines == (
        'channels last: layout audit of 2 training steps: the last left no layout breaks',
        '  the first audited step had 1 layout break (32.0 KiB)',
    )
    assert guard.audit_block.hyperparameters['channels_last/audit_breaks'] == 0


def test_auto_mode_says_what_it_times_before_and_what_it_kept_after():
    model, shown = pooled_net(), []
    guard = LayoutGuard(mode='auto')
    guard.console = shown.append
    guard.on_init(model)
    decision = guard.auto.decide(model, torch.randn(4, 3, 8, 8), lambda m, x: m(x).sum(), max_rounds=2, warmup=0)
    assert shown == [  # the bounds given to decide(), decide_layout's own otherwise
        'auto layout: timing channels first (NCHW) against channels last on the first training batch, '
        'at most 2 rounds or 60 s ...',
        str(decision),
    ]
    auto = [line for line in guard.start_block.lines if line.startswith('  auto')]
    assert auto == [
        f'  auto        kept channels last (a tie: the default): speedup {decision.speedup:.2f}x over '
        f'channels first, 2 rounds, {decision.cost_seconds:.1f} s'
    ]
    assert guard.start_block.hyperparameters['channels_last/auto_rounds'] == 2
    guard.on_run_start()
    guard.on_run_start()  # once
    assert shown[2:] == [str(guard.start_block)]


def test_the_decisions_evidence_becomes_hyperparameters():
    decision = LayoutDecision(False, False, (0.7, 0.8), [1.0] * 6, [1.3] * 6, 0.02, 0.95, 'evidence', 2.5)
    block = start_block('Net', ConversionSummary(), WeightLayoutPlan(False, 'one process'), 'auto', decision)
    assert (
        '  auto        kept channels first: speedup 0.77x over channels first, 95% interval [0.70, 0.80], '
        '6 rounds, 2.5 s' in block.lines
    )
    assert {k: v for k, v in block.hyperparameters.items() if 'auto' in k} == {
        'channels_last/auto_layout': 'channels_first',
        'channels_last/auto_speedup': pytest.approx(1 / 1.3),
        'channels_last/auto_cost_s': 2.5,
        'channels_last/auto_rounds': 6,
        'channels_last/auto_tie': False,
        'channels_last/auto_interval_low': 0.7,
        'channels_last/auto_interval_high': 0.8,
    }


def test_audit_block_shows_no_more_than_ten_rows():
    from channels_last_algo.core.audit_report import AuditRecord, AuditReport

    records = [
        AuditRecord('aten.cat.default', f'block{i}', 'forward', (1, 8, 2, 2), 128 * (i + 1), 'NHWC->NCHW')
        for i in range(12)
    ]
    block = audit_block(AuditReport(breaks=records))
    assert len(block.lines) == 1 + 10 + 1 and block.lines[1].split()[0] == 'block11'  # the most bytes first
    assert block.lines[-1] == '  ... and 2 more (the audit report lists them all)'
