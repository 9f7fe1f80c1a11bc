"""The swap engine: a module changes class in place for an equivalent one, and says so in a
:class:`~channels_last_algo.core.swap_records.SwapRecord`.

Two tables swap modules, each row a :class:`SwapRow`, each table for its reason, the record's ``kind``:

- ``'repair'``: a repair rule (:mod:`channels_last_algo.core.layers.repair_rules`) replaces a layer that
  drops NHWC by one that keeps it;
- ``'safe_path'``: a known layout kernel bug (:mod:`channels_last_algo.core.safety.bugs`) routes a
  layer around the failing kernel.

A row matches a module by what it computes (:func:`swappable`): its class is the row's original
type, or a subclass that keeps every method the replacement takes over (:func:`taken_over`: its
``forward``, say, and ``_conv_forward`` for a convolution). A subclass that only sets itself up
differently (its own ``__init__`` or ``reset_parameters``) or a parametrized module
(``torch.nn.utils.parametrize``) is swapped; one with its own ``forward`` is not, and
:func:`uncovered` names it. The replacement must subclass the original, derive from
:class:`Replacement` and add no state: the module keeps its ``Parameter`` and buffer objects (an
optimizer built before stays valid), its hooks and its ``state_dict`` keys. A subclass gets a
class that derives from both the replacement and its own class (:func:`swap_class`), so its
``isinstance`` checks, parametrizations and overrides still hold. :func:`swap_first_match` is the
one place that reassigns a module's ``__class__``; :func:`swap_back` gives the exact class back, and
:func:`swap_in` the swapped one again.

A swapped module pickles as the class it had before (:class:`Replacement`), so a whole model
saved with ``torch.save`` loads where this package is not installed; its copies keep the swap.

Example:
    >>> import torch
    >>> class Halved(Replacement, torch.nn.ReLU):
    ...     def forward(self, x):
    ...         return super().forward(x) / 2
    >>> row = SwapRow(name='halve', original=torch.nn.ReLU, replacement=Halved, devices=('cpu',), torch_versions='')
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> records = swap_first_match(model, [row], 'repair', lambda row, module: True)
    >>> [(r.path, r.kind, r.reason, r.original, r.replacement) for r in records]
    [('1', 'repair', 'halve', 'torch.nn.modules.activation.ReLU', 'Halved')]
    >>> type(model[1]).__name__, swap_first_match(model, [row], 'repair', lambda row, module: True)
    ('Halved', [])
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Optional, TypeVar, Union

from torch import nn

from channels_last_algo.core.runtime import VersionSpec
from channels_last_algo.core.swap_records import SwapRecord, UncoveredLayer

__all__ = [
    'LayerType',
    'Replacement',
    'SwapRow',
    'first_matches',
    'original_class',
    'overridden',
    'qualified_name',
    'require_subclass',
    'resolve',
    'swap_back',
    'swap_class',
    'swap_first_match',
    'swap_in',
    'swappable',
    'taken_over',
    'uncovered',
    'unswapped_class',
]


def qualified_name(cls: type) -> str:
    """``'torch.nn.modules.conv.Conv2d'`` for ``nn.Conv2d``."""
    return f'{cls.__module__}.{cls.__qualname__}'


class Replacement:
    """The base of every replacement class. A swapped module pickles as the class it had before
    the swap (:func:`unswapped_class`) with the same state, so ``torch.save(model)`` loads where
    this package is not installed; ``copy.copy`` and ``copy.deepcopy`` (EMA, the package's own
    copies) keep the swapped class. Copies take the state ``nn.Module`` pickles, also for a
    parametrized module, whose ``__getstate__`` refuses pickling but whose copies torch allows.

    Example:
        >>> import copy, pickle, torch
        >>> class Doubled(Replacement, torch.nn.ReLU):
        ...     def forward(self, x):
        ...         return torch.relu(x) * 2
        >>> module = torch.nn.ReLU()
        >>> module.__class__ = Doubled
        >>> type(pickle.loads(pickle.dumps(module))).__name__, type(copy.deepcopy(module)).__name__
        ('ReLU', 'Doubled')
    """

    def __reduce_ex__(self, protocol: int) -> tuple:
        original = unswapped_class(type(self))
        return original.__new__, (original,), self.__getstate__()

    def __copy__(self) -> Any:
        copied = type(self).__new__(type(self))
        copied.__setstate__(nn.Module.__getstate__(self))
        return copied

    def __deepcopy__(self, memo: dict) -> Any:
        return deep_copy_from_state(self, nn.Module.__getstate__(self), memo)


def deep_copy_from_state(module: nn.Module, state: dict, memo: dict) -> nn.Module:
    """A deep copy of ``module`` as ``copy.deepcopy`` makes one: an object of its class given ``state`` deep-copied."""
    copied = type(module).__new__(type(module))
    memo[id(module)] = copied
    copied.__setstate__(copy.deepcopy(state, memo))
    return copied


def unswapped_class(cls: type) -> type:
    """The class a module of class ``cls`` had before its swap: the one after :class:`Replacement`
    in its method resolution order (every replacement names ``Replacement`` first, then the
    original; :func:`swap_class` puts the module's class after the replacement), or ``cls``
    itself where it is no swap."""
    order = cls.__mro__
    return order[order.index(Replacement) + 1] if Replacement in order else cls


LayerType = Union[type, str]
"""A layer class, or its qualified name (imported only when a model holds it)."""


def resolve(layer: LayerType) -> type:
    """``layer`` itself, or the class its qualified name names, imported now."""
    if isinstance(layer, type):
        return layer
    module, _, name = layer.rpartition('.')
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwapRow:
    """One row of a swap table (a repair rule, a kernel bug): which layer type is swapped for
    which replacement, and on which devices and torch versions the row holds.

    A table says in :meth:`reaches` when a module needs its row, given where the model runs
    (a device, a runtime); :meth:`matches` adds that the swap keeps what the module computes.

    Attributes:
        name: short identifier, the ``reason`` of its :class:`SwapRecord`.
        original: the layer type, or its qualified name; its subclasses that keep the methods the
            replacement takes over match too (:func:`swappable`).
        replacement: a subclass of ``original`` and of :class:`Replacement` that adds no state,
            or its qualified name (imported when a model holds ``original``).
        devices: the device types the row holds on.
        torch_versions: the torch versions it holds for, a
            :class:`~channels_last_algo.core.runtime.VersionSpec` or its clauses ('>=2.7').

    Example:
        >>> from channels_last_algo.core.layers.safe_paths import SubsampledConv2d
        >>> row = SwapRow(
        ...     name='x', original=nn.Conv2d, replacement=SubsampledConv2d, devices=('cpu',), torch_versions='<2.14'
        ... )
        >>> row.original_name, row.holds_on('cpu', '2.13.1'), row.holds_on('cpu', '2.14.0'), row.holds_on('cuda', '2.7')
        ('torch.nn.modules.conv.Conv2d', True, False, False)
    """

    row_kind: ClassVar[str] = 'swap row'  # how an error names a row: "repair rule 'x'"
    replacement_role: ClassVar[str] = 'replacement'  # and its replacement: 'safe path'
    class_name: ClassVar[Callable[[type], str]] = staticmethod(qualified_name)  # and the classes

    name: str
    original: LayerType
    replacement: LayerType
    devices: tuple[str, ...]
    torch_versions: VersionSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, 'torch_versions', VersionSpec.of(self.torch_versions))
        if isinstance(self.original, type) and isinstance(self.replacement, type):
            self.replacement_type()

    @property
    def original_name(self) -> str:
        """The qualified name of ``original``."""
        return self.original if isinstance(self.original, str) else qualified_name(self.original)

    def replacement_type(self) -> type:
        """The replacement class (imported now if named by a string), checked with :func:`require_subclass`."""
        return require_subclass(
            resolve(self.replacement),
            resolve(self.original),
            f'{self.row_kind} {self.name!r}',
            self.replacement_role,
            name=self.class_name,
        )

    def holds_on(self, device_type: str, torch_version: Union[str, tuple[int, ...]]) -> bool:
        """True when the row holds on ``device_type`` ('cpu') with ``torch_version`` ('2.14.1', (2, 14, 1))."""
        return device_type in self.devices and self.torch_versions.contains(torch_version)

    def unswapped_original(self, module: nn.Module) -> bool:
        """True when ``module``'s class is ``original`` or a subclass, not swapped by this row yet."""
        return original_class(module, self) is not None and not isinstance(module, self.replacement_type())

    def reaches(self, module: nn.Module, where: Any) -> bool:
        """True when ``module`` needs this row's swap in a model that runs ``where``; each table says."""
        raise NotImplementedError(f'{type(self).__name__}.reaches')

    def matches(self, module: nn.Module, where: Any) -> bool:
        """True when ``module`` :meth:`reaches` this row and computes as ``original``
        (:func:`swappable`), so the swap may replace its class."""
        return swappable(module, self) and self.reaches(module, where)


Row = TypeVar('Row')


def require_subclass(replacement: type, original: type, row: str, role: str, name=qualified_name) -> type:
    """``replacement``, which must subclass ``original`` so that a swapped module keeps its
    state, with :class:`Replacement` as its first base and ``original`` next, so that it pickles
    as ``original``; TypeError naming ``row`` (``"repair rule 'x'"``), the ``role`` of the
    replacement and the classes (named by ``name``) otherwise."""
    declaration = f'class {replacement.__name__}(Replacement, {original.__name__})'
    if not issubclass(replacement, original):
        raise TypeError(
            f'{row}: {role} {name(replacement)} must subclass {name(original)} so that the swapped module keeps '
            f'its state; declare it as {declaration} and override forward only'
        )
    if unswapped_class(replacement) is not original:
        raise TypeError(
            f'{row}: {role} {name(replacement)} must subclass {name(Replacement)}, then {name(original)}, so that '
            f'the swapped module pickles as the original; declare it as {declaration}'
        )
    return replacement


def original_class(module: nn.Module, row: SwapRow) -> Optional[type]:
    """The row's original type among ``module``'s class and its bases (found by qualified
    name, so a row may name a class of a library that is not imported); None where absent."""
    return next((cls for cls in type(module).__mro__ if qualified_name(cls) == row.original_name), None)


def _layer_methods(original: type) -> set[str]:
    """The methods (not dunders) that ``original`` and its bases below ``nn.Module`` define."""
    return {
        name
        for cls in original.__mro__[: original.__mro__.index(nn.Module)]
        for name, value in vars(cls).items()
        if not name.startswith('__') and isinstance(value, (types.FunctionType, staticmethod, classmethod))
    }


def _names_in(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` and the functions nested in it use."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names_in(constant)


def _code(owner: type, name: str) -> Optional[types.CodeType]:
    """The code of ``owner``'s method ``name`` (a function, a static or a class method); None if none."""
    value = inspect.getattr_static(owner, name, None)
    return getattr(getattr(value, '__func__', value), '__code__', None)


@functools.cache
def taken_over(original: type, replacement: type) -> frozenset[str]:
    """The methods of ``original`` that a swap to ``replacement`` stops running as they are:
    ``forward``, the ones the replacement defines, and the ones that the original's versions of
    these call by name (``_conv_forward`` in ``nn.Conv2d.forward``), and so on.

    Example:
        >>> from channels_last_algo.core.layers.safe_paths import SubsampledConv2d
        >>> sorted(taken_over(nn.Conv2d, SubsampledConv2d))
        ['_conv_forward', 'forward']
    """
    methods = _layer_methods(original)
    names = {'forward'} | (methods & set(vars(replacement)))
    pending = list(names)
    while pending:
        code = _code(original, pending.pop())
        called = (set(_names_in(code)) & methods) - names if code else set()
        names |= called
        pending += called
    return frozenset(names)


def overridden(module: nn.Module, row: SwapRow) -> tuple[str, ...]:
    """The methods that a swap by ``row`` takes over (:func:`taken_over`) and that ``module``'s
    class defines itself, sorted; empty where it computes as the row's original, or is none."""
    original = original_class(module, row)
    if original is None:
        return ()
    own = type(module)
    return tuple(
        sorted(
            name
            for name in taken_over(original, row.replacement_type())
            if inspect.getattr_static(own, name, None) is not inspect.getattr_static(original, name, None)
        )
    )


def swappable(module: nn.Module, row: SwapRow) -> bool:
    """True when a swap by ``row`` keeps what ``module`` computes: its class is the row's
    original, or a subclass that defines none of the methods the swap takes over (one with its
    own ``__init__`` or ``reset_parameters``, a parametrized module)."""
    return original_class(module, row) is not None and not overridden(module, row)


@functools.cache
def _combined(replacement: type, module_class: type) -> type:
    return type(
        replacement.__name__,
        (replacement, module_class),
        {'__module__': replacement.__module__, '__doc__': f'{replacement.__name__} for a {module_class.__name__}.'},
    )


def swap_class(module_class: type, replacement: type) -> type:
    """The class a module of ``module_class`` gets for ``replacement``: the replacement itself
    where it subclasses ``module_class`` (the row's original), else a class derived from both,
    made once per pair, whose methods are the replacement's first and then ``module_class``'s.

    Example:
        >>> from channels_last_algo.core.layers.safe_paths import SubsampledConv2d
        >>> class Stem(nn.Conv2d):
        ...     def reset_parameters(self):
        ...         nn.init.zeros_(self.weight)
        >>> swapped = swap_class(Stem, SubsampledConv2d)
        >>> swapped.__name__, issubclass(swapped, Stem), swapped.forward is SubsampledConv2d.forward
        ('SubsampledConv2d', True, True)
        >>> swap_class(nn.Conv2d, SubsampledConv2d) is SubsampledConv2d, swap_class(Stem, SubsampledConv2d) is swapped
        (True, True)
    """
    return replacement if issubclass(replacement, module_class) else _combined(replacement, module_class)


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
    """Swap, in place, the class of every module of ``model`` that a row may swap
    (:func:`swappable`) and ``matches``, for the first such row's replacement (:func:`swap_class`).

    Returns:
        One :class:`SwapRecord` of ``kind`` per swapped module, in ``named_modules`` order.
    """
    records = []
    for path, module, row in first_matches(model, rows, lambda r, m: swappable(m, r) and matches(r, m)):
        original, replacement = type(module), row.replacement_type()
        module.__class__ = swap_class(original, replacement)
        records.append(SwapRecord(path, kind, row.name, qualified_name(original), replacement.__name__))
    return records


def uncovered(
    model: nn.Module, rows: Sequence[SwapRow], kind: str, reaches: Callable[[SwapRow, nn.Module], bool]
) -> list[UncoveredLayer]:
    """Every module of ``model`` that a row ``reaches`` (its settings need the row's swap; false
    for a module swapped already) but whose class overrides a method the swap takes over
    (:func:`overridden`), so that no swap may replace it; the first such row per module, in
    ``named_modules`` order."""
    found = first_matches(model, rows, lambda r, m: reaches(r, m) and bool(overridden(m, r)))
    return [
        UncoveredLayer(path, kind, row.name, qualified_name(type(module)), overridden(module, row))
        for path, module, row in found
    ]


def swap_back(module: nn.Module, original: type) -> None:
    """Give a swapped ``module`` its ``original`` class again, exactly (a base of its class: same state)."""
    if not isinstance(module, original):
        raise TypeError(f'{type(module).__name__} is no swap of {qualified_name(original)}')
    module.__class__ = original


def swap_in(module: nn.Module, swapped: type) -> None:
    """Give ``module``, which :func:`swap_back` gave its original class, its ``swapped`` class again (a subclass:
    same state)."""
    if not issubclass(swapped, type(module)):
        raise TypeError(f'{qualified_name(swapped)} is no swap of {type(module).__name__}')
    module.__class__ = swapped
