"""The one results writer of the benchmarks: the record every measuring script keeps of its run
(the benchmark, its command line, the machine with the torch version, the date, how long the run
took, the 1-minute load average in one shape) and the JSON + Markdown pair it writes.

The load average is always ``{'before': ..., 'after': ...}``, with ``'min'`` and ``'max'`` added
where the script sampled it while it ran; ``before`` is read when the run starts
(:meth:`RunStart.now`), ``after`` when its record is built.

Example:
    >>> import tempfile
    >>> start = RunStart.now()
    >>> record = run_record('demo', start, ['--rounds', '3'], machine={'pillow': '11'}, rows=[])
    >>> record['command'], record['machine']['pillow'], sorted(record['load_average_1min'])
    ('python benchmarks/demo.py --rounds 3', '11', ['after', 'before'])
    >>> [path.name for path in write_results(Path(tempfile.mkdtemp()) / 'cpu', 'demo', record, '# demo\\n')]
    ['demo.json', 'demo.md']
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from channels_last_algo.core.machine_description import describe_machine

__all__ = ['RESULTS', 'RunStart', 'machine_slug', 'results_folder', 'run_record', 'write_results']

RESULTS = Path(__file__).resolve().parent / 'results'
"""The committed results, one folder per machine (:func:`machine_slug`)."""


@dataclasses.dataclass(frozen=True)
class RunStart:
    """When a run started: its clock (``time.perf_counter``) and the 1-minute load average then."""

    clock: float
    load_before: float

    @classmethod
    def now(cls) -> RunStart:
        return cls(time.perf_counter(), os.getloadavg()[0])


def machine_slug(info: dict[str, Any]) -> str:
    """A folder name for the machine's results: the GPU's name, or ``cpu-<usable cores>core``.

    Example:
        >>> machine_slug({'gpu': 'NVIDIA H100 80GB HBM3', 'cores_usable': 16})
        'nvidia-h100-80gb-hbm3'
        >>> machine_slug({'gpu': None, 'cores_usable': 2})
        'cpu-2core'
    """
    if info['gpu']:
        return re.sub(r'[^a-z0-9]+', '-', info['gpu'].lower()).strip('-')
    return f'cpu-{info["cores_usable"]}core'


def results_folder(out: Optional[Path], machine: dict[str, Any]) -> Path:
    """``out`` where given, else this machine's folder under :data:`RESULTS`."""
    return out or RESULTS / machine_slug(machine)


def _load_average(start: RunStart, during: Sequence[float]) -> dict[str, float]:
    load = {'before': start.load_before}
    if during:
        load.update(min=min(during), max=max(during))
    load['after'] = os.getloadavg()[0]
    return load


def run_record(
    benchmark: str,
    start: RunStart,
    argv: Optional[list[str]],
    machine: Optional[dict[str, Any]] = None,
    load_during: Sequence[float] = (),
    **fields: Any,
) -> dict[str, Any]:
    """What a run of ``benchmarks/<benchmark>.py`` records besides its results (``fields``): its
    command line (``argv``, or the process's when None), the machine (:func:`describe_machine`
    updated by ``machine``), the date, the seconds since ``start``, and the load average
    (``load_during``: samples taken while it ran, if any)."""
    arguments = sys.argv[1:] if argv is None else argv
    return {
        'benchmark': benchmark,
        'command': ' '.join(['python', f'benchmarks/{benchmark}.py', *arguments]),
        'machine': {**describe_machine(), **(machine or {})},
        'date': time.strftime('%Y-%m-%d'),
        'seconds': time.perf_counter() - start.clock,
        'load_average_1min': _load_average(start, load_during),
        **fields,
    }


def write_results(folder: Path, stem: str, result: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``result`` as ``<folder>/<stem>.json`` and its Markdown as ``<stem>.md``; both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = folder / f'{stem}.json', folder / f'{stem}.md'
    json_path.write_text(json.dumps(result, indent=2) + '\n')
    markdown_path.write_text(markdown)
    return json_path, markdown_path
