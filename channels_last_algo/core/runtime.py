"""Where a model runs, as the swap tables see it: the torch version, the device type and, on the
CPU, the instruction set oneDNN's jit kernels are generated for; the one torch-version parser;
and :class:`VersionSpec`, the torch versions a table row holds for.

A repair rule and a kernel bug both hold for a range of torch releases. A :class:`VersionSpec`
is that range, half open: from ``first`` (the first release that has the break or the bug)
up to ``fixed`` (the first that does not), either end open when None. It is written as clauses
('>=2.7', '>=2.7,<2.15', '==2.7.0', '' for any release).

Example:
    >>> spec = VersionSpec.parse('>=2.7,<2.15')
    >>> spec.contains('2.14.1+cu130'), spec.contains('2.15.0'), str(spec)
    (True, False, '>=2.7,<2.15')
    >>> parse_version('2.14.1+cu130')
    (2, 14, 1)
    >>> runtime = Runtime(torch_version=(2, 13, 0), device='cuda')
    >>> VersionSpec.parse('<2.14').contains(runtime.torch_version), str(runtime)
    (True, 'torch 2.13.0 on cuda')
    >>> Runtime.current('cpu').device
    'cpu'
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import NamedTuple, Optional, Union

import torch

__all__ = ['Runtime', 'Version', 'VersionSpec', 'model_device', 'parse_version', 'torch_release', 'version_in']

Version = tuple[int, int, int]
"""(major, minor, patch) of a torch release."""

# oneDNN's own cap on its instruction set (oneDNN reads the first name; DNNL_ is the old one).
_ONEDNN_ISA_CAPS = ('ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA')
_ISA_LEVELS = (None, 'AVX2', 'AVX512')
_OPERATORS = ('>=', '<=', '==', '>', '<')  # the two-character ones first: '>=' is not '>' then '=2.7'


def parse_version(text: str) -> Version:
    """``'2.7.0+cu126'`` -> ``(2, 7, 0)``, ``'2.15'`` -> ``(2, 15, 0)``; ValueError naming ``text``
    if it does not start with a version number."""
    match = re.match(r'(\d+)(?:\.(\d+))?(?:\.(\d+))?', text)
    if match is None:
        raise ValueError(f'{text!r} is not a version; give major.minor[.patch], e.g. 2.14.1')
    return int(match.group(1)), int(match.group(2) or 0), int(match.group(3) or 0)


def torch_release(version: str = torch.__version__) -> str:
    """The major.minor release of torch ``version`` (this torch's by default), as result file names carry it.

    Example:
        >>> torch_release('2.14.1+cu130'), torch_release('2.7')
        ('2.14', '2.7')
    """
    major, minor, _ = parse_version(version)
    return f'{major}.{minor}'


def _next_release(version: Version) -> Version:
    """The smallest version after ``version``: what ``<=`` and ``>`` bound at."""
    return version[0], version[1], version[2] + 1


def _clause_bounds(clause: str) -> tuple[Optional[Version], Optional[Version]]:
    """(first, fixed) of one clause such as '>=2.7' or '<2.15'."""
    operator = next((op for op in _OPERATORS if clause.startswith(op)), None)
    if operator is None:
        raise ValueError(f'torch version clause {clause!r} must start with >=, <=, ==, > or <')
    bound = parse_version(clause[len(operator) :].strip())
    return {
        '>=': (bound, None),
        '>': (_next_release(bound), None),
        '<': (None, bound),
        '<=': (None, _next_release(bound)),
        '==': (bound, _next_release(bound)),
    }[operator]


def _format_version(version: Version) -> str:
    return '.'.join(map(str, version[:2] if version[2:] == (0,) else version))


class VersionSpec(NamedTuple):
    """The torch releases from ``first`` (included) up to ``fixed`` (excluded); None leaves that
    end open, so ``VersionSpec()`` is every release.

    Attributes:
        first: the first release in the range, or None.
        fixed: the first release after the range (the one that fixed a bug), or None.
    """

    first: Optional[Version] = None
    fixed: Optional[Version] = None

    @classmethod
    def parse(cls, text: str) -> VersionSpec:
        """The range of every clause of ``text`` at once ('>=2.7,<2.15'; '' is every release)."""
        lowers, uppers = [], []
        for clause in filter(None, (c.strip() for c in text.split(','))):
            first, fixed = _clause_bounds(clause)
            lowers += [first] if first is not None else []
            uppers += [fixed] if fixed is not None else []
        return cls(max(lowers, default=None), min(uppers, default=None))

    @classmethod
    def of(cls, value: Union[str, tuple, VersionSpec]) -> VersionSpec:
        """``value`` as a spec: clauses as text, or a (first, fixed) pair."""
        return cls.parse(value) if isinstance(value, str) else cls(*value)

    def contains(self, version: Union[str, tuple[int, ...]]) -> bool:
        """True when the torch ``version`` ('2.14.1+cu130' or (2, 14, 1)) is in the range."""
        release = parse_version(version) if isinstance(version, str) else tuple(version)
        return (self.first is None or release >= self.first) and (self.fixed is None or release < self.fixed)

    def __str__(self) -> str:
        if self.first is not None and self.fixed == _next_release(self.first):
            return f'=={_format_version(self.first)}'
        bounds = [(op, v) for op, v in (('>=', self.first), ('<', self.fixed)) if v is not None]
        return ','.join(f'{op}{_format_version(v)}' for op, v in bounds)


def version_in(version: str, spec: str) -> bool:
    """True when ``version`` satisfies every clause of ``spec`` ('>=2.7,<2.15'; '' is any).

    Example:
        >>> version_in('2.14.1+cu130', '>=2.7,<2.15'), version_in('2.15.0', '>=2.7,<2.15')
        (True, False)
    """
    return VersionSpec.parse(spec).contains(version)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer; the CPU when it has none."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device('cpu')


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

    torch_version: Version
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
