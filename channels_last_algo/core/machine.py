"""The record of a measurement: what machine it was taken on (CPU, cores, GPU, library
versions), the folder its results go to, and its results files.

Example:
    >>> info = describe_machine()
    >>> sorted(info)[:3]
    ['cores', 'cores_usable', 'cpu']
    >>> machine_label(info).startswith(info['gpu'] or info['cpu'])
    True
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ['describe_machine', 'machine_label', 'machine_slug', 'run_record', 'write_results']


def _cpu_model() -> str:
    cpuinfo = Path('/proc/cpuinfo')
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    return platform.processor() or platform.machine()


def _onednn_version() -> Optional[str]:
    match = re.search(r'(?:MKL-DNN|oneDNN) v([\d.]+)', torch.__config__.show())
    return match.group(1) if match else None


def describe_machine() -> dict[str, Any]:
    """The CPU, cores, torch threads, GPU and the versions of torch, torchvision, oneDNN, cuDNN."""
    import torchvision

    cuda = torch.cuda.is_available()
    return {
        'cpu': _cpu_model(),
        'cores': os.cpu_count(),
        'cores_usable': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'gpu': torch.cuda.get_device_name() if cuda else None,
        'python': platform.python_version(),
        'torch': torch.__version__,
        'torchvision': torchvision.__version__,
        'onednn': _onednn_version(),
        'cudnn': torch.backends.cudnn.version() if cuda else None,
        'platform': platform.platform(),
    }


def machine_label(info: dict[str, Any]) -> str:
    """One line naming the device: the GPU if there is one, else the CPU and its threads."""
    if info['gpu']:
        return f'{info["gpu"]} (cuDNN {info["cudnn"]}), torch {info["torch"]}'
    return f'{info["cpu"]}, {info["torch_threads"]} threads (oneDNN {info["onednn"]}), torch {info["torch"]}'


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


def run_record(
    argv: Optional[list[str]], load_before: float, machine: Optional[dict[str, Any]] = None, **fields: Any
) -> dict[str, Any]:
    """What a benchmark run records besides its rows: its command line (``argv``, or the
    process's when None), the machine (:func:`describe_machine` plus ``machine``), the date, the
    1-minute load average before (``load_before``) and now, and ``fields``.

    Example:
        >>> record = run_record(['--repeats', '3'], 0.5, {'pillow': '11'}, rows=[])
        >>> record['command'].endswith('--repeats 3'), record['machine']['pillow'], record['rows']
        (True, '11', [])
    """
    return {
        'command': ' '.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        'machine': {**describe_machine(), **(machine or {})},
        'date': time.strftime('%Y-%m-%d'),
        'load_average_1min': {'before': load_before, 'after': os.getloadavg()[0]},
        **fields,
    }


def write_results(folder: Path, stem: str, result: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``result`` as ``<folder>/<stem>.json`` and its Markdown table as ``<stem>.md``.

    Example:
        >>> import tempfile
        >>> paths = write_results(Path(tempfile.mkdtemp()) / 'cpu', 'demo', {'rows': []}, '# demo\\n')
        >>> [p.name for p in paths]
        ['demo.json', 'demo.md']
    """
    folder.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = folder / f'{stem}.json', folder / f'{stem}.md'
    json_path.write_text(json.dumps(result, indent=2) + '\n')
    markdown_path.write_text(markdown)
    return json_path, markdown_path
