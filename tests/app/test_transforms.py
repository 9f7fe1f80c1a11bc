"""The NHWC crops against torchvision: the same random boxes and flips from the same seed, the same
box distribution, pixels within the stated tolerances of torchvision's PIL transforms (full-scale
and scaled JPEG decoding), the same crop from every kind of input, and slots of a batch as ``out``.

Test images are smooth gradients plus 1/f^1.5 texture (numpy FFT), saved as JPEG quality 90, so a
box or window off by one pixel shows as more than one grey level."""

import io

import numpy as np
import PIL
import pytest
import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import functional as F
from torchvision.transforms import v2

from channels_last_algo.app.data.batch import empty_nhwc
from channels_last_algo.app.data.decode import ArrayImage, EncodedImage
from channels_last_algo.app.data.transforms import CropPlan, NHWCCrop, RandomResizedCropFlip, ResizeCenterCrop

# torch's antialiased uint8 bilinear kernel vs Pillow's: never more than one grey level apart. The
# share of pixels one level apart depends on Pillow: at most 0.041 measured with Pillow 11.3 (torch
# 2.7), 0.24 with Pillow 13.0 (torch 2.14; torch's output is the same in both, Pillow's moved).
PILLOW_MEAN_TOLERANCE = 0.06 if int(PIL.__version__.split('.')[0]) < 12 else 0.3


def natural_image(height: int, width: int, seed: int) -> np.ndarray:
    """(H, W, 3) uint8: colour gradients plus 1/f^1.5-amplitude texture per channel, fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    frequency = np.hypot(np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None])
    frequency[0, 0] = 1
    spectrum = (rng.normal(size=(3, *frequency.shape)) + 1j * rng.normal(size=(3, *frequency.shape))) / frequency**1.5
    spectrum[:, 0, 0] = 0
    texture = np.fft.irfft2(spectrum, s=(height, width))
    texture /= texture.std(axis=(1, 2), keepdims=True)
    rows, columns = np.linspace(0, 1, height)[:, None, None], np.linspace(0, 1, width)[None, :, None]
    gradient = columns * np.array([60, -40, 20]) + rows * np.array([-30, 50, 10])
    return np.clip(128 + 40 * texture.transpose(1, 2, 0) + gradient, 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, format: str = 'JPEG', mode: str = 'RGB') -> bytes:
    """``pixels`` saved in ``mode`` as ``format`` (JPEG at quality 90)."""
    buffer = io.BytesIO()
    options = {'quality': 90} if format == 'JPEG' else {}
    Image.fromarray(pixels).convert(mode).save(buffer, format, **options)
    return buffer.getvalue()


def natural_jpeg(height: int, width: int, seed: int) -> tuple[EncodedImage, Image.Image]:
    """A natural image as a JPEG: the encoded file and Pillow's decoding of it."""
    data = encoded(natural_image(height, width, seed))
    return EncodedImage(data), Image.open(io.BytesIO(data)).convert('RGB')


def differences(ours, reference) -> tuple[int, float, float]:
    """(max, mean, 99th percentile) of the absolute pixel differences, in grey levels."""
    difference = np.abs(np.asarray(ours).astype(np.int16) - np.asarray(reference).astype(np.int16))
    return int(difference.max()), float(difference.mean()), float(np.percentile(difference, 99))


class PlannedCrop(NHWCCrop):
    """An NHWC crop along a fixed :class:`CropPlan`, whatever the image size."""

    def __init__(self, size: int, plan: CropPlan) -> None:
        super().__init__(size)
        self.fixed_plan = plan

    def plan(self, height: int, width: int) -> CropPlan:
        return self.fixed_plan


def train_plan(size: int, box: tuple[int, int, int, int], flip: bool) -> CropPlan:
    return CropPlan(box, (size, size), (0, 0, size, size), flip)


def torchvision_crop(image: Image.Image, plan: CropPlan) -> Image.Image:
    """torchvision's ``resized_crop`` (+ ``hflip``) of a train plan's box, on the PIL image."""
    cropped = F.resized_crop(image, *plan.box, list(plan.resize), antialias=True)
    return F.hflip(cropped) if plan.flip else cropped


# --- the random draws ---------------------------------------------------------------------------------

SIZES = [(375, 500), (500, 375), (256, 256), (20, 300), (300, 20), (7, 9)]
OPTIONS = [{}, {'scale': (0.25, 0.5), 'ratio': (0.5, 2.0), 'flip_probability': 0.3}, {'scale': (1.0, 1.0)}]
# get_params' centre crop after ten failed draws, for default options: the short side, 4/3 of it long
FALLBACKS = {(20, 300): (0, 136, 20, 27), (300, 20): (136, 0, 27, 20)}


@pytest.mark.parametrize('height, width', SIZES)
@pytest.mark.parametrize('options', OPTIONS)
def test_plan_draws_torchvisions_box_and_flip(height, width, options, monkeypatch):
    """From the same torch seed, ``plan`` gives exactly the box and flip that torchvision's own
    ``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip(p)`` apply (recorded from
    their calls to ``resized_crop`` and ``hflip``), and leaves the random state where they leave it.
    The 20x300 and 300x20 images reach get_params' centre-crop fallback."""
    ours = RandomResizedCropFlip(16, **options)
    applied = []
    monkeypatch.setattr(F, 'resized_crop', lambda image, *box, **kwargs: applied.append([tuple(box[:4]), False]))
    monkeypatch.setattr(F, 'hflip', lambda image: applied[-1].__setitem__(1, True))
    theirs = transforms.Compose(
        [
            transforms.RandomResizedCrop(16, scale=ours.scale, ratio=ours.ratio, antialias=True),
            transforms.RandomHorizontalFlip(ours.flip_probability),
        ]
    )
    plans = []
    for seed in range(40):
        torch.manual_seed(seed)
        theirs(torch.zeros(3, height, width))
        next_draw = torch.rand(1)
        torch.manual_seed(seed)
        plans.append(ours.plan(height, width))
        assert torch.equal(torch.rand(1), next_draw)
    assert [[plan.box, plan.flip] for plan in plans] == applied
    assert {(plan.resize, plan.window) for plan in plans} == {((16, 16), (0, 0, 16, 16))}
    if 0 < ours.flip_probability < 1:
        assert 0 < sum(plan.flip for plan in plans) < len(plans)
    if (height, width) in FALLBACKS and not options:
        assert FALLBACKS[height, width] in [plan.box for plan in plans]


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    values = np.concatenate([a, b])
    gap = np.searchsorted(a, values, side='right') / len(a) - np.searchsorted(b, values, side='right') / len(b)
    return float(np.abs(gap).max())


def ks_critical(n: int, m: int, alpha: float = 1e-3) -> float:
    """The two-sample KS statistic that equal distributions exceed with probability ``alpha`` (large samples)."""
    return float(np.sqrt(-np.log(alpha / 2) / 2) * np.sqrt((n + m) / (n * m)))


def box_features(boxes: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, box_height, box_width = boxes.T.astype(float)
    return {
        'area fraction': box_height * box_width / (height * width),
        'aspect ratio': box_width / box_height,
        'centre x': (left + box_width / 2) / width,
        'centre y': (top + box_height / 2) / height,
    }


def draw_boxes(draw, count: int, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    return np.array([draw() for _ in range(count)])


@pytest.mark.parametrize(
    'height, width, scale, ratio', [(375, 500, (0.08, 1.0), (3 / 4, 4 / 3)), (500, 333, (0.25, 0.9), (0.5, 2.0))]
)
def test_box_distribution_matches_torchvision(height, width, scale, ratio):
    """2000 boxes from ours (seed 1) and 2000 from torchvision's get_params (seed 2): the two-sample
    KS statistic of area fraction, aspect ratio, centre x and centre y stays below the critical
    value at the 0.1% level (0.0616; measured at most 0.057); the same test tells scale (0.3, 1.0) from ``scale``."""
    image = torch.zeros(0, height, width)
    ours = RandomResizedCropFlip(16, scale=scale, ratio=ratio)
    theirs = draw_boxes(lambda: transforms.RandomResizedCrop.get_params(image, list(scale), list(ratio)), 2000, 2)
    mine = draw_boxes(lambda: ours.plan(height, width).box, 2000, 1)
    critical = ks_critical(len(mine), len(theirs))
    theirs, mine = box_features(theirs, height, width), box_features(mine, height, width)
    statistics = {name: ks_statistic(mine[name], theirs[name]) for name in mine}
    assert max(statistics.values()) < critical, statistics
    narrower = RandomResizedCropFlip(16, scale=(0.3, 1.0), ratio=ratio)
    other = box_features(draw_boxes(lambda: narrower.plan(height, width).box, 2000, 3), height, width)
    assert ks_statistic(other['area fraction'], theirs['area fraction']) > critical


# --- pixels at full scale --------------------------------------------------------------------------------


def test_train_crops_match_torchvision_resized_crop_and_hflip():
    """Boxes written by hand (downscale, upscale, no resize, corners, non-square, flips) on a
    375x500 and a 500x375 JPEG: our crop of the decoded image and of the file (decoded at full
    scale: every box here is resized down less than 2x, or up) equal each other exactly and are
    within one grey level of torchvision's ``resized_crop`` + ``hflip`` on the PIL image, with at
    most ``PILLOW_MEAN_TOLERANCE`` of a level on average (measured: max 1; mean 0.009 with Pillow
    11.3, 0.17 with Pillow 13.0)."""
    for seed, (height, width) in enumerate([(375, 500), (500, 375)]):
        file, image = natural_jpeg(height, width, seed)
        boxes = [(0, 0, 64, 64), (10, 20, 100, 90), (height - 120, width - 77, 120, 77), (3, 5, 40, 25)]
        boxes += [(0, 0, 127, 127), (200, 100, 33, 120), (17, 80, 64, 100)]
        for box in boxes:
            for flip in (False, True):
                plan = train_plan(64, box, flip)
                crop = PlannedCrop(64, plan)
                assert file.max_shrink(box[2:], plan.resize) == 1
                ours = crop(image)
                np.testing.assert_array_equal(crop(file), ours)
                worst, mean, _ = differences(ours, torchvision_crop(image, plan))
                assert worst <= 1 and mean <= PILLOW_MEAN_TOLERANCE, (box, flip, worst, mean)


@pytest.mark.parametrize('compose', [transforms.Compose, v2.Compose], ids=['v1', 'v2'])
def test_seeded_train_crops_match_torchvisions_transforms(compose):
    """Same seed: ``RandomResizedCropFlip(56)`` on the decoded image vs torchvision's (v1 and v2)
    ``RandomResizedCrop(56)`` + ``RandomHorizontalFlip()`` on the PIL image: max one grey level,
    mean within ``PILLOW_MEAN_TOLERANCE`` (measured 0.041 with Pillow 11.3, 0.23 with 13.0), for 20
    draws on each of three images."""
    module = transforms if compose is transforms.Compose else v2
    theirs = compose([module.RandomResizedCrop(56, antialias=True), module.RandomHorizontalFlip()])
    ours = RandomResizedCropFlip(56)
    for seed, (height, width) in enumerate([(120, 160), (160, 120), (61, 97)]):
        image = Image.fromarray(natural_image(height, width, seed))
        for draw in range(20):
            torch.manual_seed(draw)
            expected = theirs(image)
            torch.manual_seed(draw)
            worst, mean, _ = differences(ours(image), expected)
            assert worst <= 1 and mean <= PILLOW_MEAN_TOLERANCE, (height, width, draw, worst, mean)


def test_a_flipped_crop_is_the_mirror_of_the_unflipped_one_bit_for_bit():
    """``flip`` mirrors the kept window left to right, exactly: the same plan with and without it
    give mirror images, for random boxes, resizes (square and not, down and up) and windows, on the
    decoded image and on the file (decoded at full or reduced scale)."""
    rng = np.random.default_rng(0)
    for seed, (height, width) in enumerate([(375, 500), (97, 131), (750, 1000)]):
        file, image = natural_jpeg(height, width, seed)
        for _ in range(25):
            box_height, box_width = int(rng.integers(5, height + 1)), int(rng.integers(5, width + 1))
            box = (int(rng.integers(0, height - box_height + 1)), int(rng.integers(0, width - box_width + 1)))
            size = int(rng.choice([16, 56, 112]))
            extra = rng.integers(0, 30, 2) if rng.random() < 0.5 else (0, 0)  # a window inside a larger resize
            resize = (size + int(extra[0]), size + int(extra[1]))
            corner = (int(rng.integers(0, resize[0] - size + 1)), int(rng.integers(0, resize[1] - size + 1)))
            window = (*corner, size, size)
            plan = CropPlan((*box, box_height, box_width), resize, window, False)
            for source in (image, file):
                mirrored = PlannedCrop(size, plan._replace(flip=True))(source)
                np.testing.assert_array_equal(mirrored, PlannedCrop(size, plan)(source)[:, ::-1], err_msg=str(plan))


# (height, width), crop, resize: portrait, landscape, square; centre offsets of x.5 (rounded half to
# even); a short side equal to the resize (no resize); a short side below it (upscaled)
VAL_CASES = [
    ((300, 400), 64, 73),
    ((400, 300), 64, 73),
    ((256, 256), 224, 232),
    ((375, 500), 224, 232),
    ((500, 333), 33, 36),
    ((333, 500), 35, 36),
    ((97, 131), 64, 64),
    ((101, 102), 30, 33),
    ((73, 110), 64, 73),
    ((40, 50), 32, 36),
    ((20, 31), 16, 36),
]


@pytest.mark.parametrize('size, crop, resize', VAL_CASES)
def test_val_crop_matches_torchvision_resize_center_crop(size, crop, resize):
    """``ResizeCenterCrop(crop, resize)`` plans torchvision's exact resize and window (read off
    ``F.resize`` on a tensor and ``F.center_crop`` on an index image) and is within one grey level of
    ``Resize(resize)`` + ``CenterCrop(crop)`` on the PIL image, mean at most 0.06 (measured: max 1,
    mean 0.042 for 40x50 -> 36, at most 0.009 for the others, with Pillow 11.3 and 13.0 alike;
    identical where there is nothing to resize)."""
    height, width = size
    ours = ResizeCenterCrop(crop, resize)
    plan = ours.plan(height, width)
    resized = tuple(F.resize(torch.zeros(1, height, width), resize, antialias=True).shape[1:])
    rows, columns = torch.meshgrid(torch.arange(resized[0]), torch.arange(resized[1]), indexing='ij')
    corner = F.center_crop(torch.stack([rows, columns]), crop)[:, 0, 0].tolist()
    assert plan == CropPlan((0, 0, height, width), resized, (*corner, crop, crop), False)
    image = Image.fromarray(natural_image(height, width, seed=height * width))
    expected = transforms.Compose([transforms.Resize(resize, antialias=True), transforms.CenterCrop(crop)])(image)
    worst, mean, _ = differences(ours(image), expected)
    assert worst <= 1 and mean <= 0.06, (worst, mean)
    if resized == size:
        np.testing.assert_array_equal(ours(image), expected)


# --- scaled decoding --------------------------------------------------------------------------------------


def test_max_shrink_is_the_largest_scale_that_keeps_the_target():
    """8, 4, 2 or 1: the largest divisor that leaves the region at least the target in both sides;
    1 for anything but a JPEG."""
    file, image = natural_jpeg(750, 1000, seed=0)
    assert file.size == (750, 1000)
    assert file.max_shrink((750, 1000), (93, 125)) == 8
    assert file.max_shrink((750, 1000), (94, 125)) == 4
    assert file.max_shrink((750, 1000), (93, 126)) == 4
    assert file.max_shrink((600, 600), (150, 150)) == 4
    assert file.max_shrink((600, 600), (151, 150)) == 2
    assert file.max_shrink((600, 600), (300, 300)) == 2
    assert file.max_shrink((600, 600), (301, 1)) == 1
    assert file.max_shrink((64, 64), (64, 64)) == 1
    assert file.max_shrink((100, 100), (200, 200)) == 1
    png = EncodedImage(encoded(np.asarray(image), 'PNG'))
    assert png.size == (750, 1000) and png.max_shrink((750, 1000), (10, 10)) == 1
    assert ArrayImage(np.asarray(image)).max_shrink((750, 1000), (10, 10)) == 1


@pytest.mark.parametrize('height, width', [(750, 1000), (333, 517), (17, 9)])
def test_scaled_decode_has_ceil_sides(height, width):
    """``decode(shrink)`` is ``(3, ceil(H / shrink), ceil(W / shrink))`` uint8, over HWC memory."""
    file, _ = natural_jpeg(height, width, seed=1)
    for shrink in (1, 2, 4, 8):
        pixels = file.decode(shrink)
        assert pixels.dtype == torch.uint8
        assert tuple(pixels.shape) == (3, -(-height // shrink), -(-width // shrink))
        assert pixels.permute(1, 2, 0).is_contiguous()


def snapped(plan: CropPlan, shrink: int, size: tuple[int, int]) -> CropPlan:
    """``plan`` with its box's edges rounded (half to even) to the grid of a decode at 1/``shrink``:
    the box the scaled decode actually crops, in full-scale pixels."""
    top, left, height, width = plan.box
    edges = [min(round(edge / shrink) * shrink, side) for edge, side in zip((top, left), size)]
    ends = [min(round(end / shrink) * shrink, side) for end, side in zip((top + height, left + width), size)]
    return plan._replace(box=(edges[0], edges[1], ends[0] - edges[0], ends[1] - edges[1]))


def scaled_plans() -> list[tuple[EncodedImage, Image.Image, CropPlan, int]]:
    """Seeded train plans at 64 and 112 px and evaluation plans on three JPEGs whose crop is
    resized down 2x or more: (file, full-scale image, plan, shrink), every shrink 2, 4, 8 present."""
    cases = []
    for seed, (height, width) in enumerate([(750, 1000), (800, 600), (333, 517)]):
        file, image = natural_jpeg(height, width, seed)
        for crop in (RandomResizedCropFlip(64), RandomResizedCropFlip(112), ResizeCenterCrop(64, 73)):
            torch.manual_seed(seed)
            for _ in range(6 if isinstance(crop, RandomResizedCropFlip) else 1):
                plan = crop.plan(height, width)
                shrink = file.max_shrink(plan.box[2:], plan.resize)
                if shrink > 1:
                    cases.append((file, image, plan, shrink))
    assert {shrink for *_, shrink in cases} == {2, 4, 8}
    return cases


def full_scale_reference(image: Image.Image, plan: CropPlan) -> Image.Image:
    """torchvision on the full-scale PIL image: ``resized_crop`` + ``hflip`` for a train plan,
    ``resize`` + ``center_crop`` for an evaluation plan (whole box)."""
    if plan.window[:2] == (0, 0) and plan.window[2:] == plan.resize:
        return torchvision_crop(image, plan)
    return F.center_crop(F.resize(image, list(plan.resize), antialias=True), plan.window[2])


def test_scaled_decoding_stays_close_to_the_full_scale_crop():
    """A JPEG crop resized down 2x or more is decoded at 1/2, 1/4 or 1/8 scale. Against torchvision
    on the full-scale image:

    - the box the scaled decode crops (the plan's edges rounded to the decoded grid), i.e. the
      scaled inverse DCT alone: per crop mean <= 1.6, 99th percentile <= 7, max <= 12 grey levels
      (measured over the 36 crops: 1.25, 5, 8; the same with Pillow 11.3 and 13.0);
    - the plan's own box, which adds each edge's move of up to half a decoded pixel (up to 4 source
      pixels at 1/8): per crop mean <= 4.5, 99th percentile <= 16 (measured 3.58, 12; max 20).
      An evaluation crop's box is the whole image: nothing moves.
    """
    worst_snapped, worst_exact = np.zeros(3), np.zeros(3)
    for file, image, plan, shrink in scaled_plans():
        ours = PlannedCrop(plan.window[2], plan)(file)
        exact = differences(ours, full_scale_reference(image, plan))
        worst_exact = np.maximum(worst_exact, exact)
        on_grid = differences(ours, full_scale_reference(image, snapped(plan, shrink, image.size[::-1])))
        worst_snapped = np.maximum(worst_snapped, on_grid)
    assert worst_snapped[0] <= 12 and worst_snapped[1] <= 1.6 and worst_snapped[2] <= 7, worst_snapped
    assert worst_exact[1] <= 4.5 and worst_exact[2] <= 16, worst_exact


# --- inputs and out ----------------------------------------------------------------------------------------


CROPS = [
    ResizeCenterCrop(48, 56),
    PlannedCrop(48, train_plan(48, (10, 30, 70, 90), flip=False)),
    PlannedCrop(48, train_plan(48, (40, 0, 48, 48), flip=True)),
    PlannedCrop(48, train_plan(48, (5, 7, 30, 20), flip=True)),
]


@pytest.mark.parametrize('mode', ['RGB', 'L', 'RGBA', 'P'])
def test_every_input_gives_the_same_crop(mode):
    """A PNG in ``mode``: its bytes (EncodedImage), the PIL image in ``mode``, its RGB (H, W, 3)
    array and ArrayImage give the same crop, bit for bit; so do a JPEG's bytes and its decoded
    image at full scale."""
    pixels = natural_image(90, 120, seed=3)
    data = encoded(pixels, 'PNG', mode)
    image = Image.open(io.BytesIO(data))
    assert image.mode == mode
    rgb = np.asarray(image.convert('RGB'))
    jpeg = encoded(pixels)
    for crop in CROPS:
        expected = crop(rgb)
        assert expected.shape == (48, 48, 3) and expected.dtype == np.uint8
        for other in (EncodedImage(data), image, ArrayImage(rgb.copy())):
            np.testing.assert_array_equal(crop(other), expected)
        np.testing.assert_array_equal(crop(EncodedImage(jpeg)), crop(Image.open(io.BytesIO(jpeg))))


def test_out_receives_the_crop_in_a_batch_slot():
    """``out`` as a numpy slot and as a tensor slot of an NHWC batch (and of an NCHW one): the
    crop lands there, equal to the crop without ``out``, the slot is returned, other slots keep
    their bytes."""
    image = natural_image(90, 120, seed=4)
    for crop in CROPS:
        expected = crop(image)
        for kind in ('numpy', 'tensor', 'nchw tensor'):
            batch = empty_nhwc(3, 3, 48, 48).fill_(7) if kind != 'nchw tensor' else torch.full((3, 3, 48, 48), 7)
            batch = batch.to(torch.uint8)
            slots = batch.permute(0, 2, 3, 1)
            slot = slots.numpy()[1] if kind == 'numpy' else slots[1]
            assert crop(image, out=slot) is slot
            np.testing.assert_array_equal(np.asarray(slots[1]), expected)
            assert bool((batch[0] == 7).all()) and bool((batch[2] == 7).all())


@pytest.mark.parametrize(
    'out, message',
    [
        (np.zeros((48, 48), np.uint8), r'out must be a \(48, 48, 3\) uint8 slot, got .*\(48, 48\)'),
        (np.zeros((1, 48, 48, 3), np.uint8), r'out must be a \(48, 48, 3\) uint8 slot, got .*\(1, 48, 48, 3\)'),
        (np.zeros((49, 48, 3), np.uint8), r'out must be a \(48, 48, 3\) uint8 slot, got .*\(49, 48, 3\)'),
        (np.zeros((48, 48, 4), np.uint8), r'out must be a \(48, 48, 3\) uint8 slot, got .*\(48, 48, 4\)'),
        (np.zeros((48, 48, 3), np.float32), r'out must be a \(48, 48, 3\) uint8 slot, got .*float32'),
        (torch.zeros(48, 48, 3), r'out must be a \(48, 48, 3\) uint8 slot, got .*float32'),
    ],
)
def test_out_of_the_wrong_shape_or_dtype_is_named(out, message):
    with pytest.raises(ValueError, match=message):
        ResizeCenterCrop(48, 56)(np.zeros((60, 60, 3), np.uint8), out=out)


@pytest.mark.parametrize(
    'make, name',
    [
        (lambda: RandomResizedCropFlip(32, scale=(0.0, 1.0)), 'scale'),
        (lambda: RandomResizedCropFlip(32, scale=(0.5, 0.2)), 'scale'),
        (lambda: RandomResizedCropFlip(32, scale=(0.1, 1.5)), 'scale'),
        (lambda: RandomResizedCropFlip(32, scale=(0.5,)), 'scale'),
        (lambda: RandomResizedCropFlip(32, ratio=(0.0, 1.0)), 'ratio'),
        (lambda: RandomResizedCropFlip(32, ratio=(2.0, 1.0)), 'ratio'),
        (lambda: RandomResizedCropFlip(32, ratio=(0.5, 1.0, 2.0)), 'ratio'),
        (lambda: RandomResizedCropFlip(32, flip_probability=1.5), 'flip_probability'),
        (lambda: RandomResizedCropFlip(32, flip_probability=-0.1), 'flip_probability'),
        (lambda: RandomResizedCropFlip(32, flip_probability=float('nan')), 'flip_probability'),
        (lambda: RandomResizedCropFlip(0), 'size'),
        (lambda: ResizeCenterCrop(32, 0), 'resize_size'),
        (lambda: ResizeCenterCrop(32, 2.5), 'resize_size'),
        (lambda: ResizeCenterCrop(32, 31), 'resize_size'),
    ],
)
def test_bad_crop_arguments_are_named(make, name):
    with pytest.raises(ValueError, match=f'^{name} '):
        make()
