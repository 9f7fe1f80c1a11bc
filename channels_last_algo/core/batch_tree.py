"""A batch as (path, leaf) pairs, and the same batch rebuilt with some leaves replaced.

A batch is what a data loader yields: a tensor, or containers of them. The walker opens tuples,
lists, namedtuples, every ``Mapping`` (dicts, ``OrderedDict``, ``defaultdict``, ``UserDict``
subclasses such as HuggingFace's ``BatchFeature``, dict subclasses such as EasyDict), dataclass
instances, ``types.SimpleNamespace``, and any other object whose ``__dict__`` holds a tensor
(modules and tensors excepted). Anything else is a leaf. A path is the tuple of plain keys from
the batch to a leaf: dict keys, positions, field and attribute names (``()`` for the batch itself).

:func:`map_leaves` never changes the batch it is given. It rebuilds, as the same type, only the
containers whose leaves changed: tuples and namedtuples anew, the others by ``copy.copy`` and
setting the changed items, fields or attributes. A container that cannot be rebuilt so is left as
it came, its leaves unchanged, with one warning per type.

Example:
    >>> import dataclasses, torch
    >>> @dataclasses.dataclass(frozen=True)
    ... class Batch:
    ...     image: torch.Tensor
    ...     labels: dict
    >>> batch = Batch(torch.zeros(2, 3, 4, 4), {'class': [torch.tensor(0), torch.tensor(1)]})
    >>> [path for path, leaf in leaves(batch)]
    [('image',), ('labels', 'class', 0), ('labels', 'class', 1)]
    >>> plus_one = map_leaves(batch, lambda path, leaf: leaf + 1 if path[0] == 'labels' else leaf)
    >>> type(plus_one).__name__, plus_one.image is batch.image, plus_one.labels['class'][1].item()
    ('Batch', True, 2)
    >>> batch.labels['class'][1].item()
    1
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import types
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, NamedTuple, Optional

import torch

__all__ = ['BatchTensor', 'Path', 'leaves', 'map_leaves', 'path_name']

log = logging.getLogger(__name__)

Path = tuple[Hashable, ...]
Children = list[tuple[Hashable, Any]]

_warned: set[type] = set()  # the container types whose rebuild failed, warned about once


class BatchTensor(NamedTuple):
    """The batch's tensor at ``path``, as a watch notes it among the origins of what derives from it: NHWC because
    the guard made it so, where leaving it as it comes would lay it out as NCHW has it.

    Example:
        >>> path_name(BatchTensor((0,)).path)
        'batch[0]'
    """

    path: Path


def path_name(path: Path) -> str:
    """``batch['image']``, ``batch[0]``, ``batch`` for the batch itself."""
    return 'batch' + ''.join(f'[{key!r}]' for key in path)


def leaves(batch: Any) -> list[tuple[Path, Any]]:
    """Every leaf of ``batch`` with its path, in order."""
    return list(_walk(batch, (), frozenset()))


def map_leaves(batch: Any, replace: Callable[[Path, Any], Any]) -> Any:
    """``batch`` with each leaf replaced by ``replace(path, leaf)``: the containers whose leaves
    changed rebuilt as the same type, the rest (and ``batch`` itself) untouched."""
    return _map(batch, (), replace, frozenset())


def _walk(node: Any, path: Path, above: frozenset[int]) -> Iterator[tuple[Path, Any]]:
    children = None if id(node) in above else _children(node)  # a container inside itself: a leaf there
    if children is None:
        yield path, node
        return
    inside = above | {id(node)}
    for key, child in children:
        yield from _walk(child, (*path, key), inside)


def _map(node: Any, path: Path, replace: Callable[[Path, Any], Any], above: frozenset[int]) -> Any:
    children = None if id(node) in above else _children(node)
    if children is None:
        return replace(path, node)
    changed, inside = {}, above | {id(node)}
    for key, child in children:
        new = _map(child, (*path, key), replace, inside)
        if new is not child:
            changed[key] = new
    return _rebuilt(node, dict(children), changed, path) if changed else node


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, '_fields')


def _is_dataclass_instance(node: Any) -> bool:
    return dataclasses.is_dataclass(node) and not isinstance(node, type)


def _is_attribute_container(node: Any) -> bool:
    """A ``SimpleNamespace``, or an object (not a module) whose ``__dict__`` holds a tensor."""
    if isinstance(node, types.SimpleNamespace):
        return True
    attributes = getattr(node, '__dict__', None)
    return (
        not isinstance(node, torch.nn.Module)
        and isinstance(attributes, dict)
        and any(isinstance(value, torch.Tensor) for value in attributes.values())
    )


def _children(node: Any) -> Optional[Children]:
    """A container's (key, child) pairs; None for a leaf."""
    if isinstance(node, torch.Tensor):
        return None
    if _is_namedtuple(node):
        return list(zip(node._fields, node))
    if isinstance(node, (tuple, list)):
        return list(enumerate(node))
    if isinstance(node, Mapping):
        return [(key, node[key]) for key in node]
    if _is_dataclass_instance(node):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node) if hasattr(node, f.name)]
    if _is_attribute_container(node):
        return list(vars(node).items())
    return None


def _assign(container: Any, key: Hashable, value: Any) -> None:
    """Set one item, field or attribute of a (copied) container."""
    if isinstance(container, (list, Mapping)):
        container[key] = value
    elif _is_dataclass_instance(container):
        object.__setattr__(container, key, value)  # frozen dataclasses too
    else:
        setattr(container, key, value)


def _copy_with(node: Any, changed: dict[Hashable, Any]) -> Any:
    """``node``'s type holding its children with ``changed`` replaced."""
    if _is_namedtuple(node):
        return node._replace(**changed)
    if isinstance(node, tuple):
        return type(node)(changed.get(index, child) for index, child in enumerate(node))
    new = copy.copy(node)
    for key, value in changed.items():
        _assign(new, key, value)
    return new


def _rebuilt(node: Any, children: dict[Hashable, Any], changed: dict[Hashable, Any], path: Path) -> Any:
    """:func:`_copy_with`, or ``node`` as it came (warned once per type) where that fails or where the
    copy wrote into ``node``'s own items (which then get their values back)."""
    try:
        new, reason = _copy_with(node, changed), None
    except Exception as error:  # a container of the user's: its copy or its setters may raise anything
        new, reason = node, f'{type(error).__name__}: {error}'
    written = [key for key, now in _children(node) if key in changed and now is not children[key]]
    for key in written:
        _assign(node, key, children[key])
    if written:
        new, reason = node, reason or f'copy.copy({type(node).__name__}) shares its items with the original'
    if reason is not None:
        _warn_once(node, path, reason)
    return new


def _warn_once(node: Any, path: Path, reason: str) -> None:
    kind = type(node)
    if kind in _warned:
        return
    _warned.add(kind)
    log.warning(
        'channels last: cannot rebuild %s, a %s (%s), so its tensors stay as they came. Pass the images in a tuple, '
        'list or dict, make %s copyable with copy.copy and settable, or leave its tensors out with inputs=[...].',
        path_name(path),
        kind.__qualname__,
        reason,
        kind.__name__,
    )
