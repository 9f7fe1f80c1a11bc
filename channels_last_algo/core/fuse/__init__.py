"""Fused NHWC inference: fold BatchNorm into convolutions, fuse activations and residual adds.

:func:`fuse_for_inference` returns an eval-only copy of a conv net (the model given is never
modified) in which every run of ops that :data:`~.patterns.FUSION_PATTERNS` lists becomes
one :class:`FusedConv2d`: ``Conv2d -> BatchNorm2d`` is folded (in float64, weights channels
last), and a convolution absorbs the activation after it (ReLU, ReLU6/Hardtanh, SiLU,
Hardswish, Sigmoid, Hardsigmoid, Tanh, GELU, LeakyReLU), or the residual add after it and a
ReLU after that add (a ``Conv3d`` folds its ``BatchNorm3d`` and stays a plain channels-last-3D
convolution). On CPU each runs as one prepacked oneDNN convolution with post-ops, on
CUDA conv (+ add) + ReLU as cuDNN's fused convolution; everything else stays as it was,
restrided to channels last. Where a fused kernel does not apply or refuses a shape, that
convolution computes the same math with the plain ops, so the copy runs at every input size
the model accepts. ``backend='inductor'`` compiles the fused copy with ``torch.compile``
and inductor's freezing instead. :func:`export_for_inference` saves it with ``torch.export``.

Modules: :mod:`.postops` (activations), :mod:`.conv` (the fused convolution), :mod:`.plain_convs`
(other forms of convolution as plain ones), :mod:`.patterns` (the table), :mod:`.tracing` (symbolic
tracing that calls failing functions whole), :mod:`.graph` (the fx route), :mod:`.node_uses` (the
users of a traced value), :mod:`.concatenations` (BatchNorms folded through channel concatenations),
:mod:`.functional_calls` (functional convolutions and BatchNorms as module calls), :mod:`.modules`
(the module route), :mod:`.subgraphs` (the fx route inside it, for the submodules that trace),
:mod:`.summary`, :mod:`.example_check` (the copy checked on the example input), :mod:`.inference`
(the public function), :mod:`.export`, :mod:`.evaluation` (the swap behind the integrations'
``fuse_eval``).
Measurements and background: ``docs/fuse.md``.

Contract: the model must be in eval mode (a submodule in train mode is refused with
``ValueError``: BatchNorm would use batch statistics and cannot be folded), and not TorchScript (refused with
``ValueError``: there is no Python code to trace; pass the ``nn.Module`` it was made from). The copy holds no
parameter that requires grad; calling it in train mode, or with an input that requires grad
while grad mode is on, raises ``RuntimeError``. Under CPU autocast (bfloat16) the fused
convolutions run in the autocast dtype like ``conv2d`` would.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> fused = fuse_for_inference(net)
    >>> fused.summary.fused
    {'0': 'conv+bn+relu'}
    >>> x = torch.randn(2, 3, 16, 16)
    >>> torch.testing.assert_close(fused(x), net(x), rtol=1e-4, atol=1e-5)
"""

from channels_last_algo.core.fuse.conv import FusedConv2d
from channels_last_algo.core.fuse.evaluation import FusedEvaluation
from channels_last_algo.core.fuse.export import export_for_inference
from channels_last_algo.core.fuse.inference import BACKENDS, InferenceModel, fuse_for_inference
from channels_last_algo.core.fuse.patterns import FUSION_PATTERNS
from channels_last_algo.core.fuse.postops import PostOp
from channels_last_algo.core.fuse.summary import FusionSummary

__all__ = [
    'BACKENDS',
    'FUSION_PATTERNS',
    'FusedConv2d',
    'FusedEvaluation',
    'FusionSummary',
    'InferenceModel',
    'PostOp',
    'export_for_inference',
    'fuse_for_inference',
]
