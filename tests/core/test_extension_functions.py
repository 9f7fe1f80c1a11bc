"""A C++ extension bound with pybind11 whose kernels read raw memory in order, as kernels written for NCHW do,
runs under the package as in NCHW (``core/extension_functions.py``).

The extension is built once with ``torch.utils.cpp_extension.load_inline`` (skipped where no C++ compiler
and ninja are found) and kept, as research code keeps one, in a module-level name the model's code reads
at each call; a second one is built and loaded on the model's first forward, after the conversion, as
StyleGAN's ``custom_ops`` builds its kernels (compiled beside the first, so that build finds it up to
date). ``ramp`` scales each element by its position in memory; ``ramp_`` does it in place, through
``data_ptr``. A model that calls ``ramp`` in its forward (and on its gradient in the backward, through an
``autograd.Function``) trains 3 float64 steps through LayoutGuard, the Composer algorithm and the
Lightning callback, equal to NCHW on every step.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.extension_functions import contiguous_call

SOURCE = r"""
torch::Tensor ramp(torch::Tensor x) {
  auto out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = x.numel();
  const double* in = x.data_ptr<double>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) o[i] = in[i] * (1.0 + double(i) / double(n));
  return out;
}

void ramp_(torch::Tensor x) {
  const int64_t n = x.numel();
  double* p = x.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] *= 1.0 + double(i) / double(n);
}
"""

ext = None  # the built extension, read by the model's code at each call, as a module-level `_C` is
ramp = None  # its kernel under a name of this file's own, as `from ext import ramp` binds it
build = None  # builds and loads the extension under a name, as a plugin loader does
plugin = None  # the extension as the model's first forward loads it (built then, the first time)
PLUGIN = 'channels_last_tests_plugin'  # its name


def _build_arguments(name: str, directory: Path) -> dict:
    """``load_inline``'s arguments for the extension under ``name``, built in a folder of its own."""
    folder = directory / name
    folder.mkdir(exist_ok=True)
    return dict(
        name=name, cpp_sources=[SOURCE], functions=['ramp', 'ramp_'], build_directory=str(folder), extra_cflags=['-O0']
    )


@pytest.fixture(scope='module', autouse=True)
def extension(tmp_path_factory):
    if shutil.which('c++') is None or shutil.which('ninja') is None:
        pytest.skip('needs a C++ compiler and ninja to build the extension')
    from torch.utils.cpp_extension import load_inline

    global ext, ramp, build
    directory = tmp_path_factory.mktemp('extension')
    # The plugin compiles in a process of its own beside this build; loading it later finds its build up to date.
    plugin_build = (
        f'from torch.utils.cpp_extension import load_inline; load_inline(**{_build_arguments(PLUGIN, directory)!r})'
    )
    compiling = subprocess.Popen(
        [sys.executable, '-c', plugin_build], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def build(name: str = 'channels_last_tests_raw_memory'):
        return load_inline(**_build_arguments(name, directory))

    try:
        ext = build()
    except (OSError, RuntimeError) as error:  # a toolchain without Python's headers or torch's: nothing to test
        pytest.skip(f'the extension does not build here: {str(error)[:200]}')
    finally:
        compiling.wait(timeout=600)
    ramp = ext.ramp
    yield ext
    ext = ramp = build = None


class Ramp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return ext.ramp(x)

    @staticmethod
    def backward(ctx, grad):
        return ext.ramp(grad)


class BoundRamp(torch.autograd.Function):
    """``Ramp`` through the name this file bound the kernel to."""

    @staticmethod
    def forward(ctx, x):
        return ramp(x)

    @staticmethod
    def backward(ctx, grad):
        return ramp(grad)


class LazyRamp(torch.autograd.Function):
    """``Ramp`` through an extension built and loaded on the first call, after the model was converted (the first time
    in the process)."""

    @staticmethod
    def forward(ctx, x):
        global plugin
        plugin = plugin or build(PLUGIN)
        return plugin.ramp(x)

    @staticmethod
    def backward(ctx, grad):
        return plugin.ramp(grad)


class RampNet(nn.Module):
    def __init__(self, function: type = Ramp) -> None:
        super().__init__()
        self.function = function
        self.c0, self.c1 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 5))

    def forward(self, x):
        return self.head(self.c1(self.function.apply(F.relu(self.c0(x)))))


def _run(function: type = Ramp) -> Run:
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(2, 3, 8, 8, generator=generator, dtype=torch.float64), torch.randint(0, 5, (2,))) for _ in range(3)
    ]
    return Run(
        build=lambda: RampNet(function), batches=batches, loss=lambda output, batch: F.cross_entropy(output, batch[1])
    )


def test_the_kernel_alone_reads_nhwc_memory_in_its_own_order():
    """The kernel itself (unwrapped, where a converted model alive in this process had it covered as it loaded)
    gives other numbers for an NHWC tensor: what the tests below guard against."""
    kernel = getattr(ext.ramp, '__wrapped__', ext.ramp)
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    assert not torch.allclose(kernel(x.to(memory_format=torch.channels_last)), kernel(x))


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('function', [Ramp, BoundRamp, LazyRamp], ids=['ext.ramp', 'bound ramp', 'loaded later'])
def test_a_model_calling_a_raw_memory_kernel_trains_as_in_nchw(integration, function):
    global plugin
    run, plugin = _run(function), None  # the guarded run loads it, on its first forward
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), integration)
    assert net.c0.weight.is_contiguous(memory_format=torch.channels_last) and not net.c0.weight.is_contiguous()


def test_a_write_through_the_kernel_reaches_the_tensor_passed_and_the_function_is_named_once(caplog):
    net = RampNet().double()
    apply_channels_last(net)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    with torch.no_grad():
        z = net.c0(x)
        expected, version = ext.ramp(ext.ramp(z.contiguous())), z._version  # NCHW's memory order
        with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.extension_functions'):
            ext.ramp_(z)
            ext.ramp_(z)
    assert z.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(z, expected, rtol=1e-15, atol=0)
    assert z._version == version  # written as the kernel writes: autograd's counter unmoved
    named = [r.getMessage() for r in caplog.records if 'ramp_' in r.getMessage()]
    assert len(named) == 1 and 'channels_last_tests_raw_memory.ramp_' in named[0]
    assert 'test_extension_functions.py' in named[0]


def test_an_output_argument_the_kernel_resizes_takes_the_new_shape():
    """``ext.op(x, out)`` with ``out`` a preallocated NHWC tensor that the kernel resizes, as an ``out=`` argument
    is: the caller's ``out`` has the kernel's shape and values, as in NCHW."""

    def kernel(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.resize_(3).copy_(torch.as_strided(x, (3,), (1,)))  # memory order: NCHW's

    x = torch.arange(16.0).reshape(1, 4, 2, 2).to(memory_format=torch.channels_last)
    out = torch.empty(1, 4, 2, 2).to(memory_format=torch.channels_last)
    assert contiguous_call(kernel, 'ext.kernel')(x, out) is out
    assert out.tolist() == [0.0, 1.0, 2.0]


def test_extensions_load_as_before_once_no_converted_model_lives():
    """While a converted model lives, extension modules load through the covering loader; after it, through
    Python's own (in a process of its own: no model another test keeps alive counts)."""
    code = (
        'import gc, importlib.machinery as m, torch\n'
        'from channels_last_algo.core.convert import apply_channels_last\n'
        'own = m.ExtensionFileLoader.exec_module\n'
        'net = torch.nn.Conv2d(3, 4, 3)\n'
        'apply_channels_last(net)\n'
        'assert m.ExtensionFileLoader.exec_module is not own\n'
        'del net; gc.collect()\n'
        'assert m.ExtensionFileLoader.exec_module is own\n'
    )
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
