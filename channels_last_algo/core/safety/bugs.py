"""The table of known layout kernel bugs, and :func:`make_safe`, which routes the layers they
affect through a safe path.

A *layout kernel bug* is a kernel that crashes, hangs, computes wrong numbers, or returns NCHW
on channels-last tensors where the same op on NCHW tensors is right. Each :class:`KernelBug` row
names the op, the layer type and settings that reach it, the devices, torch versions and CPU
instruction sets it occurs on, a minimal reproduction (a Python script, run by
:func:`~channels_last_algo.core.safety.probe.run_code` in a child process), the failure, and
the safe path: a subclass of the layer that computes the same numbers without that kernel.
:func:`make_safe` swaps the class of every matching layer in place (same ``Parameter``
objects, buffers, hooks and ``state_dict`` keys) with the swap engine the repair rules use
(:mod:`channels_last_algo.core.swap`); the safe paths live with the other swapped layers
(:mod:`channels_last_algo.core.layers.safe_paths`). It is part of
:func:`~channels_last_algo.core.convert.apply_channels_last`.

The conditions are deliberately wider than where a crash was seen (a write past a buffer does
not crash every time; ``docs/safety.md`` has what the probes saw, per row): a safe path costs
little and keeps the numbers.

Example:
    >>> import torch
    >>> stem = torch.nn.Sequential(torch.nn.Conv2d(3, 48, 1, stride=2, bias=False))
    >>> cpu = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX512')
    >>> [(r.path, r.kind, r.reason, r.replacement) for r in make_safe(stem, runtimes=[cpu])]
    [('0', 'safe_path', 'onednn_1x1_strided_weight_grad', 'SubsampledConv2d')]
    >>> make_safe(stem, runtimes=[cpu])     # idempotent
    []
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import ClassVar, Optional

import torch
from torch import nn

from channels_last_algo.core.layers.safe_paths import NCHWAvgPool2d, NCHWMaskDropout, SubsampledConv2d
from channels_last_algo.core.runtime import Runtime, model_device
from channels_last_algo.core.swap import SwapRow, first_matches, overridden, swap_first_match, uncovered
from channels_last_algo.core.swap_records import SwapRecord, UncoveredLayer

__all__ = [
    'FAILURES',
    'KNOWN_BUGS',
    'KernelBug',
    'KernelBugError',
    'crashing_bugs',
    'crashing_subclasses',
    'default_runtimes',
    'make_safe',
    'matching_bugs',
    'refuse_crashing_layers',
    'unsafe_subclasses',
    'why_kept_nchw',
]

log = logging.getLogger(__name__)

FAILURES = ('crash', 'hang', 'wrong numbers', 'NCHW output')
"""What a layout kernel bug does: kills the process, never returns, returns wrong numbers
silently, or drops NHWC."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelBug(SwapRow):
    """One row of the table of known layout kernel bugs: a :class:`~channels_last_algo.core.swap.SwapRow`
    (``name``; ``original``, the layer type whose settings reach the failing kernel; ``replacement``,
    its safe path; ``devices`` and ``torch_versions`` that have the bug) and the bug.

    The safe path is a subclass of ``original`` and of :class:`~channels_last_algo.core.swap.Replacement`
    that overrides forward only. A subclass of ``original`` with its own ``forward`` does not
    match (:func:`unsafe_subclasses`). ``torch_versions`` gives the first affected and the first
    fixed release (None: no known bound).

    Attributes:
        op: the op and kernel that fail.
        condition: the test on the layer's settings (and the runtime, where they interact).
        shape_condition: ``condition`` in words.
        cpu_isa: on the CPU, the instruction sets whose kernels fail (None: any).
        failures: what it does, each one of :data:`FAILURES`.
        passes: where the failing kernel runs: ``'forward'``, ``'backward'`` or both.
        repro: a self-contained Python script: it exits 0 where the kernel behaves, dies from a
            signal where it crashes, and fails an ``assert`` where the numbers are wrong.
        references: the trackers' threads.
        observed: where the probes of this project ran the repro, in one sentence (the
            measurements: ``docs/safety.md``, *What the probes saw here*, under the row's name).
    """

    row_kind: ClassVar[str] = 'kernel bug'
    replacement_role: ClassVar[str] = 'safe path'
    class_name = staticmethod(lambda cls: cls.__name__)

    op: str
    condition: Callable[[nn.Module, Runtime], bool]
    shape_condition: str
    cpu_isa: Optional[tuple[str, ...]]
    failures: tuple[str, ...]
    passes: tuple[str, ...]
    repro: str
    references: tuple[str, ...]
    observed: str

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [f for f in self.failures if f not in FAILURES]
        if not self.failures or unknown:
            raise ValueError(f'kernel bug {self.name!r}: failures {self.failures} must be one or more of {FAILURES}')
        if not self.passes or set(self.passes) - {'forward', 'backward'}:
            raise ValueError(f"kernel bug {self.name!r}: passes {self.passes} must be 'forward', 'backward' or both")

    def affects(self, runtime: Runtime) -> bool:
        """True when ``runtime``'s device, torch version and CPU instruction set have this bug."""
        if not self.holds_on(runtime.device, runtime.torch_version):
            return False
        return runtime.device != 'cpu' or self.cpu_isa is None or runtime.cpu_isa in self.cpu_isa

    def reaches(self, module: nn.Module, runtime: Runtime) -> bool:
        """True when ``module``, an ``original`` or a subclass not on the safe path yet, reaches the
        failing kernel on ``runtime``."""
        return self.unswapped_original(module) and self.affects(runtime) and self.condition(module, runtime)


# The channel block of oneDNN's jit_1x1 kernels for fp32: an AVX-512 register holds 16 floats, AVX2 8.
_ONEDNN_IC_BLOCK = {'AVX512': 16, 'AVX2': 8}


def _few_channel_strided_1x1(conv: nn.Conv2d, runtime: Runtime) -> bool:
    block = _ONEDNN_IC_BLOCK.get(runtime.cpu_isa or '', 0)
    return (
        conv.kernel_size == (1, 1)
        and conv.stride != (1, 1)
        and conv.padding in ('valid', (0, 0))
        and conv.groups == 1
        and conv.in_channels < block
    )


def _padded(pool: nn.AvgPool2d, runtime: Runtime) -> bool:
    padding = pool.padding if isinstance(pool.padding, (tuple, list)) else (pool.padding,)
    return any(p > 0 for p in padding)


def _dropping(dropout: nn.Dropout, runtime: Runtime) -> bool:
    return dropout.p > 0.0


_DROPOUT_MASK_REPRO = """\
import torch
from torch.nn.functional import dropout
differ = []
for device in ['cpu'] + (['cuda'] if torch.cuda.is_available() else []):
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64, device=device)
    torch.manual_seed(0)
    reference = dropout(x, 0.5, training=True)
    torch.manual_seed(0)
    differ += [] if torch.equal(dropout(x.to(memory_format=torch.channels_last), 0.5), reference) else [device]
assert not differ, f'NHWC dropout drops other elements than NCHW for the same seed on {differ}'
"""

_ONEDNN_1X1_REPRO = """\
import torch
torch.manual_seed(0)
conv = torch.nn.Conv2d(3, 48, kernel_size=1, stride=2, bias=False)
x = torch.randn(2, 3, 128, 128)
reference = torch.autograd.grad(conv(x).sum(), conv.weight)[0]
for step in range(3):   # the write past the workspace crashes on the first step or a later one
    nhwc = torch.autograd.grad(conv(x.to(memory_format=torch.channels_last)).sum(), conv.weight)[0]
    assert torch.allclose(nhwc, reference, rtol=1e-4, atol=1e-4), 'NHWC weight gradient differs from NCHW'
"""

_CUDA_AVG_POOL_REPRO = """\
import torch
import torch.nn.functional as F
def input_grad(device, memory_format):
    x = torch.arange(2 * 3 * 7 * 7, dtype=torch.float64).reshape(2, 3, 7, 7).to(device, memory_format=memory_format)
    x.requires_grad_()
    out = F.avg_pool2d(x, kernel_size=3, stride=2, padding=1)
    out.backward(torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device))
    return x.grad.cpu()
reference = input_grad('cpu', torch.contiguous_format)
nhwc = input_grad('cuda', torch.channels_last)
assert torch.allclose(nhwc, reference), 'NHWC avg_pool2d input gradient on CUDA differs from NCHW'
"""

KNOWN_BUGS: tuple[KernelBug, ...] = (
    KernelBug(
        name='onednn_1x1_strided_weight_grad',
        op='aten.convolution_backward weight gradient: oneDNN jit_1x1 backward_weights (jit_1x1:avx512_core, '
        'jit_1x1:avx2), which gathers the strided input into a per-thread workspace and, on NHWC input with fewer '
        'input channels than its channel block, writes past that workspace',
        original=nn.Conv2d,
        condition=_few_channel_strided_1x1,
        shape_condition='kernel 1x1, stride > 1 in either dimension, padding 0, groups 1, in_channels < 16 with the '
        'AVX-512 kernel or < 8 with the AVX2 kernel, input or weight channels last, weight gradient computed (the '
        'input need not require grad)',
        devices=('cpu',),
        torch_versions='',
        cpu_isa=('AVX512', 'AVX2'),
        failures=('crash', 'hang', 'wrong numbers'),
        passes=('backward',),
        repro=_ONEDNN_1X1_REPRO,
        replacement=SubsampledConv2d,
        references=(
            'https://github.com/uxlfoundation/oneDNN/issues/6035 (open: rtus workspace overrun, nhwc, '
            'IC < ic_block; SIGSEGV with AVX-512, hang or wrong weight gradients with AVX2)',
        ),
        observed='probed on an AMD EPYC with AVX-512, torch 2.7.0 and 2.14.1, and with oneDNN and ATen capped at '
        'AVX2: crashes, hangs and wrong weight gradients below the channel block, none with the safe path',
    ),
    KernelBug(
        name='cuda_avg_pool2d_nhwc_backward_padding',
        op='aten.avg_pool2d_backward on CUDA: the NHWC kernel (avg_pool2d_backward_out_cuda_frame_nhwc) maps input '
        'pixels to pooling windows without the padding offset',
        original=nn.AvgPool2d,
        condition=_padded,
        shape_condition='padding > 0, input channels last; the forward and padding 0 are right',
        devices=('cuda',),
        torch_versions='<2.14',
        cpu_isa=None,
        failures=('wrong numbers',),
        passes=('backward',),
        repro=_CUDA_AVG_POOL_REPRO,
        replacement=NCHWAvgPool2d,
        references=(
            'https://github.com/pytorch/pytorch/issues/188344',
            'https://github.com/pytorch/pytorch/pull/188345 (the fix, in torch 2.14)',
        ),
        observed='not probed here (no GPU); from the tracker: wrong input gradients up to torch 2.13, right in 2.14',
    ),
    KernelBug(
        name='dropout_mask_memory_order',
        op="aten.dropout: its noise, empty_like(input), filled by bernoulli_ (CPU; in place everywhere), or CUDA's "
        'fused native_dropout kernel draw in memory order, so an NHWC input gets another mask than NCHW for the '
        'same seed (not a defect of the kernels: the same distribution, other numbers)',
        original=nn.Dropout,
        condition=_dropping,
        shape_condition='p > 0, training, a 4D or 5D input channels last',
        devices=('cpu', 'cuda'),
        torch_versions='',
        cpu_isa=None,
        failures=('wrong numbers',),
        passes=('forward',),
        repro=_DROPOUT_MASK_REPRO,
        replacement=NCHWMaskDropout,
        references=('https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/Dropout.cpp (_dropout_impl)',),
        observed='probed on an AMD EPYC with AVX-512, torch 2.7.0 and 2.14.1, and on an NVIDIA H200, torch 2.11.0: '
        'another mask than NCHW for the same seed, so other outputs and gradients from the first step; the safe '
        'path gives NCHW bit for bit on the CPU (its CUDA path: the tests marked cuda)',
    ),
)


def default_runtimes(model: nn.Module) -> list[Runtime]:
    """The runtimes a model may train on from here: its device, and CUDA too when the model
    is on the CPU and CUDA is available (a model is often converted before it is moved)."""
    device = model_device(model)
    runtimes = [Runtime.current(device)]
    if device.type == 'cpu' and torch.cuda.is_available():
        runtimes.append(Runtime.current('cuda'))
    return runtimes


def matching_bugs(
    model: nn.Module, runtimes: Sequence[Runtime], bugs: Sequence[KernelBug] = KNOWN_BUGS, subclasses: bool = False
) -> list[tuple[str, nn.Module, KernelBug]]:
    """(path, module, bug) for every module of ``model`` that matches a bug on any of ``runtimes``
    (:meth:`KernelBug.matches`; with ``subclasses``, :meth:`KernelBug.reaches`: also the
    subclasses that no safe path can replace), the first such row per module, in
    ``named_modules`` order."""
    return first_matches(
        model, bugs, lambda b, module: any((b.reaches if subclasses else b.matches)(module, r) for r in runtimes)
    )


def make_safe(
    model: nn.Module, runtimes: Optional[Sequence[Runtime]] = None, bugs: Sequence[KernelBug] = KNOWN_BUGS
) -> list[SwapRecord]:
    """Swap, in place, every layer of ``model`` that a known bug's condition matches for its safe path.

    Args:
        model: the model; its matching modules change class, nothing else changes.
        runtimes: where it will train; by default :func:`default_runtimes`.
        bugs: the table, :data:`KNOWN_BUGS` unless given.

    Returns:
        One :class:`~channels_last_algo.core.swap_records.SwapRecord` (kind ``'safe_path'``, the bug's name
        as its reason, the safe path's class name as its replacement) per swapped module; empty
        when nothing matched (a safe model matches nothing again).
    """
    runtimes = default_runtimes(model) if runtimes is None else runtimes
    records = swap_first_match(model, bugs, 'safe_path', lambda b, module: any(b.matches(module, r) for r in runtimes))
    for record in records:
        log.info(
            '%s: layer %s (%s) matches the known layout kernel bug %s on %s; it runs on the safe path %s',
            type(model).__name__,
            record.path or '(root)',
            record.original,
            record.reason,
            ' / '.join(map(str, runtimes)),
            record.replacement,
        )
    return records


def unsafe_subclasses(
    model: nn.Module, runtimes: Optional[Sequence[Runtime]] = None, bugs: Sequence[KernelBug] = KNOWN_BUGS
) -> list[UncoveredLayer]:
    """The modules of ``model`` that reach a known bug's failing kernel on any of ``runtimes``
    (by default :func:`default_runtimes`) but whose class overrides what the safe path takes
    over (its own ``forward``), so :func:`make_safe` cannot replace it.

    Example:
        >>> class OwnForward(nn.Conv2d):
        ...     def forward(self, x):
        ...         return super().forward(x)
        >>> cpu = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX512')
        >>> [(u.path, u.reason, u.overrides) for u in unsafe_subclasses(nn.Sequential(OwnForward(3, 48, 1, 2)), [cpu])]
        [('0', 'onednn_1x1_strided_weight_grad', ('forward',))]
    """
    runtimes = default_runtimes(model) if runtimes is None else runtimes
    return uncovered(model, bugs, 'safe_path', lambda b, module: any(b.reaches(module, r) for r in runtimes))


def crashing_bugs(backward: bool = True) -> list[KernelBug]:
    """The rows of :data:`KNOWN_BUGS` that crash or hang in a forward pass (and, with ``backward``, its backward)."""
    passes = {'forward', 'backward'} if backward else {'forward'}
    return [bug for bug in KNOWN_BUGS if {'crash', 'hang'} & set(bug.failures) and passes & set(bug.passes)]


def crashing_subclasses(model: nn.Module, runtimes: Optional[Sequence[Runtime]] = None) -> list[UncoveredLayer]:
    """The :func:`unsafe_subclasses` of ``model`` whose bug crashes or hangs (:func:`crashing_bugs`): channels last
    would kill the run, and no safe path replaces them."""
    return unsafe_subclasses(model, runtimes, crashing_bugs())


class KernelBugError(ValueError):
    """A model was to run channels last with a layer that reaches a known layout kernel bug which kills
    the process or never returns (:func:`refuse_crashing_layers`)."""


def refuse_crashing_layers(
    model: nn.Module, caller: str, backward: bool = True, runtimes: Optional[Sequence[Runtime]] = None
) -> None:
    """Raise :class:`KernelBugError` naming the first layer of ``model`` that, channels last, reaches a known
    layout kernel bug that crashes or hangs on any of ``runtimes`` (by default :func:`default_runtimes`) in a
    forward pass (and, with ``backward``, its backward), and what avoids it; return where none does. ``caller``
    names the function refusing.

    Example:
        >>> cpu = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX2')
        >>> stem = nn.Sequential(nn.Conv2d(3, 48, 1, stride=2)).to(memory_format=torch.channels_last)
        >>> try:
        ...     refuse_crashing_layers(stem, 'audit_model', runtimes=[cpu])
        ... except KernelBugError as error:
        ...     print(str(error)[:57])
        audit_model: layer '0' (Conv2d) of Sequential reaches the
        >>> refuse_crashing_layers(stem, 'audit_model', backward=False, runtimes=[cpu])   # a backward bug
        >>> make_safe(stem, [cpu]) and refuse_crashing_layers(stem, 'audit_model', runtimes=[cpu])
    """
    runtimes = default_runtimes(model) if runtimes is None else runtimes
    found = matching_bugs(model, runtimes, crashing_bugs(backward), subclasses=True)
    if not found:
        return
    raise KernelBugError(_refusal(model, caller, found, runtimes))


def _refusal(model: nn.Module, caller: str, found: list, runtimes: Sequence[Runtime]) -> str:
    """What :func:`refuse_crashing_layers` says of the first of ``found``: (path, module, bug)."""
    path, module, bug = found[0]
    where = ' / '.join(str(r) for r in runtimes if bug.reaches(module, r))
    avoid = (
        f'Convert the model with apply_channels_last(model), which routes it through its safe path '
        f'({bug.replacement.__name__}), or keep the model NCHW'
        if any(bug.matches(module, r) for r in runtimes)
        else f'Its class overrides {", ".join(overridden(module, bug))}, so no safe path replaces it; keep the '
        'model NCHW'
    )
    more = '' if len(found) == 1 else f' (and {len(found) - 1} more)'
    failures = ' or '.join(filter(None, (', '.join(bug.failures[:-1]), bug.failures[-1])))
    return (
        f'{caller}: layer {path or "(root)"!r} ({type(module).__name__}) of {type(model).__name__} reaches the '
        f'known layout kernel bug {bug.name} on {where}{more}: channels last, it can end in {failures} '
        f'({bug.shape_condition}). {avoid}.'
    )


def why_kept_nchw(layers: list[UncoveredLayer]) -> str:
    """Why a model keeps NCHW, in one sentence: ``layers`` reach a crashing bug (:func:`crashing_bugs`) and no
    safe path replaces them (:func:`unsafe_subclasses`)."""
    first = layers[0]
    more = f' (and {len(layers) - 1} more)' if len(layers) > 1 else ''
    return (
        f'layer {first.path or "(root)"} ({first.layer.rpartition(".")[2]}.{"/".join(first.overrides)})'
        f'{more} reaches the known layout kernel bug {first.reason}, which crashes or hangs channels last here, and '
        "overrides what its safe path replaces; feed NCHW batches, or keep the base class's forward to train "
        'channels last'
    )
