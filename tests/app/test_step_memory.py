"""The memory estimate of one training step and the refusal of a step that cannot fit, before any work.

The estimate is checked against the peak RSS of a real ResNet-18 step in a subprocess; the refusals
with the memory this process can use patched small (``available_bytes``), each asserting the key, the
fix and that nothing was written; and the inputs that must not be refused: a microbatch larger than the
batch, Composer's 'auto' on a GPU, models that run on no ``meta`` device, memory that cannot be read.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from recipe_runs import RECIPE, TINY, sets  # noqa: E402
from torch import nn

from channels_last_algo.app.recipes import step_memory
from channels_last_algo.app.recipes.footprints import model_footprints
from channels_last_algo.app.recipes.loading import load_recipe
from channels_last_algo.app.recipes.schema import RecipeError
from channels_last_algo.app.recipes.step_memory import (
    ALLOCATOR_SLACK,
    REFUSE_ABOVE,
    available_bytes,
    check_step_memory,
    estimate_step,
)

MiB = 2**20
TINY_NAME = 'channels_last_algo.app.runs.demo:TinyResNet'


def batch_of(images: int, microbatch) -> list[str]:
    """A global batch of ``images`` (from as many synthetic training images) in microbatches of ``microbatch``."""
    return [
        f'train.global_batch_size={images}',
        f'data.synthetic_train_samples={images}',
        f'train.device_train_microbatch_size={microbatch}',
    ]


BATCH_16 = batch_of(16, 16)

MEASURE_STEP = """
import resource, torch, torchvision
torch.set_num_threads(2)
images, labels = torch.randn(16, 3, 112, 112), torch.randint(0, 10, (16,))
before = int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize()
model = torchvision.models.resnet18(num_classes=10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(2):
    optimizer.zero_grad(set_to_none=False)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
# VmHWM: this process image's own peak (ru_maxrss keeps the parent's size at the fork across the exec)
peak = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')) * 1024
print(peak - before)
"""


class DataDependentNet(nn.Module):
    """A conv net whose forward branches on a value, which the ``meta`` device cannot give; ``branch=False``
    leaves the branch out, so that the same net runs on ``meta``."""

    def __init__(self, num_classes: int = 10, branch: bool = True) -> None:
        super().__init__()
        self.branch = branch
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if self.branch and bool(x.mean() > 1e9):
            x = x * 0
        return self.head(x.mean((2, 3)))


class GrayscaleNet(nn.Module):
    """A net for one-channel images, which no RGB pass can run: no estimate."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def recipe(*overrides: str):
    return load_recipe(RECIPE, [*TINY, *overrides])


def with_memory(monkeypatch, available) -> None:
    """This process can use ``available`` bytes from now on (None: the memory cannot be read)."""
    monkeypatch.setattr(step_memory, 'available_bytes', lambda device: available)


def batches(r) -> tuple[int, int]:
    return r.train.global_batch_size, r.train.eval_batch_size or r.train.global_batch_size


def refusal(r, device: str = 'cpu', precision: str = 'fp32') -> str:
    with pytest.raises(RecipeError) as caught:
        check_step_memory(r, device, precision, batches(r))
    message = str(caught.value)
    assert '\n' not in message
    return message


def test_the_estimate_is_the_size_of_a_measured_step():
    import torchvision

    measured = int(
        subprocess.run([sys.executable, '-c', MEASURE_STEP], capture_output=True, text=True, check=True).stdout
    )
    train, _, (trained, weights) = model_footprints(lambda: torchvision.models.resnet18(num_classes=10), 112, 112)
    estimate = weights + 2 * trained + train.bytes(16)  # weights, gradients, momentum and 16 images' pass
    # a floor of the peak (no false refusal) that the allocator's slack lifts above it (a suggestion that fits)
    assert measured / ALLOCATOR_SLACK['cpu'] < estimate < measured * REFUSE_ABOVE, (estimate / MiB, measured / MiB)


def test_a_microbatch_too_large_is_refused_with_the_largest_that_fits(monkeypatch):
    with_memory(monkeypatch, 4 * MiB)
    message = refusal(recipe(*BATCH_16))
    assert message.startswith(
        f'{RECIPE}: train.device_train_microbatch_size: one training microbatch of 16 images '
        f'(train.global_batch_size 16) at data.train_crop 32 px with {TINY_NAME} needs about '
    )
    assert 'more than the 4.0 MiB this process can use on the CPU; the largest microbatch that fits is ' in message
    fits = int(message.rpartition('--set train.device_train_microbatch_size=')[2])
    assert 1 <= fits < 16
    assert check_step_memory(recipe(*batch_of(16, fits)), 'cpu', 'fp32', (16, 16)) is not None


def test_the_auto_microbatch_of_the_cpu_is_checked(monkeypatch):
    with_memory(monkeypatch, 8 * MiB)  # 'auto' is 32 images on the CPU
    message = refusal(recipe(*batch_of(64, 'auto')))
    assert (
        'train.device_train_microbatch_size: one training microbatch of 32 images (train.global_batch_size 64)'
        in message
    )


def test_an_evaluation_microbatch_too_large_is_refused(monkeypatch):
    r = recipe(*BATCH_16, 'data.eval_crop=512', 'data.eval_resize=548')
    step = estimate_step(r, 'cpu', 'fp32', (16, 16))
    train_need, eval_need = step.need(16, 16)
    assert eval_need > 10 * train_need
    with_memory(monkeypatch, (train_need + eval_need) // 4)
    message = refusal(r)
    assert (
        f'{RECIPE}: train.device_train_microbatch_size: one evaluation microbatch of 16 images at data.eval_crop 512 px'
        in message
    )
    assert '--set train.device_train_microbatch_size=' in message


def test_one_image_that_cannot_fit_names_the_crop(monkeypatch):
    with_memory(monkeypatch, 1 * MiB)
    message = refusal(recipe(*BATCH_16))
    assert message.startswith(
        f'{RECIPE}: data.train_crop: even one image a microbatch at 32 px with {TINY_NAME} needs about '
    )
    assert message.endswith(
        'too much for the 1.0 MiB this process can use on the CPU; lower data.train_crop or choose a smaller model.name'
    )


def test_loaded_batches_that_cannot_fit_name_the_global_batch(monkeypatch):
    with_memory(monkeypatch, 2**30)
    message = refusal(recipe(*batch_of(1048576, 1), 'data.workers=2'))
    assert message.startswith(
        f'{RECIPE}: train.global_batch_size: the loaded batches of 1048576 images (5 of each loader in memory)'
    )
    assert message.endswith('lower train.global_batch_size, train.eval_batch_size or data.workers')


def test_training_batches_wait_beside_an_evaluation_within_an_epoch_only():
    batch = 16 * 3 * 32 * 32  # 16 uint8 images of 32 px; data.workers=2: 5 a loader in memory on the CPU
    within = estimate_step(recipe(*BATCH_16, 'data.workers=2'), 'cpu', 'fp32', (16, 16))  # eval every 2ba
    at_end = estimate_step(recipe(*BATCH_16, 'data.workers=2', 'train.eval_interval=1ep'), 'cpu', 'fp32', (16, 16))
    assert (within.loaded_train, within.loaded_eval) == (5 * batch, 10 * batch)
    assert (at_end.loaded_train, at_end.loaded_eval) == (5 * batch, 6 * batch)


def test_a_microbatch_larger_than_the_batch_is_the_batch(monkeypatch):
    r = recipe('train.device_train_microbatch_size=1000000')  # the global batch is 4
    step = estimate_step(r, 'cpu', 'fp32', (4, 4))
    with_memory(monkeypatch, max(step.need(4, 4)))
    assert check_step_memory(r, 'cpu', 'fp32', (4, 4)) == step


def test_the_auto_microbatch_of_a_gpu_is_checked_at_one_image(monkeypatch):
    r = recipe(*batch_of(4096, 'auto'))
    gpu, cpu = estimate_step(r, 'gpu', 'amp_fp16', (4096, 4096)), estimate_step(r, 'cpu', 'fp32', (4096, 4096))
    assert gpu.train.per_image == int(cpu.train.per_image / 2)  # activations in half precision
    with_memory(monkeypatch, max(gpu.need(2, 2)))  # Composer's 'auto' halves on CUDA out-of-memory: no refusal
    assert check_step_memory(r, 'gpu', 'amp_fp16', (4096, 4096)) == gpu
    assert 'train.global_batch_size: the loaded batches of 4096 images (1 of each loader in memory)' in refusal(r)
    with_memory(monkeypatch, MiB // 2)
    message = refusal(recipe(*batch_of(16, 'auto')), 'gpu', 'amp_fp16')
    assert message.startswith(f'{RECIPE}: data.train_crop: even one image a microbatch at 32 px')
    assert 'too much for the 0.5 MiB this process can use on the GPU' in message


def test_a_model_that_does_not_run_on_meta_is_estimated_on_the_cpu(monkeypatch):
    on_meta = model_footprints(lambda: DataDependentNet(branch=False), 128, 128)
    fallback = model_footprints(DataDependentNet, 128, 128)  # at 64 px on the CPU, scaled by pixels
    assert 0.8 < fallback[0].per_image / on_meta[0].per_image < 1.25
    assert fallback[2] == on_meta[2]
    with_memory(monkeypatch, 2 * MiB)
    message = refusal(recipe(*BATCH_16, 'model.name=test_step_memory:DataDependentNet'))
    assert 'train.device_train_microbatch_size: one training microbatch of 16 images' in message


def test_a_model_that_runs_nowhere_gets_no_estimate_and_no_refusal(monkeypatch):
    assert model_footprints(GrayscaleNet, 32, 32) is None
    with_memory(monkeypatch, 1)
    assert (
        check_step_memory(recipe(*BATCH_16, 'model.name=test_step_memory:GrayscaleNet'), 'cpu', 'fp32', (16, 16))
        is None
    )


def test_memory_that_cannot_be_read_refuses_nothing(monkeypatch):
    monkeypatch.setattr(step_memory, '_meminfo_available', lambda: None)
    assert available_bytes('cpu') is None
    huge = recipe(*batch_of(2**20, 2**20))
    assert check_step_memory(huge, 'cpu', 'fp32', (2**20, 2**20)) is None
    if not torch.cuda.is_available():
        assert available_bytes('gpu') is None


def test_available_memory_is_the_cgroup_limit_where_lower_and_shared_by_the_ranks(monkeypatch, tmp_path):
    v2, v1 = tmp_path / 'memory.max', tmp_path / 'memory.limit_in_bytes'
    monkeypatch.setattr(step_memory, 'CGROUP_LIMITS', (v2, v1))
    monkeypatch.setattr(step_memory, '_meminfo_available', lambda: 5 * 2**30)
    monkeypatch.setattr(step_memory, '_resident_bytes', lambda: 100 * MiB)
    v1.write_text('9223372036854771712\n')  # cgroup v1's "no limit"
    assert available_bytes('cpu') == 5 * 2**30
    v2.write_text('max\n')
    assert available_bytes('cpu') == 5 * 2**30
    v2.write_text(f'{2**30}\n')
    assert available_bytes('cpu') == 2**30 - 100 * MiB
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    assert available_bytes('cpu') == (2**30 - 100 * MiB) // 4


def test_the_cli_refuses_before_the_run_folder(monkeypatch, tmp_path, capsys):
    pytest.importorskip('composer')
    from channels_last_algo.app.cli.entry import main

    with_memory(monkeypatch, 4 * MiB)
    folder = tmp_path / 'run'
    overrides = [*TINY, *BATCH_16, f'train.save_folder={folder}']
    assert main(['train', RECIPE, *sets(overrides)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'channels-last train: error: {RECIPE}: train.device_train_microbatch_size: ')
    assert 'one training microbatch of 16 images (train.global_batch_size 16) at data.train_crop 32 px' in err
    assert '--set train.device_train_microbatch_size=' in err and 'Traceback' not in err
    assert not folder.exists()


def test_the_cli_refusal_keeps_the_checkpoints_overwrite_would_delete(monkeypatch, tmp_path, capsys):
    pytest.importorskip('composer')
    from channels_last_algo.app.cli.entry import main

    folder = tmp_path / 'run'
    folder.mkdir()
    checkpoint = folder / 'ep0-ba2-rank0.pt'
    checkpoint.write_bytes(b'an earlier run')
    with_memory(monkeypatch, 1 * MiB)
    assert main(['train', RECIPE, *sets([*TINY, *BATCH_16, f'train.save_folder={folder}']), '--overwrite']) == 2
    assert 'error: ' + RECIPE + ': data.train_crop: even one image a microbatch at 32 px' in capsys.readouterr().err
    assert checkpoint.read_bytes() == b'an earlier run'
    assert sorted(p.name for p in folder.iterdir()) == ['ep0-ba2-rank0.pt']
