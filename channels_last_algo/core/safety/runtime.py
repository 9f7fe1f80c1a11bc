"""What a layout kernel bug depends on besides the layer: the torch version, the device type,
and on the CPU the instruction set oneDNN's jit kernels are generated for.

Example:
    >>> runtime = Runtime(torch_version=(2, 13, 0), device='cuda')
    >>> runtime.torch_version < (2, 14)
    True
    >>> parse_version('2.14.1+cu130')
    (2, 14, 1)
    >>> Runtime.current('cpu').device
    'cpu'
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Union

import torch

__all__ = ['Runtime', 'parse_version']

# oneDNN's own cap on its instruction set (oneDNN reads the first name; DNNL_ is the old one).
_ONEDNN_ISA_CAPS = ('ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA')
_ISA_LEVELS = (None, 'AVX2', 'AVX512')


def parse_version(text: str) -> tuple[int, int, int]:
    """``'2.7.0+cu126'`` -> ``(2, 7, 0)``; ValueError naming ``text`` if it has no x.y version."""
    match = re.match(r'(\d+)\.(\d+)(?:\.(\d+))?', text)
    if match is None:
        raise ValueError(f'{text!r} is not a version; give major.minor[.patch], e.g. 2.14.1')
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def _cpu_isa() -> Optional[str]:
    """The x86 vector instruction set oneDNN generates kernels for here: 'AVX512', 'AVX2', or
    None (older x86, or another architecture, where oneDNN runs other kernels).

    PyTorch's CPU capability names the widest set the processor has; oneDNN uses the same
    unless ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) caps it lower.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    cap = next((os.environ[name] for name in _ONEDNN_ISA_CAPS if os.environ.get(name)), 'DEFAULT').upper()
    cap_level = 2 if cap.startswith(('AVX512', 'AVX10', 'DEFAULT')) else 1 if cap.startswith('AVX2') else 0
    level = min(_ISA_LEVELS.index(capability) if capability in _ISA_LEVELS else 0, cap_level)
    return _ISA_LEVELS[level]


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The torch version, device type and CPU instruction set a model trains with.

    Attributes:
        torch_version: (major, minor, patch) of torch.
        device: the device type, ``'cpu'`` or ``'cuda'`` (others never match a CPU or CUDA bug).
        cpu_isa: on the CPU, ``'AVX512'``, ``'AVX2'`` or None (see :meth:`current`).
    """

    torch_version: tuple[int, int, int]
    device: str
    cpu_isa: Optional[str] = None

    @classmethod
    def current(cls, device: Union[str, torch.device] = 'cpu') -> Runtime:
        """This process's torch, ``device``'s type, and (on the CPU) the instruction set oneDNN
        uses here: PyTorch's CPU capability lowered by ``ONEDNN_MAX_CPU_ISA`` when set."""
        device_type = torch.device(device).type
        return cls(
            torch_version=parse_version(torch.__version__),
            device=device_type,
            cpu_isa=_cpu_isa() if device_type == 'cpu' else None,
        )

    def __str__(self) -> str:
        version = '.'.join(map(str, self.torch_version))
        isa = f', {self.cpu_isa}' if self.cpu_isa else ''
        return f'torch {version} on {self.device}{isa}'
