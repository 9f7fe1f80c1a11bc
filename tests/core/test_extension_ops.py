"""Extension ops (``torch.library`` operators from outside PyTorch and torchvision) run as in NCHW.

Their kernels may read memory in order or ``.view(-1)`` their inputs, which NCHW hands them contiguous.
Under the guard they get contiguous copies and contiguous gradients, what they write in place reaches
the caller's tensor, and the console says so once. Training through every integration, equal to NCHW,
is in ``test_contracts.py``.
"""

from __future__ import annotations

import copy
import logging

import torch
from extension_kernels import ramp_in_place, ramp_over_memory, registered_ramp
from torch import nn

from channels_last_algo.core.extension_ops import extension_op, run_on_contiguous
from channels_last_algo.core.guard import LayoutGuard


class RampNet(nn.Module):
    """A convolution, the registered raw-memory op, a convolution and a pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mid = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x):
        return self.head(self.mid(registered_ramp(self.stem(x))))


def _images(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_ops_of_torch_and_torchvision_are_not_extensions():
    import torchvision  # noqa: F401  (registers torchvision's ops)

    assert extension_op(torch.ops.aten.add.Tensor) is None
    assert extension_op(torch.ops.torchvision.roi_align.default) is None
    assert extension_op(torch.ops.channels_last_tests.ramp).name() == 'channels_last_tests::ramp'


def test_an_in_place_extension_op_writes_the_callers_nhwc_tensor_as_in_nchw():
    x = _images(0)
    expected = x.clone()
    ramp_in_place(expected)
    nhwc = x.contiguous(memory_format=torch.channels_last)
    assert not torch.equal(ramp_over_memory(nhwc), ramp_over_memory(x))  # the kernel sees the layout
    op = extension_op(torch.ops.channels_last_tests.ramp_in_place.default)
    assert run_on_contiguous(op, (nhwc,), {}, [nhwc]) is None
    assert torch.equal(nhwc, expected) and nhwc.is_contiguous(memory_format=torch.channels_last)


def test_the_console_names_the_extension_op_once_and_every_step_and_evaluation_run_as_in_nchw(caplog):
    torch.manual_seed(0)
    net = RampNet().double()
    nchw = copy.deepcopy(net)
    guard = LayoutGuard()
    guard.on_init(net)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (net, nchw)]
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        for step in range(3):
            x = _images(step)
            with guard.step():
                net(guard.on_batch(x)).sum().backward()
            nchw(x).sum().backward()
            for optimizer in optimizers:
                optimizer.step(), optimizer.zero_grad()
            for (name, got), expected in zip(net.named_parameters(), nchw.parameters()):
                torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=f'step {step}: {name}')
    lines = [r.getMessage() for r in caplog.records if 'extension op' in r.getMessage()]
    assert len(lines) == 1 and 'channels_last_tests::ramp at ' in lines[0] and 'test_extension_ops.py:' in lines[0]
    net.eval(), nchw.eval()
    with torch.no_grad():
        got = net(guard.on_batch(_images(9)))
        guard.on_forward_end()
        torch.testing.assert_close(got, nchw(_images(9)), rtol=1e-10, atol=1e-10)


def test_an_extension_op_inside_a_compiled_model_is_said_to_get_nhwc_memory(caplog):
    """No watch reaches into a torch.compile graph: the console says what the op gets there, and what to do."""
    net = RampNet().double()
    guard = LayoutGuard()
    guard.on_init(net)
    compiled = torch.compile(net, backend='eager')
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        with guard.step():
            compiled(guard.on_batch(_images(0))).sum().backward()
    lines = [r.getMessage() for r in caplog.records if 'extension op' in r.getMessage()]
    assert len(lines) == 1 and 'inside a torch.compile graph' in lines[0] and "mode='off'" in lines[0]


def test_the_fused_inference_copy_gives_an_extension_op_contiguous_tensors_on_every_call():
    """The copy's watch of extension ops stays on, as a training run's does; it says so once."""
    import warnings

    from channels_last_algo import fuse_for_inference

    torch.manual_seed(0)
    model = RampNet().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fused = fuse_for_inference(model, _images(0).float())
        with torch.no_grad():
            for seed in (1, 2):
                torch.testing.assert_close(fused(_images(seed).float()), model(_images(seed).float()))
    said = [str(w.message) for w in caught if 'channels_last_tests::ramp' in str(w.message)]
    assert len(said) == 1 and 'each call of the copy is watched' in said[0]
