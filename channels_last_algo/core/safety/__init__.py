"""Kernel safety: channels last never crashes a run or changes its numbers where NCHW does not.

This package holds the table of known layout kernel bugs and its diagnostics; the safe paths
are swapped layers (:mod:`channels_last_algo.core.layers.safe_paths`), and the torch version,
device and CPU instruction set a bug depends on are a
:class:`~channels_last_algo.core.runtime.Runtime`.

- :mod:`.bugs`: the table of known layout kernel bugs and :func:`make_safe`, which routes the
  layers they affect through a safe path; part of ``apply_channels_last``.
- :mod:`.probe`: run a repro or a model step in a child process, so a crash is a result.
- :mod:`.layer_check`: every layer's float32 channels-last kernels against float64.
- :mod:`.diagnostics`: check one model on this torch and hardware (``channels-last doctor``).

Example:
    >>> from channels_last_algo.core.safety import KNOWN_BUGS
    >>> sorted(bug.name for bug in KNOWN_BUGS)
    ['cuda_avg_pool2d_nhwc_backward_padding', 'dropout_mask_memory_order', 'onednn_1x1_strided_weight_grad']
"""

from channels_last_algo.core.safety.bugs import (
    FAILURES,
    KNOWN_BUGS,
    KernelBug,
    KernelBugError,
    make_safe,
    matching_bugs,
    refuse_crashing_layers,
    unsafe_subclasses,
)
from channels_last_algo.core.safety.probe import ProbeResult, WrongNumbers, run_code, run_isolated

__all__ = [
    'FAILURES',
    'KNOWN_BUGS',
    'KernelBug',
    'KernelBugError',
    'ProbeResult',
    'WrongNumbers',
    'make_safe',
    'matching_bugs',
    'refuse_crashing_layers',
    'run_code',
    'run_isolated',
    'unsafe_subclasses',
]
