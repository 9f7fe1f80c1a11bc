"""Extension functions bound with pybind11, whose kernels may read their tensors' memory as NCHW lays it out.

A C++ or CUDA extension built with ``torch.utils.cpp_extension`` (``load``, ``load_inline``, a setup.py
``CppExtension``) or shipped by a package (mmcv's ``_ext``, detectron2's ``_C``) exposes its kernels as
pybind11 functions, ``ext.forward(input, weight)``. Many walk ``data_ptr()`` in memory order, as NCHW
hands them contiguous tensors: given an NHWC one they compute on permuted values, silently, and no
mode or audit sees them, as they are no torch op (``torch.library`` ops are
:mod:`~channels_last_algo.core.extension_ops`'). :func:`cover_extension_functions` finds them in the
extension modules imported and those a converted model's code reaches (one ``cpp_extension`` loaded
into a name of the model's file, its module's attribute or a closure, has no name in ``sys.modules``):
the builtins a compiled module outside torch defines whose pybind11 signature names ``torch.Tensor``. It
puts :func:`contiguous_call` in each one's place on its module, which gives the kernel contiguous copies
of its channels-last tensors, writes back into the caller's tensor what the kernel wrote into a copy
(as the kernel itself would: no version bump), and logs the function once, with where it was called.
Code that looks the function up on its module at each call (``ext.forward(...)``, as mmcv and detectron2
do) gets the wrapper, and so does a name the model's code bound before (``from ext import forward`` in its
file, a module attribute); a name held elsewhere, or in a closure, keeps the kernel. An extension loaded
later, while such a model lives (a plugin built on the first forward, as StyleGAN's ``custom_ops`` builds
its kernels, an ``import`` inside a function), is covered as it loads: :func:`cover_extension_functions`
puts :func:`_exec_and_cover` in ``ExtensionFileLoader.exec_module``'s place, through which every
extension module loads (``torch.utils.cpp_extension.load`` and ``load_inline`` too). The wrappers stay
while a model they were put in for lives (a model stays NHWC after training).

Example:
    >>> import types, torch
    >>> ext = types.ModuleType('ext')
    >>> def first_values(x):                    # a kernel that reads memory in order
    ...     return torch.as_strided(x, (3,), (1,)).clone()
    >>> ext.first_values = contiguous_call(first_values, 'ext.first_values')
    >>> x = torch.arange(16.0).reshape(1, 4, 2, 2).to(memory_format=torch.channels_last)
    >>> ext.first_values(x).tolist()            # as NCHW memory has them (NHWC's: 0, 4, 8)
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from channels_last_algo.core.layout import is_4d_or_5d, layout_of
from channels_last_algo.core.view_watch import calling_code

__all__ = ['contiguous_call', 'cover_extension_functions']

log = logging.getLogger(__name__)

_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_TORCH_PACKAGES = frozenset({'torch', 'torchvision', 'torchaudio', 'functorch'})  # kernels that follow strides
_covered: dict[tuple[int, str], tuple[dict, Any]] = {}  # (namespace id, name) -> (the namespace, the kernel)
_holders = [0]  # how many times a model alive was covered: the wrappers come off at 0
_named: set[str] = set()  # functions logged
_imported: list = [-1, []]  # the length of sys.modules when last looked through, and its extension modules then
_LOADER = importlib.machinery.ExtensionFileLoader
_EXEC_MODULE = _LOADER.exec_module  # how an extension module loads, put back once no model covered lives


def _channels_last(value: Any) -> bool:
    """A dense channels-last 4D/5D tensor, whose memory order differs from NCHW's."""
    return is_4d_or_5d(value) and value.layout == torch.strided and layout_of(value).is_channels_last


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN."""
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all()))


def contiguous_call(kernel: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``kernel`` given contiguous copies of its channels-last tensor arguments (in lists and dicts too);
    what it wrote into a copy is written back to the tensor passed, and an output that is a copy is the
    tensor passed. Logs ``name`` and the calling code the first time it takes such a tensor."""

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        copies = {id(leaf): (leaf, leaf.contiguous()) for leaf in leaves if _channels_last(leaf)}
        if not copies:
            return kernel(*args, **kwargs)
        if name not in _named:
            _named.add(name)
            log.warning(
                'channels last: the extension function %s at %s takes NHWC tensors: it is given contiguous copies, '
                'as in NCHW, and what it writes into them reaches the tensors passed',
                name,
                calling_code(),
            )
        args, kwargs = tree_unflatten([copies[id(x)][1] if id(x) in copies else x for x in leaves], spec)
        result = kernel(*args, **kwargs)
        with torch.no_grad():
            for original, copy in copies.values():
                if copy.shape != original.shape:  # resized, as an out= argument is: the caller's tensor takes it
                    original.data = copy
                elif not _same(original, copy):
                    original.data.copy_(copy)  # written as the kernel writes: autograd's version counter unmoved
        originals = {id(copy): original for original, copy in copies.values()}
        return tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), result)

    call.__name__, call.__qualname__, call.__wrapped__ = getattr(kernel, '__name__', name), name, kernel
    return call


def _top_package(module: types.ModuleType) -> str:
    return str(vars(module).get('__name__', '')).split('.')[0]


def _namespaces_of(value: Any) -> list[dict]:
    """Where code in ``value`` finds names: a function's globals and closure, a class's functions', a module's own;
    none for torch's. Types are read with ``type()``: no proxy's ``__class__`` runs."""
    kind = type(value)
    if issubclass(kind, type):
        if str(vars(value).get('__module__', '')).split('.')[0] in _TORCH_PACKAGES:
            return []
        functions = (getattr(attribute, '__func__', attribute) for attribute in list(vars(value).values()))
        return [n for f in functions if type(f) is types.FunctionType for n in _namespaces_of(f)]
    if kind is types.FunctionType:
        return [value.__globals__, _closure(value)]
    if issubclass(kind, types.ModuleType) and _top_package(value) not in _TORCH_PACKAGES:
        return [vars(value)]
    return []


class _Cells(dict):
    """The values a function's closure holds, as a namespace to look through (not to write: its cells hold them)."""


def _closure(function: types.FunctionType) -> _Cells:
    values = _Cells()
    for index, cell in enumerate(function.__closure__ or ()):
        try:
            values[str(index)] = cell.cell_contents
        except ValueError:  # a free variable not bound yet
            continue
    return values


def _extension_module(value: Any) -> bool:
    """A compiled module outside torch (its ``__file__`` read from its namespace: no lazy ``__getattr__`` runs)."""
    if not issubclass(type(value), types.ModuleType):
        return False
    path = vars(value).get('__file__')
    return isinstance(path, str) and path.endswith(_SUFFIXES) and _top_package(value) not in _TORCH_PACKAGES


def _kernel(value: Any) -> bool:
    """A builtin of a compiled module outside torch whose pybind11 signature (its docstring) names ``torch.Tensor``."""
    if type(value) is not types.BuiltinFunctionType:
        return False
    defined_in = str(getattr(value, '__module__', None) or 'builtins').split('.')[0]
    return defined_in not in _TORCH_PACKAGES and defined_in != 'builtins' and 'torch.Tensor' in (value.__doc__ or '')


def _defines(module: types.ModuleType, function: Any) -> bool:
    """Whether ``module`` defined ``function`` (not one it imported)."""
    return function.__module__ in (module.__name__, module.__name__.rpartition('.')[2])


def _reachable(model: torch.nn.Module) -> tuple[list[dict], list[types.ModuleType]]:
    """The namespaces the model's code finds names in (its modules' attributes, the globals and closures of their
    classes' code) and, one step further, those of a module, function or class found there (an ``autograd.Function``
    whose ``forward`` calls ``ext.op``, a package's ops module that loaded ``_C``); the extension modules among them."""
    nearest = [n for m in model.modules() for n in [vars(m), *_namespaces_of(type(m))]]
    seen, further, modules = {id(n) for n in nearest}, [], {}
    for namespace in nearest:
        for value in list(namespace.values()):
            if _extension_module(value):
                modules[id(value)] = value
                continue
            for inner in _namespaces_of(value):
                if id(inner) not in seen:
                    seen.add(id(inner))
                    further.append(inner)
    modules.update((id(v), v) for namespace in further for v in list(namespace.values()) if _extension_module(v))
    return nearest + further, list(modules.values())


def _imported_extensions() -> list[types.ModuleType]:
    """The extension modules in ``sys.modules`` (looked through again only when it changed)."""
    if len(sys.modules) != _imported[0]:
        _imported[:] = [len(sys.modules), [m for m in list(sys.modules.values()) if _extension_module(m)]]
    return _imported[1]


def cover_extension_functions(model: torch.nn.Module) -> list[str]:
    """Put :func:`contiguous_call` in place of every pybind11 function that takes tensors, on the extension modules
    imported and those ``model``'s code reaches, and where that code holds one under a name of its own
    (``from ext import forward``), and on each extension module loaded later, while ``model`` lives; the names of
    those put now."""
    _holders[0] += 1
    weakref.finalize(model, _uncover)
    _LOADER.exec_module = _exec_and_cover
    namespaces, reached = _reachable(model)
    modules = {id(m): m for m in [*_imported_extensions(), *reached]}.values()
    slots = [(vars(m), k) for m in modules for k in _defined_kernels(m)]
    slots += [(n, k) for n in namespaces if type(n) is not _Cells for k, v in list(n.items()) if _kernel(v)]
    return _cover(slots)


def _defined_kernels(module: types.ModuleType) -> list[str]:
    """The names of the kernels ``module`` defines."""
    return [k for k, v in list(vars(module).items()) if _kernel(v) and _defines(module, v)]


def _cover(slots: list[tuple[dict, str]]) -> list[str]:
    """:func:`contiguous_call` in each ``(namespace, name)``'s place that holds a kernel; the functions' names."""
    covered = []
    for namespace, key in slots:
        kernel = namespace[key]
        if _kernel(kernel):
            _covered.setdefault((id(namespace), key), (namespace, kernel))
            namespace[key] = contiguous_call(kernel, f'{kernel.__module__}.{kernel.__name__}')
            covered.append(f'{kernel.__module__}.{kernel.__name__}')
    return covered


def _exec_and_cover(loader: importlib.machinery.ExtensionFileLoader, module: types.ModuleType) -> None:
    """``ExtensionFileLoader.exec_module`` while a covered model lives: the module loads, then its kernels are
    covered, before any code can call them."""
    _EXEC_MODULE(loader, module)
    if _extension_module(module):
        _cover([(vars(module), k) for k in _defined_kernels(module)])


def _uncover() -> None:
    """A model covered died; once none lives, every kernel back in its place, and extensions load as before."""
    _holders[0] -= 1
    if _holders[0]:
        return
    _LOADER.exec_module = _EXEC_MODULE
    for (_, key), (namespace, kernel) in list(_covered.items()):
        if getattr(namespace.get(key), '__wrapped__', None) is kernel:
            namespace[key] = kernel
    _covered.clear()
