"""torch.compile with channels last: the compiled graphs stay NHWC in a plain loop, in Lightning
and in Composer, and inductor's C++ build failures come out as one clear error.

The trainer layout tests compile with a recording backend: AOTAutograd's forward and backward
ATen graphs (what inductor receives), run as they are (as ``backend='aot_eager'`` does), so they
check layouts without inductor's C++ build. Two small nets compile with inductor for real (slow):
the buffers of its generated code are NHWC, in the guard's training steps also around depthwise
convolutions (core/compiled_backward.py). The build failure test runs inductor on a tiny
function, in a subprocess, with a C++ compiler that always fails.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch
from torch import nn

from channels_last_algo import LayoutGuard, apply_channels_last, has_channels_last_strides, is_channels_last
from channels_last_algo.core.compiled_backward import backward_layout_left_off, channels_first_buffers
from channels_last_algo.core.inductor_errors import InductorBuildError, explain_compile_failures, inductor_build_failure
from channels_last_algo.core.runtime import parse_version
from conftest import lightning_trainer, random_images, tiny_loader


def conv_net() -> nn.Module:
    """Two 3x3 convolutions (unambiguous layouts), BatchNorm, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


class GraphRecorder:
    """A torch.compile backend: AOTAutograd's graphs, kept and run unchanged."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: dict[str, list[torch.fx.GraphModule]] = {'forward': [], 'backward': []}

        def keep(phase: str):
            def compiler(graph: torch.fx.GraphModule, example_inputs):
                self.graphs[phase].append(graph)
                return make_boxed_func(graph.forward)

            return compiler

        self.backend = aot_autograd(fw_compiler=keep('forward'), bw_compiler=keep('backward'))

    def conv_layouts(self) -> dict[str, list[bool]]:
        """For every convolution in the graphs: is each of its 4D tensors (forward: input,
        weight, output; backward: output gradient, and the input and weight gradients it computes) NHWC?"""
        seen: dict[str, list[bool]] = {'forward': [], 'backward': []}
        for phase, graphs in self.graphs.items():
            for graph in graphs:
                for node in graph.graph.nodes:
                    if node.target is torch.ops.aten.convolution.default:
                        tensors = [node.args[0].meta['val'], node.args[1].meta['val'], node.meta['val']]
                    elif node.target is torch.ops.aten.convolution_backward.default:
                        tensors = [node.args[0].meta['val'], *node.meta['val'][:2]]
                    else:
                        continue
                    seen[phase] += [is_channels_last(t) for t in tensors if t is not None]
        return seen


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_plain(net: nn.Module, guard: LayoutGuard, steps: int = 2) -> GraphRecorder:
    recorder = GraphRecorder()
    compiled = torch.compile(net, backend=recorder.backend)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    images, labels = random_images(n=4, size=8)
    for _ in range(steps):
        batch_images, batch_labels = guard.on_batch((images, labels))
        nn.functional.cross_entropy(compiled(batch_images), batch_labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    return recorder


def test_plain_loop_compiled_graphs_are_nhwc_forward_and_backward():
    torch.manual_seed(0)
    net = conv_net()
    guard = LayoutGuard()
    guard.on_init(net)  # convert first, compile after
    layouts = _train_plain(net, guard).conv_layouts()
    assert len(layouts['forward']) == 2 * 3 and len(layouts['backward']) == 2 + 3  # the first conv has no input grad
    assert all(layouts['forward']) and all(layouts['backward']), layouts
    assert all(has_channels_last_strides(p) for p in net.parameters() if p.dim() == 4)

    control = _train_plain(conv_net(), LayoutGuard(mode='off')).conv_layouts()  # the check sees NCHW as NCHW
    assert len(control['forward']) == 2 * 3 and not any(control['forward'] + control['backward'])


def test_compiled_channels_last_matches_eager_nchw_in_float64(double_precision):
    torch.manual_seed(0)
    reference = conv_net()
    net = conv_net()
    net.load_state_dict(reference.state_dict())
    apply_channels_last(net)
    compiled = torch.compile(net, backend=GraphRecorder().backend)
    images, labels = random_images(n=4, size=8)
    images = images.double()
    output = compiled(images.to(memory_format=torch.channels_last))
    nn.functional.cross_entropy(output, labels).backward()
    expected = reference(images)
    nn.functional.cross_entropy(expected, labels).backward()
    torch.testing.assert_close(output, expected)
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_lightning_compiled_in_configure_model_stays_nhwc():
    L = pytest.importorskip('lightning')
    from channels_last_algo import ChannelsLastCallback

    recorder = GraphRecorder()

    class Compiled(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = conv_net()

        def configure_model(self):
            self.net = torch.compile(self.net, backend=recorder.backend)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Compiled()
    trainer = lightning_trainer(
        max_steps=2,
        callbacks=[ChannelsLastCallback()],
    )
    trainer.fit(module, tiny_loader(n=8, batch_size=4))
    layouts = recorder.conv_layouts()
    assert layouts['forward'] and layouts['backward']
    assert all(layouts['forward']) and all(layouts['backward']), layouts
    assert all(has_channels_last_strides(p) for p in module.parameters() if p.dim() == 4)


@pytest.mark.parametrize('place', ['algorithms', 'callbacks'])
def test_composer_compile_config_stays_nhwc(place):
    pytest.importorskip('composer')
    from composer import Trainer
    from composer.models import ComposerClassifier

    from channels_last_algo import ChannelsLast

    recorder = GraphRecorder()
    net = conv_net()
    trainer = Trainer(
        model=ComposerClassifier(net, num_classes=10),
        train_dataloader=tiny_loader(n=8, batch_size=4),
        max_duration='2ba',
        device='cpu',
        **{place: [ChannelsLast()]},
        progress_bar=False,
        compile_config={'backend': recorder.backend},
    )
    trainer.fit()
    layouts = recorder.conv_layouts()
    assert layouts['forward'] and layouts['backward']
    assert all(layouts['forward']) and all(layouts['backward']), layouts
    assert all(has_channels_last_strides(p) for p in net.parameters() if p.dim() == 4)


# --- inductor's own kernels: the buffers it lays out --------------------------------------------------


def depthwise_net() -> nn.Module:
    """A MobileNet-like block: convolution, a depthwise one, a pointwise one, BatchNorm, Hardswish."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        nn.Conv2d(16, 32, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _compiled_step_code(net: nn.Module, images: torch.Tensor, guard: Optional[LayoutGuard] = None) -> list[str]:
    """Inductor's code for ``net``'s first compiled training step (forward, backward) on NHWC
    ``images``, inside ``guard.step()`` where a guard is given."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(net)

    def step():
        with guard.step() if guard is not None else contextlib.nullcontext():
            compiled(images.to(memory_format=torch.channels_last)).sum().backward()

    _, codes = run_and_get_code(step)
    assert len(codes) == 2, 'one forward and one backward graph'
    return codes


@pytest.mark.slow
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', id='cuda', marks=pytest.mark.cuda)])
def test_inductor_lays_a_converted_models_compiled_step_out_nhwc(device):
    """A converted model's traced graphs hold NHWC strides, which the compiled convolutions keep,
    forward and backward, with no setting of inductor's changed."""
    torch.manual_seed(0)
    net = conv_net().to(device)
    apply_channels_last(net)
    codes = _compiled_step_code(net, torch.randn(4, 3, 16, 16, device=device))
    assert all('empty_strided' in code for code in codes)
    assert [channels_first_buffers(code) for code in codes] == [[], []]
    assert all(has_channels_last_strides(p.grad) for p in net.parameters() if p.dim() == 4)


@pytest.mark.slow
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', id='cuda', marks=pytest.mark.cuda)])
def test_the_guards_training_step_keeps_compiled_backward_nhwc_around_depthwise_convolutions(device):
    """Where inductor leaves backward graphs without layout optimisation (pytorch#189239), it lays
    gradients around a depthwise convolution out with their channels not innermost; inside the
    guard's training step it forces the optimisation on, and the compiled step matches eager NCHW."""
    torch.manual_seed(0)
    dtype = torch.float64 if device == 'cpu' else torch.float32  # cuDNN has no NHWC float64 kernels: NCHW out
    reference = depthwise_net().to(device, dtype)
    images = torch.randn(4, 3, 16, 16, device=device, dtype=dtype)
    net = copy.deepcopy(reference)
    guard = LayoutGuard()
    guard.on_init(net)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        codes = _compiled_step_code(net, images, guard)
        assert [channels_first_buffers(code) for code in codes] == [[], []]
        assert not torch._inductor.config.force_layout_optimization  # as it was, after the step
        reference(images).sum().backward()
    tolerance = {} if dtype == torch.float64 else {'rtol': 1e-4, 'atol': 1e-5}  # NHWC and NCHW cuDNN kernels
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, **tolerance)
    if backward_layout_left_off():
        assert any(line.startswith('  compile ') for line in guard.start_block.lines)
        torch._dynamo.reset()
        plain = copy.deepcopy(reference)
        apply_channels_last(plain)
        assert channels_first_buffers(_compiled_step_code(plain, images)[1]), 'the net shows the regression'


# --- inductor's C++ build failures ------------------------------------------------------------------

FAILING_COMPILER = """#!/bin/sh
case "$1" in --version|-v|-dumpversion) exec g++ "$@";; esac
echo "kernel.cpp:12:5: error: conflicting declaration 'float tmp_acc0_arr [16]'" >&2
exit 1
"""

BUILD_WITH = """
import torch, torch._inductor.config
from channels_last_algo.core.inductor_errors import InductorBuildError, explain_compile_failures
torch._inductor.config.cpp.cxx = ({compiler!r},)
step = torch.compile(lambda x: (x * 2).relu().sum())
try:
    with explain_compile_failures():
        step(torch.randn(4, 4))
except InductorBuildError as error:
    print(type(error.failure).__name__)
    print(error)
"""


def test_an_inductor_build_failure_is_one_clear_error(tmp_path):
    if shutil.which('g++') is None:
        pytest.skip('no g++ here for the failing compiler to answer --version with')
    compiler = tmp_path / 'g++'
    compiler.write_text(FAILING_COMPILER)
    compiler.chmod(0o755)
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path / 'cache'), 'TORCHINDUCTOR_COMPILE_THREADS': '1'}
    result = subprocess.run(
        [sys.executable, '-c', textwrap.dedent(BUILD_WITH.format(compiler=str(compiler)))],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failure, message = result.stdout.split('\n', 1)
    assert failure == 'CppCompileError'
    assert f'with torch {torch.__version__}' in message
    assert "error: conflicting declaration 'float tmp_acc0_arr [16]'" in message
    assert "backend='aot_eager'" in message and 'torch >= 2.8' in message
    known_bug = parse_version(torch.__version__) < (2, 8, 0)
    assert ('channels last is not the cause' in message) == known_bug


def test_other_errors_pass_through_untouched():
    error = ValueError('shapes do not match')
    with pytest.raises(ValueError) as raised:
        with explain_compile_failures():
            raise error
    assert raised.value is error and inductor_build_failure(error) is None


def test_the_failure_is_found_through_wrappers():
    from torch._inductor.exc import CppCompileError, InductorError

    failure = CppCompileError(['g++', 'kernel.cpp'], "kernel.cpp:1:1: error: conflicting declaration 'tmp_acc0_arr'")
    try:
        try:
            raise failure
        except CppCompileError as inner:
            raise InductorError(inner, None) from inner
    except InductorError as wrapped:
        assert inductor_build_failure(wrapped) is failure
        assert "error: conflicting declaration 'tmp_acc0_arr'" in str(InductorBuildError(failure))
