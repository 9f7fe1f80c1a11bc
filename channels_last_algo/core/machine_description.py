"""The description of the machine a measurement runs on: CPU, cores, GPU and library versions.

Example:
    >>> info = describe_machine()
    >>> sorted(info)[:3]
    ['cores', 'cores_usable', 'cpu']
    >>> machine_label(info).startswith(info['gpu'] or info['cpu'])
    True
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ['describe_machine', 'machine_label']


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
