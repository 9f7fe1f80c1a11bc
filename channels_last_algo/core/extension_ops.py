"""Extension ops: custom operators from outside PyTorch and torchvision, which may assume NCHW memory.

An op registered with ``torch.library`` by a user or a third-party package (``torch.ops.myext.op``)
has a kernel that nobody here has seen. Many read ``data_ptr()`` in memory order or call
``.view(-1)``, as their inputs are contiguous in NCHW: given an NHWC tensor they compute on permuted
values, or raise. :func:`extension_op` tells such an op from PyTorch's and torchvision's own, and
:func:`run_on_contiguous` runs it as NCHW would: on contiguous copies of the tensors named, with
what it writes in place written back.

Example:
    >>> import torch
    >>> @torch.library.custom_op('docs_example::first_values', mutates_args=())
    ... def first_values(x: torch.Tensor) -> torch.Tensor:
    ...     return x.view(-1)[:3].clone()          # memory order: NCHW's
    >>> x = torch.arange(16.0).reshape(1, 4, 2, 2).to(memory_format=torch.channels_last)
    >>> op = extension_op(torch.ops.docs_example.first_values.default)
    >>> op.name(), run_on_contiguous(op, (x,), {}, [x]).tolist()
    ('docs_example::first_values', [0.0, 1.0, 2.0])
    >>> extension_op(torch.ops.aten.relu.default) is None
    True
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ['extension_op', 'run_on_contiguous']

# the namespaces of the ops PyTorch and torchvision register (their kernels follow strides)
_OWN_NAMESPACES = frozenset(
    {'aten', 'prims', 'prim', 'higher_order', 'torchvision', 'image', 'sparse', 'profiler', 'export'}
    | {'mkl', 'mkldnn', 'mkldnn_prepacked', 'onednn', 'prepacked', 'quantized', '_quantized', 'quantization'}
    | {'inductor', 'inductor_prims', 'rngprims', 'debugprims', 'debug_mode_ops', 'flex_lib', 'streams', 'mempool'}
    | {'c10d', 'c10d_functional', '_c10d_functional', '_c10d_functional_autograd', '_dtensor', 'fsdp', 'symm_mem'}
    | {'onnx', 'onnx_symbolic', 'static_runtime', 'coor', '_native', '_test', '_inductor_test'}
)
OP_TYPES = (OpOverload, OpOverloadPacket)
"""The types an operator call from ``torch.ops`` comes as to a ``TorchFunctionMode``."""


def extension_op(func: Any) -> Optional[OpOverload]:
    """``func`` as an overload, where it is an operator from outside PyTorch and torchvision (a packet
    with more than one overload: None, which one runs is not known here)."""
    if isinstance(func, OpOverloadPacket):
        overloads = func.overloads()
        func = getattr(func, overloads[0]) if len(overloads) == 1 else None
    if not isinstance(func, OpOverload) or func.namespace in _OWN_NAMESPACES:
        return None
    return func


def run_on_contiguous(op: OpOverload, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
    """``op(*args, **kwargs)`` with contiguous copies of ``tensors``; what the op writes in place
    (``Tensor(a!)`` in its schema) is copied back into the tensors the caller holds, and an output
    that is an input's copy is that input."""
    copies = {id(tensor): (tensor, tensor.contiguous()) for tensor in tensors}

    def swapped(tensor: torch.Tensor) -> torch.Tensor:
        return copies[id(tensor)][1] if id(tensor) in copies else tensor

    result = op(*tree_map_only(torch.Tensor, swapped, args), **tree_map_only(torch.Tensor, swapped, kwargs))
    for position, argument in enumerate(op._schema.arguments):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            for tensor in tree_leaves(value):
                if isinstance(tensor, torch.Tensor) and id(tensor) in copies:
                    tensor.copy_(copies[id(tensor)][1])
    originals = {id(copy): original for original, copy in copies.values()}
    return tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), result)
