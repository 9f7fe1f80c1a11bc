"""What a layout audit found: :class:`AuditRecord` (one break, exit conversion or op outside
the model), :class:`AuditReport` (all of them, with totals, a table and a JSON form) and
:class:`LayoutBreakError` (what a strict audit raises). :mod:`channels_last_algo.core.audit`
produces them; the method card is ``docs/audit.md``.

Example:
    >>> record = AuditRecord('aten.cat.default', 'features.1', 'forward', (2, 8, 4, 4), 512, 'NHWC->NCHW')
    >>> report = AuditReport(breaks=[record], steps=1)
    >>> report.ok, report.break_bytes
    (False, 512)
    >>> AuditReport.from_dict(report.to_dict()) == report
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Optional

__all__ = ['AuditRecord', 'AuditReport', 'LayoutBreakError', 'format_bytes']


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    """One layout break or exit conversion.

    Attributes:
        op: the aten op, e.g. ``'aten.cat.default'``.
        module_path: the path of the running module as in ``model.named_modules()`` (``''``
            is the model itself); None when the op ran outside the model (the loss, say).
        phase: ``'forward'`` or ``'backward'``. Ops outside both the model and the backward
            pass (loss, optimizer step) count as ``'forward'``.
        shape: the shape of the tensor whose layout changed (the op's NHWC input for a break).
        nbytes: bytes the op wrote in the new layout; 0 for a free exit.
        layouts: the change, e.g. ``'NHWC->NCHW'``.
        cause: why, where torch's kernel and not the model makes the break
            (:mod:`~channels_last_algo.core.break_causes`); '' otherwise.
    """

    op: str
    module_path: Optional[str]
    phase: str
    shape: tuple[int, ...]
    nbytes: int
    layouts: str
    cause: str = ''

    @property
    def where(self) -> str:
        """The module path for people: ``(root)`` for the model, ``(outside model)`` for None."""
        if self.module_path is None:
            return '(outside model)'
        return self.module_path or '(root)'


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(AuditRecord))
_LISTS = ('breaks', 'exits', 'outside')  # the record lists of a report, as to_dict writes them


def format_bytes(nbytes: int) -> str:
    """Bytes for people, as the audit writes them.

    Example:
        >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 1024**2)
        ('512 B', '1.5 KiB', '3.0 MiB')
    """
    if nbytes < 1024:
        return f'{nbytes} B'
    if nbytes < 1024**2:
        return f'{nbytes / 1024:.1f} KiB'
    return f'{nbytes / 1024**2:.1f} MiB'


def _table(records: Sequence[AuditRecord]) -> list[str]:
    """Rows of identical records merged, with a count, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for r in records:
        key = (r.phase, r.where, r.op, str(r.shape), r.layouts, r.cause)
        count_bytes = groups.setdefault(key, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += r.nbytes
    header = ('phase', 'module path', 'op', 'shape', 'layouts', 'count', 'bytes', 'cause')
    rows = [header] + [
        (*key[:-1], str(count), format_bytes(nbytes), key[-1]) for key, (count, nbytes) in groups.items()
    ]
    if not any(r.cause for r in records):
        rows = [row[:-1] for row in rows]
        header = header[:-1]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ['  ' + '  '.join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


@dataclasses.dataclass
class AuditReport:
    """What a layout audit found over ``steps`` audited passes.

    :attr:`breaks` are the model's: ops run by one of its modules (or by the backward of one).
    The same drop outside the model, such as the loss's ``log_softmax`` on a segmentation
    output, is listed in :attr:`outside` and is no break of the model: it does not make the
    report fail, nor a strict audit raise.

    Example:
        >>> report = AuditReport.merge([AuditReport(), AuditReport()])
        >>> report.ok, report.steps
        (True, 2)
        >>> AuditReport.from_dict(report.to_dict()) == report
        True
    """

    breaks: list[AuditRecord] = dataclasses.field(default_factory=list)
    exits: list[AuditRecord] = dataclasses.field(default_factory=list)
    steps: int = 1
    notes: list[str] = dataclasses.field(default_factory=list)  # what made the audit unable to see a break
    outside: list[AuditRecord] = dataclasses.field(default_factory=list)  # drops outside the model: not its breaks

    @property
    def ok(self) -> bool:
        """True when nothing in the model dropped NHWC (exit conversions and :attr:`outside` do not
        count) on a path that was channels last at all (no :attr:`notes`, such as an NCHW input or
        an unconverted model)."""
        return not self.breaks and not self.notes

    @property
    def break_bytes(self) -> int:
        return sum(r.nbytes for r in self.breaks)

    @property
    def exit_bytes(self) -> int:
        return sum(r.nbytes for r in self.exits)

    @classmethod
    def merge(cls, reports: Iterable[AuditReport]) -> AuditReport:
        """One report holding the records and steps of several, e.g. one per training step."""
        merged = cls(steps=0)
        for report in reports:
            merged.breaks.extend(report.breaks)
            merged.exits.extend(report.exits)
            merged.outside.extend(report.outside)
            merged.steps += report.steps
            merged.notes.extend(note for note in report.notes if note not in merged.notes)
        return merged

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` reads it back."""
        return {
            'steps': self.steps,
            **{key: [dataclasses.asdict(r) | {'shape': list(r.shape)} for r in getattr(self, key)] for key in _LISTS},
            'notes': list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditReport:
        """The report :meth:`to_dict` wrote; ValueError naming the key at fault otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f'an audit report dict was expected, got {type(data).__name__}')
        missing = [key for key in ('steps', 'breaks', 'exits') if key not in data]
        if missing:
            raise ValueError(
                f'audit report dict lacks {missing}; it needs the keys steps, breaks '
                'and exits, as AuditReport.to_dict() writes them'
            )
        lists = {}
        for key in _LISTS:
            records = []
            for i, item in enumerate(data.get(key, [])):
                fields = set(item) if isinstance(item, dict) else set()
                if not set(_RECORD_FIELDS) - {'cause'} <= fields <= set(_RECORD_FIELDS):
                    raise ValueError(
                        f'audit report dict: {key}[{i}] must have the keys {list(_RECORD_FIELDS)} '
                        f'("cause" may be left out), got {item!r}'
                    )
                records.append(AuditRecord(**{**item, 'shape': tuple(item['shape'])}))
            lists[key] = records
        return cls(steps=int(data['steps']), notes=list(data.get('notes', [])), **lists)

    def __str__(self) -> str:
        steps = f'{self.steps} step' + ('' if self.steps == 1 else 's')
        lines = [
            f'layout audit over {steps}: {len(self.breaks)} layout breaks '
            f'({format_bytes(self.break_bytes)} moved), {len(self.exits)} exit conversions '
            f'({format_bytes(self.exit_bytes)} copied)'
        ]
        lines += [f'not a channels-last run: {note}' for note in self.notes]
        lines += ['breaks:'] + _table(self.breaks) if self.breaks else ['no layout breaks']
        if self.exits:
            lines += ['exit conversions (the tensor leaves the conv trunk):'] + _table(self.exits)
        if self.outside:
            lines += ['outside the model (the loss, code around the model; not breaks of the model):']
            lines += _table(self.outside)
        return '\n'.join(lines)


class LayoutBreakError(RuntimeError):
    """Raised by a strict audit at the first layout break; ``.record`` is the break."""

    def __init__(self, record: AuditRecord, module_type: Optional[str] = None):
        self.record = record
        where = record.where if record.module_path is None else f"module '{record.module_path}'"
        kind = f' ({module_type})' if module_type else ''
        source, target = record.layouts.split('->')[:2]
        advice = (
            f'Its cause: {record.cause}; no repair removes it: audit with strict=False to train with it.'
            if record.cause
            else "Repair the layer with apply_channels_last's repair rules, replace it with an NHWC-preserving "
            'equivalent, or report the op and module path so a rule can be added; audit with strict=False to list '
            'every break.'
        )
        super().__init__(
            f'layout break in {record.phase} at {where}{kind}: {record.op} turned an {source} '
            f'tensor of shape {tuple(record.shape)} into {target} ({format_bytes(record.nbytes)} written). {advice}'
        )
