"""Inductor build errors explained: ``torch.compile`` and channels last (convert first, compile
after), and a clear error where inductor cannot build its C++ kernels.

Convert the model before it runs compiled (``apply_channels_last``, ``LayoutGuard.on_init``, or
an integration, which all restride before the first compiled call) and feed NHWC batches:
dynamo then takes the NHWC weights and inputs as graph inputs with their strides, and the
ATen graph it gives the backend computes NHWC, forward and backward (a convolution takes the
layout of its input). Restriding after a compiled call costs one recompilation (dynamo guards
on strides), nothing else.

On the CPU inductor builds C++ kernels, and that build can fail: torch 2.7 cannot compile
ResNet-50 training there (its C++ code generation declares ``tmp_acc0_arr`` twice; NCHW fails
the same way, so channels last is not the cause), and a machine without a working C++ compiler
fails on any graph. The error surfaces deep inside inductor at the first compiled forward, or
at the first backward (inductor compiles the backward graph lazily). Around training,
:func:`explain_compile_failures` turns such an error into an :class:`InductorBuildError` that
names the torch version and the ways around it; every other exception passes through as it is.

Example:
    >>> from torch._inductor.exc import CppCompileError
    >>> with explain_compile_failures():  # doctest: +IGNORE_EXCEPTION_DETAIL
    ...     raise CppCompileError(['g++', 'kernel.cpp'], "error: conflicting declaration 'tmp_acc0_arr'")
    Traceback (most recent call last):
    ...
    InductorBuildError: torch.compile: inductor could not build its C++ kernels ...
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Optional

import torch

from channels_last_algo.core.runtime import parse_version

__all__ = ['InductorBuildError', 'explain_compile_failures', 'inductor_build_failure']

# The torch releases whose CPU inductor fails on ResNet-50 training (C++ codegen), and the first that compiles it.
_CODEGEN_BUG_BEFORE = (2, 8)


def inductor_build_failure(error: BaseException) -> Optional[BaseException]:
    """The inductor C++ build failure (``CppCompileError``, ``InvalidCxxCompiler``) that caused
    ``error``, searched through its chain of causes; None when there is none.

    Example:
        >>> inductor_build_failure(ValueError('not a compile error')) is None
        True
    """
    if 'torch._inductor.exc' not in sys.modules:  # inductor never ran: it raised nothing
        return None
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    seen: set[int] = set()
    pending: list[Optional[BaseException]] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (CppCompileError, InvalidCxxCompiler)):
            return current
        # dynamo and inductor wrap the original in .inner_exception as well as chaining it
        pending += [current.__cause__, current.__context__, getattr(current, 'inner_exception', None)]
    return None


class InductorBuildError(RuntimeError):
    """Inductor could not build the compiled graph's C++ kernels; the message names the torch
    version, the known cause where there is one, and the ways around it."""

    def __init__(self, failure: BaseException) -> None:
        lines = [line.strip() for line in str(failure).splitlines() if line.strip()] or ['no message']
        detail = next((line for line in lines if 'error:' in line), lines[0])  # the compiler's first error
        known = ''
        if parse_version(torch.__version__) < _CODEGEN_BUG_BEFORE:
            known = (
                f' torch {torch.__version__} is known to fail this way on CPU training graphs such as '
                "ResNet-50's (inductor's C++ code generation declares tmp_acc0_arr twice), in NCHW as "
                'well: channels last is not the cause.'
            )
        super().__init__(
            f'torch.compile: inductor could not build its C++ kernels with torch {torch.__version__} '
            f'({type(failure).__name__}: {detail}).{known} Ways around it: torch >= '
            f"{'.'.join(map(str, _CODEGEN_BUG_BEFORE))}; torch.compile(..., backend='aot_eager') (graph capture "
            'without C++ code generation: layouts as compiled, no kernel fusion); a working C++ compiler '
            '(torch._inductor.config.cpp.cxx) where none was found; or training without torch.compile '
            '(channels last applies either way).'
        )
        self.failure = failure


@contextlib.contextmanager
def explain_compile_failures() -> Iterator[None]:
    """Raise an :class:`InductorBuildError` (from the original) for an inductor C++ build
    failure inside the block, at forward or backward; anything else passes through untouched.

    Wrap what runs the compiled model: a training loop's steps, or ``trainer.fit()``.
    """
    try:
        yield
    except Exception as error:
        failure = inductor_build_failure(error)
        if failure is None:
            raise
        raise InductorBuildError(failure) from error
