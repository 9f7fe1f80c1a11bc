"""The swap engine: a module changes class in place for an equivalent one, and says so in a
:class:`SwapRecord`.

Two tables swap modules, each for its reason, the record's ``kind``:

- ``'repair'``: a repair rule (:mod:`channels_last_algo.core.layers.rules`) replaces a layer that
  drops NHWC by one that keeps it;
- ``'safe_path'``: a known layout kernel bug (:mod:`channels_last_algo.core.safety.bugs`) routes a
  layer around the failing kernel.

A row matches a module of exactly its original type (a subclass has its own forward, which a
replacement would drop), and its replacement must subclass that type and add no state: the
module keeps its ``Parameter`` and buffer objects (an optimizer built before stays valid), its
hooks and its ``state_dict`` keys. :func:`swap_first_match` is the one place that reassigns
a module's ``__class__``.

Example:
    >>> import torch
    >>> class Halved(torch.nn.ReLU):
    ...     def forward(self, x):
    ...         return super().forward(x) / 2
    >>> class Row:
    ...     name, original_name = 'halve', qualified_name(torch.nn.ReLU)
    ...     def replacement_type(self):
    ...         return require_subclass(Halved, torch.nn.ReLU, "row 'halve'", 'replacement')
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> records = swap_first_match(model, [Row()], 'repair', lambda row, module: True)
    >>> [(r.path, r.kind, r.reason, r.original, r.replacement) for r in records]
    [('1', 'repair', 'halve', 'torch.nn.modules.activation.ReLU', 'Halved')]
    >>> type(model[1]).__name__, swap_first_match(model, [Row()], 'repair', lambda row, module: True)
    ('Halved', [])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from torch import nn

__all__ = [
    'KINDS',
    'SwapRecord',
    'SwapRow',
    'first_matches',
    'is_exact_type',
    'qualified_name',
    'require_subclass',
    'swap_back',
    'swap_first_match',
]

KINDS = ('repair', 'safe_path')
"""Why a module was changed: a repair rule, or a kernel bug's safe path."""


def qualified_name(cls: type) -> str:
    """``'torch.nn.modules.conv.Conv2d'`` for ``nn.Conv2d``."""
    return f'{cls.__module__}.{cls.__qualname__}'


@dataclasses.dataclass(frozen=True)
class SwapRecord:
    """One module that a swap table changed.

    Attributes:
        path: the module's name in ``model.named_modules()`` ('' for the model itself).
        kind: one of :data:`KINDS`.
        reason: the row applied: the repair rule's name or the kernel bug's name.
        original: qualified name of the module's type before.
        replacement: name of the class it has now.
    """

    path: str
    kind: str
    reason: str
    original: str
    replacement: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f'swap record kind {self.kind!r} must be one of {KINDS}')


class SwapRow(Protocol):
    """What the engine needs of a table row: its name, the qualified name of the type it
    matches, and its replacement class (checked with :func:`require_subclass`)."""

    name: str

    @property
    def original_name(self) -> str: ...

    def replacement_type(self) -> type: ...


Row = TypeVar('Row', bound=SwapRow)


def require_subclass(replacement: type, original: type, row: str, role: str, name=qualified_name) -> type:
    """``replacement``, which must subclass ``original`` so that a swapped module keeps its
    state; TypeError naming ``row`` (``"repair rule 'x'"``), the ``role`` of the replacement
    and both classes (named by ``name``) otherwise."""
    if not issubclass(replacement, original):
        raise TypeError(
            f'{row}: {role} {name(replacement)} must subclass {name(original)} so that the swapped module '
            f'keeps its state; derive the {role} from the original and override forward only'
        )
    return replacement


def is_exact_type(module: nn.Module, row: SwapRow) -> bool:
    """True when ``module``'s type is exactly the row's original (not a subclass of it)."""
    return qualified_name(type(module)) == row.original_name


def first_matches(
    model: nn.Module, rows: Iterable[Row], matches: Callable[[Row, nn.Module], bool]
) -> list[tuple[str, nn.Module, Row]]:
    """(path, module, row) for every module of ``model`` that a row ``matches``, the first such
    row per module, in ``named_modules`` order."""
    rows = list(rows)
    found = []
    for path, module in model.named_modules():
        row = next((r for r in rows if matches(r, module)), None)
        if row is not None:
            found.append((path, module, row))
    return found


def swap_first_match(
    model: nn.Module, rows: Sequence[SwapRow], kind: str, matches: Callable[[SwapRow, nn.Module], bool]
) -> list[SwapRecord]:
    """Swap, in place, the class of every module of ``model`` whose type is exactly a row's
    original (:func:`is_exact_type`) and that the row ``matches``, for the first such row's
    replacement.

    Returns:
        One :class:`SwapRecord` of ``kind`` per swapped module, in ``named_modules`` order.
    """
    records = []
    for path, module, row in first_matches(model, rows, lambda r, m: is_exact_type(m, r) and matches(r, m)):
        original, replacement = type(module), row.replacement_type()
        module.__class__ = replacement
        records.append(SwapRecord(path, kind, row.name, qualified_name(original), replacement.__name__))
    return records


def swap_back(module: nn.Module, original: type) -> None:
    """Give a swapped ``module`` its ``original`` class again (a base of its class: same state)."""
    if not isinstance(module, original):
        raise TypeError(f'{type(module).__name__} is no swap of {qualified_name(original)}')
    module.__class__ = original
