"""What a user sees of a channels-last run, built once here for every integration.

A :class:`ConsoleBlock` is a few lines for people and a flat dict of ``channels_last/...``
hyperparameters for a trainer's loggers. :func:`start_block` says, when training starts, what
the conversion did (tensors restrided, layers repaired and by which rule, kernel safe paths,
the layers no swap could cover), the weight layout the parallel setting allows and auto mode's
decision with its evidence;
:func:`audit_block`, after the last audited step, the layout breaks that step left in the model
by module and op, with their bytes; :func:`timing_line` is auto mode's word before it measures;
:func:`step_metrics` the metrics of an audited step. The integrations only choose when and
where to print them: Composer's console, Lightning's ``rank_zero_info``, a plain loop's log
(:class:`~channels_last_algo.core.guard.LayoutGuard`).

Example:
    >>> from channels_last_algo.core.audit_report import AuditRecord, AuditReport
    >>> record = AuditRecord('aten.cat.default', 'features.1', 'forward', (2, 8, 4, 4), 512, 'NHWC->NCHW')
    >>> print(audit_block(AuditReport(breaks=[record, record])))
    channels last: layout audit of 1 training step: 2 layout breaks left in the model (1.0 KiB)
      features.1  aten.cat.default (forward)  2x  1.0 KiB
    >>> timing_line(max_rounds=60, max_seconds=60.0).endswith('at most 60 rounds or 60 s ...')
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

from channels_last_algo.core.audit_report import AuditRecord, AuditReport, format_bytes
from channels_last_algo.core.auto import LayoutDecision
from channels_last_algo.core.convert import ConversionSummary
from channels_last_algo.core.safety.bugs import why_kept_nchw
from channels_last_algo.core.swap_records import UncoveredLayer
from channels_last_algo.core.weight_layout import WeightLayoutPlan

__all__ = ['ConsoleBlock', 'audit_block', 'start_block', 'step_metrics', 'timing_line']

_TITLE = 'channels last'
_SHOWN = 10  # rows of breaks at most in the audit block; the report holds all
_NAMED = 3  # module paths named per repair rule or safe path at most


@dataclasses.dataclass(frozen=True)
class ConsoleBlock:
    """A few lines for people (``str(block)``) and a flat dict of hyperparameters for loggers.

    Example:
        >>> block = ConsoleBlock(('channels last: Net', '  repaired    none'), {'channels_last/repaired_layers': 0})
        >>> print(block)
        channels last: Net
          repaired    none
    """

    lines: tuple[str, ...]
    hyperparameters: dict[str, Any]

    def __str__(self) -> str:
        return '\n'.join(self.lines)


def _row(label: str, text: str) -> str:
    return f'  {label:<11} {text}'


def _count(n: int, word: str) -> str:
    return f'{n} {word}' + ('' if n == 1 else 's')


def _named(groups: dict[str, list[str]]) -> str:
    """``{'rule': [paths]}`` as ``rule at a, b, c and 2 more; other at d``."""
    parts = []
    for name, paths in groups.items():
        where = ', '.join(path or '(root)' for path in paths[:_NAMED])
        more = f' and {len(paths) - _NAMED} more' if len(paths) > _NAMED else ''
        parts.append(f'{name} at {where}{more}')
    return '; '.join(parts)


def _grouped(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, path in pairs:
        groups.setdefault(name, []).append(path)
    return groups


def _evidence(decision: LayoutDecision) -> str:
    """The decision in one phrase: what was kept, the speedup, its interval, rounds and cost."""
    low_high = decision.interval
    interval = (
        '' if low_high is None else f', {decision.confidence:.0%} interval [{low_high[0]:.2f}, {low_high[1]:.2f}]'
    )
    tie = ' (a tie: the default)' if decision.tie else ''
    return (
        f'kept {decision.layout}{tie}: speedup {decision.speedup:.2f}x over channels first{interval}, '
        f'{decision.rounds} rounds, {decision.cost_seconds:.1f} s'
    )


def _decision_hyperparameters(decision: LayoutDecision) -> dict[str, Any]:
    params = {
        'channels_last/auto_layout': decision.layout.value,
        'channels_last/auto_speedup': decision.speedup,
        'channels_last/auto_cost_s': decision.cost_seconds,
        'channels_last/auto_rounds': decision.rounds,
        'channels_last/auto_tie': decision.tie,
    }
    if decision.interval is not None:
        params['channels_last/auto_interval_low'], params['channels_last/auto_interval_high'] = decision.interval
    return params


def start_block(
    model: str,
    summary: ConversionSummary,
    plan: WeightLayoutPlan,
    mode: str = 'on',
    decision: Optional[LayoutDecision] = None,
    audit_steps: int = 0,
    compile_note: Optional[str] = None,
) -> ConsoleBlock:
    """What the run starts with: conversion, weight layout, repairs, safe paths, auto's decision,
    and what is done for compiled training (``compile_note``).

    Example:
        >>> from channels_last_algo.core.swap_records import SwapRecord
        >>> pool = SwapRecord('2', 'repair', 'global_avg_pool', 'torch.nn.AdaptiveAvgPool2d', 'ChannelsLastPool')
        >>> summary = ConversionSummary(converted=['0.weight', '3.weight'], repaired=[pool])
        >>> block = start_block('Net', summary, WeightLayoutPlan(False, 'one process'), audit_steps=2)
        >>> print(block)
        channels last: Net: weights channels last (one process)
          restrided   2 tensors to channels last (0 already, 0 optimizer state tensors)
          repaired    1 layer: global_avg_pool at 2
          audit       the first 2 training steps; the breaks left are shown after them
        >>> block.hyperparameters['channels_last/repair_rules']
        'global_avg_pool'
    """
    repaired = _grouped((r.reason, r.path) for r in summary.repaired)
    lines = [
        f'{_TITLE}: {model}: {"kept NCHW" if summary.kept_channels_first else plan}',
        *_conversion_rows(summary, repaired),
        *([_row('compile', compile_note)] if compile_note else []),
        *_run_rows(
            mode,
            decision,
            0 if summary.nothing_channels_last else audit_steps,
            len(summary.repaired) + len(summary.made_safe),
        ),
    ]
    params = _start_hyperparameters(summary, plan, mode, audit_steps, repaired)
    return ConsoleBlock(tuple(lines), params | (_decision_hyperparameters(decision) if decision else {}))


def _conversion_rows(summary: ConversionSummary, repaired: dict[str, list[str]]) -> list[str]:
    """What the conversion did: tensors restrided, layers repaired (by rule), kernel safe paths, layers not covered."""
    safe = _grouped((f'{s.reason} -> {s.replacement}', s.path) for s in summary.made_safe)
    rows = [
        _row(
            'restrided',
            f'{_count(len(summary.converted), "tensor")} to {summary.layout} ({len(summary.unchanged)} already, '
            f'{summary.optimizer_states} optimizer state tensors)',
        ),
        _row('repaired', f'{_count(len(summary.repaired), "layer")}: {_named(repaired)}' if repaired else 'none'),
    ]
    if safe:
        rows.append(_row('safe paths', f'{_count(len(summary.made_safe), "layer")}: {_named(safe)}'))
    if summary.left:
        left = _grouped((reason, name) for name, reason in summary.left.items())
        rows.append(_row('left as is', f'{_count(len(summary.left), "4D/5D tensor")}: {_named(left)}'))
    if summary.not_covered:
        rows.append(_row('not covered', _not_covered(summary.not_covered)))
    if summary.kept_channels_first:
        rows.append(_row('kept NCHW', why_kept_nchw(summary.kept_channels_first)))
    if summary.nothing_channels_last:
        rows.append(_row('batches', 'as they come: no tensor of the model is channels last to feed'))
    return rows


def _not_covered(layers: list[UncoveredLayer]) -> str:
    """The layers a row needs but no swap may replace, by row: with the methods their classes override, and those
    other code hooks."""
    overriding, hooked = [u for u in layers if not u.hooked], [u for u in layers if u.hooked]
    parts = []
    if overriding:
        needs = _grouped(
            (u.reason, f'{u.path or "(root)"} ({u.layer.rpartition(".")[2]}.{"/".join(u.overrides)})')
            for u in overriding
        )
        parts.append(
            f'{_count(len(overriding), "layer")}: {_named(needs)}: its class overrides what the swap replaces; '
            "keep the base class's forward to have it swapped"
        )
    if hooked:
        needs = _grouped((u.reason, u.path or '(root)') for u in hooked)
        parts.append(
            f'{_count(len(hooked), "layer")}: {_named(needs)}: hooked forward and backward by other code, which may '
            "pick its handling by the layer's class (Opacus, BackPACK): it keeps its class"
        )
    return '; '.join(parts)


def _run_rows(mode: str, decision: Optional[LayoutDecision], audit_steps: int, swapped: int) -> list[str]:
    """What the run does next: auto mode's decision (with channels first, the ``swapped`` layers run as their
    original classes), the audit of the first training steps."""
    rows = []
    if mode == 'auto' and decision is not None:
        channels_first = swapped and not decision.channels_last
        taken_back = (
            f'; swaps taken back ({_count(swapped, "layer")} run as their original classes)' if channels_first else ''
        )
        rows.append(_row('auto', _evidence(decision) + taken_back))
    elif mode == 'auto':
        rows.append(_row('auto', 'not measured: channels last'))
    if audit_steps:
        steps = 'training step' if audit_steps == 1 else f'{audit_steps} training steps'
        rows.append(_row('audit', f'the first {steps}; the breaks left are shown after them'))
    return rows


def _start_hyperparameters(
    summary: ConversionSummary, plan: WeightLayoutPlan, mode: str, audit_steps: int, repaired: dict[str, list[str]]
) -> dict[str, Any]:
    return {
        'channels_last/mode': mode,
        'channels_last/weight_layout': plan.memory_format.value,
        'channels_last/restrided_tensors': len(summary.converted),
        'channels_last/channels_last_tensors': 0 if plan.contiguous else summary.tensors,
        'channels_last/repaired_layers': len(summary.repaired),
        'channels_last/repair_rules': ','.join(sorted(repaired)),
        'channels_last/safe_paths': len(summary.made_safe),
        'channels_last/not_covered': len(summary.not_covered),
        'channels_last/audit_steps': audit_steps,
    }


def _rows(records: list[AuditRecord]) -> list[str]:
    """Records grouped by module path, op and phase, with a count, bytes and a known cause, the most bytes first."""
    if not records:
        return []
    groups: dict[tuple[str, str, str], list[int]] = {}
    for r in records:
        count_bytes = groups.setdefault((r.where, f'{r.op} ({r.phase})', r.cause), [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += r.nbytes
    ordered = sorted(groups.items(), key=lambda item: -item[1][1])
    cells = [
        (where, op, f'{count}x', format_bytes(nbytes) + (f': {cause}' if cause else ''))
        for (where, op, cause), (count, nbytes) in ordered[:_SHOWN]
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    rows = ['  ' + '  '.join(cell.ljust(w) for cell, w in zip(row, widths + [0])).rstrip() for row in cells]
    if len(ordered) > _SHOWN:
        rows.append(f'  ... and {len(ordered) - _SHOWN} more (the audit report lists them all)')
    return rows


def audit_block(last: AuditReport, steps: int = 1, first: Optional[AuditReport] = None) -> ConsoleBlock:
    """What the last of ``steps`` audited training steps left in the model: its layout breaks by
    module path and op, with bytes; and, apart, the first audited step's count where it differs.

    Example:
        >>> loss = AuditRecord('aten._log_softmax.default', None, 'forward', (2, 3, 8, 8), 1536, 'NHWC->NCHW')
        >>> block = audit_block(AuditReport(outside=[loss]))
        >>> print(block)
        channels last: layout audit of 1 training step: no layout breaks
          not counted, outside the model (the loss or code around it): aten._log_softmax.default (forward), 1.5 KiB
        >>> cat = AuditRecord('aten.cat.default', 'head', 'forward', (2, 8, 4, 4), 512, 'NHWC->NCHW')
        >>> print(audit_block(AuditReport(), steps=2, first=AuditReport(breaks=[cat])))
        channels last: layout audit of 2 training steps: the last left no layout breaks
          the first audited step had 1 layout break (512 B)
        >>> block.hyperparameters['channels_last/audit_breaks']
        0
    """
    left = (
        f'{_count(len(last.breaks), "layout break")} left in the model ({format_bytes(last.break_bytes)})'
        if last.breaks
        else 'no layout breaks'
    )
    if steps > 1:
        left = f'the last left {left.replace(" left in the model", " in the model")}'
    lines = [f'{_TITLE}: layout audit of {_count(steps, "training step")}: {left}', *_rows(last.breaks)]
    if steps > 1 and first is not None and len(first.breaks) != len(last.breaks):
        had = _count(len(first.breaks), 'layout break') if first.breaks else 'no layout breaks'
        lines.append(f'  the first audited step had {had} ({format_bytes(first.break_bytes)})')
    lines += [f'  not a channels-last run: {note}' for note in last.notes] + _outside_rows(last.outside)
    params = {
        'channels_last/audited_steps': steps,
        'channels_last/audit_breaks': len(last.breaks),
        'channels_last/audit_break_bytes': last.break_bytes,
        'channels_last/audit_outside_model': len(last.outside),
    }
    return ConsoleBlock(tuple(lines), params)


def _outside_rows(records: list[AuditRecord]) -> list[str]:
    """One line on the drops outside the model, which are not counted; none where there are none."""
    if not records:
        return []
    ops = sorted({f'{r.op} ({r.phase})' for r in records})
    nbytes = format_bytes(sum(r.nbytes for r in records))
    return [f'  not counted, outside the model (the loss or code around it): {", ".join(ops)}, {nbytes}']


def timing_line(max_rounds: int, max_seconds: float) -> str:
    """Auto mode's word before it measures, naming its bounds (``decide_layout``'s options)."""
    return (
        'auto layout: timing channels first (NCHW) against channels last on the first training batch, '
        f'at most {max_rounds} rounds or {max_seconds:g} s ...'
    )


def step_metrics(step_report: AuditReport) -> dict[str, int]:
    """The ``channels_last/...`` metrics of one audited training step, for a trainer's loggers.

    Example:
        >>> step_metrics(AuditReport(steps=1))
        {'channels_last/layout_breaks': 0, 'channels_last/break_bytes': 0, 'channels_last/exit_bytes': 0}
    """
    return {
        'channels_last/layout_breaks': len(step_report.breaks),
        'channels_last/break_bytes': step_report.break_bytes,
        'channels_last/exit_bytes': step_report.exit_bytes,
    }
