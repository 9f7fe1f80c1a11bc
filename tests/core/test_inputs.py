"""Only images go NHWC: the ``inputs`` option of LayoutGuard, ChannelsLast, ChannelsLastCallback and the
recipe flag. With dict, tuple and nested batches, frame stacks, masks, dense targets and a model that
``.view()``s a non-image 4D input: nothing fails, the images reach the convolutions NHWC, every other
tensor stays as it came (after the first batch, whose guess a failing ``.view()`` survives), and the
numbers are those of the NCHW model."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from channels_last_algo import LayoutGuard
from channels_last_algo.core import module_calls
from channels_last_algo.core.inputs import InputSelection
from channels_last_algo.core.layout import is_channels_last, to_channels_last
from channels_last_algo.core.viewed_outputs import ViewedOutputs
from conftest import lightning_trainer


class MultiInput(nn.Module):
    """A conv net on ``batch['image']``, a linear branch that ``.view()``s ``batch['frames']``
    (N x T x H x W), and a mask multiplied into the features; records its inputs' layouts."""

    def __init__(self, frames: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.frames = nn.Linear(frames * 8 * 8, 4)
        self.head = nn.Linear(4, 2)
        self.seen: list[dict[str, bool]] = []

    def forward(self, batch: dict) -> torch.Tensor:
        self.seen.append({key: is_channels_last(value) for key, value in batch.items() if value.dim() == 4})
        features = self.conv(batch['image']) * batch['mask']
        n = batch['frames'].shape[0]
        frames = self.frames(batch['frames'].view(n, -1))
        return self.head(features.mean((2, 3)) + frames)


def multi_batch(seed: int, frames: int = 5) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        'image': torch.randn(2, 3, 8, 8, generator=generator, dtype=torch.float64),
        'frames': torch.randn(2, frames, 8, 8, generator=generator, dtype=torch.float64),
        'mask': (torch.rand(2, 1, 8, 8, generator=generator) > 0.5).double(),
        'target': torch.randn(2, 2, 8, 8, generator=generator, dtype=torch.float64),  # dense, used by the loss
    }


def _train(model: nn.Module, guard: LayoutGuard | None, batches: list[dict]) -> list[torch.Tensor]:
    losses = []
    for batch in batches:
        batch = guard.on_batch(batch) if guard else batch
        loss = (model(batch)[:, :, None, None] - batch['target']).square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize('frames', [5, 3])  # 3: the first batch's guess takes the frame stack for an image
def test_only_images_go_nhwc_and_views_of_other_tensors_work(frames):
    torch.manual_seed(0)
    reference = MultiInput(frames).double()
    model = copy.deepcopy(reference)
    guard = LayoutGuard()
    guard.on_init(model)
    batches = [multi_batch(seed, frames) for seed in range(3)]
    losses = _train(model, guard, batches)
    expected = _train(reference, None, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-12, atol=1e-14)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-14)
    assert all(seen['image'] for seen in model.seen)
    assert model.seen[1:] == [{'image': True, 'frames': False, 'mask': False, 'target': False}] * 2
    described = guard.inputs.describe(batches[0])
    assert described.startswith("batch['image'] (fed to a convolution); left as they came: batch['frames']")


def test_a_view_watch_under_way_does_not_hide_a_view_nhwc_makes_fail():
    """Another guard's view watch (a mode below this search's) runs failing views on copies; the
    search still asks torch itself whether the frame stack's view fails in NHWC."""
    batch = multi_batch(0, frames=3)  # 3 channels: the guess takes the frame stack for an image
    with ViewedOutputs(nn.Identity()):
        selection = InputSelection('auto')
        MultiInput(frames=3).double()(selection.start(batch, lambda t: True, to_channels_last))
    assert "batch['frames'] (viewed in a shape NHWC cannot take)" in selection.describe(batch)


class MasksItsInput(nn.Module):
    """Zeroes the first pixels of its input through a flat view (which aliases the input in NCHW)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, x):
        x.view(x.size(0), -1)[:, :7] = 0
        return self.fc(self.conv(x).mean((2, 3)))


def test_a_write_through_a_view_of_the_first_batch_lands_in_the_batch():
    """The first batch's guess makes the images NHWC, whose flat view runs on a copy: the write
    through it must still reach the images the convolution reads."""
    torch.manual_seed(0)
    reference = MasksItsInput().double()
    model = copy.deepcopy(reference)
    guard = LayoutGuard()
    guard.on_init(model)
    for seed in range(2):
        images = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        expected = reference(images.clone())
        with guard.step():
            torch.testing.assert_close(model(guard.on_batch(images.clone())), expected, rtol=1e-12, atol=1e-14)


def test_tuple_and_nested_batches_and_a_bare_tensor():
    conv = nn.Conv2d(3, 4, 1)

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, batch):
            (images, depth), extra = batch
            return self.conv(images).sum() + depth.view(-1).sum() + extra.sum()

    guard = LayoutGuard()
    model = Pair()
    guard.on_init(model)
    for _ in range(2):
        batch = guard.on_batch(((torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)), torch.ones(2)))
        model(batch)
    (images, depth), _ = batch
    assert is_channels_last(images) and not is_channels_last(depth)
    assert guard.inputs.describe(batch).startswith('batch[0][0] (fed to a convolution); left as they came: batch[0][1]')

    bare = LayoutGuard()
    bare.on_init(conv)
    for _ in range(2):
        x = bare.on_batch(torch.randn(2, 3, 4, 4))
        conv(x)
    assert is_channels_last(x)


def test_keys_positions_and_predicates_choose_without_a_first_batch():
    batch = {'image': torch.randn(2, 3, 4, 4), 'frames': torch.randn(2, 3, 4, 4)}
    for inputs in (['image'], [('image',)], lambda path, tensor: path == ('image',)):
        out = LayoutGuard(inputs=inputs).on_batch(batch)
        assert is_channels_last(out['image']) and out['frames'] is batch['frames']
    out = LayoutGuard(inputs=[1]).on_batch((batch['frames'], batch['image']))
    assert not is_channels_last(out[0]) and is_channels_last(out[1])
    out = LayoutGuard(inputs='all').on_batch(batch)
    assert is_channels_last(out['image']) and is_channels_last(out['frames'])


@pytest.mark.parametrize(
    'inputs, batch, named',
    [
        ([7], (torch.randn(2, 3, 4, 4), torch.zeros(2)), '7'),
        (['imgae'], {'image': torch.randn(2, 3, 4, 4)}, "'imgae'"),
        ([1], (torch.randn(2, 3, 4, 4), torch.zeros(2)), '1'),  # a tensor there, but not a 4D/5D one
    ],
)
def test_a_named_input_that_is_not_in_the_batch_is_refused_at_the_first_batch(inputs, batch, named):
    guard = LayoutGuard(inputs=inputs)
    with pytest.raises(ValueError, match=rf'inputs=.*: {re.escape(named)} names no 4D or 5D tensor of the batch'):
        guard.on_batch(batch)


@pytest.mark.parametrize('bad', ['some', [], [True], 3, [1.5]])
def test_bad_inputs_are_refused_with_what_is_expected(bad):
    with pytest.raises(ValueError, match=r"inputs must be 'auto' \(the batch tensors fed to a convolution\)"):
        LayoutGuard(inputs=bad)
    with pytest.raises(ValueError, match='inputs must be'):
        InputSelection(bad)


class Frames(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return {
            'image': torch.randn(3, 8, 8, generator=generator),
            'frames': torch.randn(5, 8, 8, generator=generator),
            'mask': torch.ones(1, 8, 8),
            'target': torch.randn(2, 8, 8, generator=generator),
            'label': index % 2,
        }


def test_composer_trains_a_model_that_views_a_non_image_input():
    pytest.importorskip('composer')
    from composer import Trainer
    from composer.models import ComposerModel

    from channels_last_algo import ChannelsLast

    class Wrapped(ComposerModel):
        def __init__(self):
            super().__init__()
            self.module = MultiInput()

        def forward(self, batch):
            return self.module({k: v for k, v in batch.items() if k != 'label'})

        def loss(self, outputs, batch):
            return nn.functional.cross_entropy(outputs, batch['label'])

    model = Wrapped()
    algorithm = ChannelsLast(audit_steps=1)
    Trainer(
        model=model,
        train_dataloader=DataLoader(Frames(), batch_size=2),
        max_duration='3ba',
        algorithms=[algorithm],
        device='cpu',
        progress_bar=False,
    ).fit()
    assert len(model.module.seen) == 3 and all(seen['image'] for seen in model.module.seen)
    assert not any(seen['frames'] or seen['target'] for seen in model.module.seen)
    assert (
        repr(ChannelsLast(inputs=['image'])) == "ChannelsLast(mode='on', audit_steps=0, strict=False, inputs=['image'])"
    )


def test_lightning_step_that_calls_a_submodule_finds_the_images():
    L = pytest.importorskip('lightning')

    from channels_last_algo import ChannelsLastCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MultiInput()

        def training_step(self, batch, batch_idx):
            inputs = {k: v for k, v in batch.items() if k != 'label'}
            return nn.functional.cross_entropy(self.net(inputs), batch['label'])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    trainer = lightning_trainer(
        max_steps=3,
        callbacks=[ChannelsLastCallback()],
    )
    trainer.fit(module, DataLoader(Frames(), batch_size=2))
    assert len(module.net.seen) == 3 and all(seen['image'] for seen in module.net.seen)
    assert not any(seen['frames'] or seen['target'] for seen in module.net.seen)


def test_a_compiled_fullgraph_forward_keeps_the_first_batch_guess():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    guard = LayoutGuard()
    guard.on_init(net)
    compiled = torch.compile(net, fullgraph=True, backend='eager')
    for _ in range(3):
        images = guard.on_batch(torch.randn(2, 3, 8, 8))
        assert is_channels_last(images)
        compiled(images)
    assert guard.inputs.chosen and all(chosen == {()} for chosen in guard.inputs.chosen.values())


class FailsBeforeAnyConvolution(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(7)  # the batch's last dimension is 8: this raises first
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(self.norm(x))


@pytest.mark.parametrize('audit_steps', [0, 1])
@pytest.mark.parametrize(
    'model, error',
    [
        (FailsBeforeAnyConvolution, 'normalized_shape'),
        (lambda: nn.Sequential(nn.Conv2d(1, 4, 3)), 'expected input.* to have 1 channels'),  # fails in the convolution
    ],
    ids=['before a convolution', 'in a convolution'],
)
def test_a_first_step_that_fails_shows_its_own_error_and_stops_following(model, error, audit_steps):
    """The model's error comes out as it is (a hook taking itself off while torch unwinds the forward
    once replaced it with "OrderedDict mutated during iteration"), and nothing of the failed step
    follows later module calls of any model."""
    model = model()
    guard = LayoutGuard(audit_steps=audit_steps)
    guard.on_init(model)
    batch = guard.on_batch(torch.randn(2, 3, 8, 8))
    with pytest.raises(RuntimeError, match=error), guard.step():
        model(batch)
    assert not guard.inputs.following
    guard.on_batch(torch.randn(2, 3, 8, 8))
    assert not module_calls.tracking(guard.inputs)


class _Reordering(nn.Module):
    """Takes its images with the channels elsewhere, as DALI and FFCV give them ((N, H, W, C)) or a video loader
    ((N, T, C, H, W)), and moves them second itself: those batch tensors are NHWC (NDHWC) as they come."""

    def __init__(self, video: bool) -> None:
        super().__init__()
        self.video = video
        self.conv = nn.Conv3d(3, 4, 3, padding=1) if video else nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        channels_second = frames.transpose(1, 2) if self.video else frames.permute(0, 3, 1, 2)
        return self.conv(channels_second.double() / 255).mean()


@pytest.mark.parametrize('video', [False, True], ids=['NHWC images', 'NTCHW video'])
def test_a_batch_the_model_reorders_to_put_the_channels_second_is_left_as_it_came(video, caplog):
    shape = (2, 4, 3, 6, 6) if video else (2, 6, 6, 3)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 255, shape, generator=generator, dtype=torch.uint8) for _ in range(3)]
    torch.manual_seed(0)
    model = _Reordering(video).double()
    reference = copy.deepcopy(model)
    guard = LayoutGuard()
    guard.on_init(model)
    with caplog.at_level('INFO', logger='channels_last_algo.core.inputs'):
        for frames in batches:
            given = guard.on_batch(frames)
            assert given is frames  # no copy: NHWC already
            with guard.step():
                loss = model(given)
                loss.backward()
            torch.testing.assert_close(loss, reference(frames), rtol=1e-12, atol=1e-12)
    guard.close()
    assert 'batch (its dimensions reordered before a convolution)' in caplog.text


def test_an_image_the_model_transposes_in_height_and_width_still_goes_nhwc():
    class Transposing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.conv(images.transpose(2, 3)).mean()

    model, guard = Transposing(), LayoutGuard()
    guard.on_init(model)
    for _ in range(2):
        images = guard.on_batch(torch.randn(2, 3, 6, 8))
        with guard.step():
            model(images).backward()
    guard.close()
    assert is_channels_last(images)


def test_a_clip_the_model_transposes_and_folds_into_frames_still_goes_nhwc():
    """A temporal-shift-style network folds an (N, C, T, H, W) clip into (N * T, C, H, W) frames for a 2D
    convolution: the clip's NDHWC copy makes the frames NHWC as views, so the clip is chosen."""

    class Frames(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, clip: torch.Tensor) -> torch.Tensor:
            n, c, t, h, w = clip.shape
            return self.conv(clip.transpose(1, 2).reshape(n * t, c, h, w)).mean()

    model, guard = Frames(), LayoutGuard()
    guard.on_init(model)
    for _ in range(2):
        clip = guard.on_batch(torch.randn(2, 3, 4, 6, 6))
        with guard.step():
            model(clip).backward()
    guard.close()
    assert is_channels_last(clip)
