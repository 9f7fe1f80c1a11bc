"""Decoding special files as Pillow does (corrupt, truncated, CMYK, grey, progressive, extra
segments, trailing bytes, PNG modes), JPEG data that libjpeg reports corrupt refused where Pillow
would guess, corrupt files in a checked folder through every path with the NHWC crops and with
torchvision's PIL transforms, and the filled batches of ``__getitems__``."""

import contextlib
import gc
import io
import re
import warnings

import numpy as np
import pytest
import torch
from image_folders import image_tree
from PIL import Image
from test_hostile_data import corrupt_data_jpegs
from torch.utils.data import DataLoader, Subset, default_collate
from torchvision import transforms
from torchvision.datasets.folder import pil_loader

from channels_last_algo.app.data.batch import FilledBatch
from channels_last_algo.app.data.decode import CorruptDataError, EncodedImage
from channels_last_algo.app.data.image_folder import (
    CheckedImageFolder,
    CorruptImageError,
    CorruptImageWarning,
    scan_images,
)
from channels_last_algo.app.data.loaders import build_loader
from channels_last_algo.app.data.synthetic import SyntheticImageNet
from channels_last_algo.app.data.transforms import ToHWCUint8, eval_transform, train_transform


def pixels(height: int = 117, width: int = 150, seed: int = 0) -> np.ndarray:
    """(H, W, 3) uint8: three crossing gradients with noise, sides that are not multiples of 8 or 16."""
    rows, columns = np.mgrid[0:height, 0:width]
    gradients = np.stack([rows * 200 / height, columns * 200 / width, (rows + columns) * 100 / (height + width)], -1)
    noise = np.random.default_rng(seed).integers(-20, 20, (height, width, 3))
    return np.clip(gradients + noise, 0, 255).astype(np.uint8)


def saved(image: Image.Image, format: str = 'JPEG', **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **({'quality': 90} if format == 'JPEG' else {}) | options)
    return buffer.getvalue()


def segment(marker: int, payload: bytes) -> bytes:
    """A JPEG marker segment: 0xFF, the marker, a two-byte length, the payload."""
    return bytes((0xFF, marker)) + (len(payload) + 2).to_bytes(2, 'big') + payload


def special_files() -> dict[str, bytes]:
    """Encoded files by kind; the good ones first, then those Pillow cannot decode."""
    rgb = Image.fromarray(pixels())
    baseline = saved(rgb)
    progressive = saved(rgb, progressive=True)
    exif = Image.Exif()
    exif[0x010F] = 'Camera'
    with_segments = saved(rgb, exif=exif.tobytes(), icc_profile=bytes(300), comment=b'a comment')
    thumbnail = saved(Image.fromarray(pixels(8, 12, seed=1)))  # its own SOF, 8x12: the walk must skip it
    start_of_frame = with_segments.index(b'\xff\xc0')
    with_segments = (
        with_segments[:start_of_frame]
        + segment(0xED, b'Photoshop 3.0\x00' + thumbnail)
        + b'\xff\xff\xff'  # fill bytes before the SOF marker
        + with_segments[start_of_frame:]
    )
    scan = baseline.index(b'\xff\xda')
    scan_end = scan + 2 + int.from_bytes(baseline[scan + 2 : scan + 4], 'big')
    rng = np.random.default_rng(2)
    return {
        'baseline': baseline,
        'progressive': progressive,
        'grayscale': saved(rgb.convert('L')),
        'cmyk': saved(rgb.convert('CMYK')),
        'trailing bytes after EOI': baseline + b'trailing bytes' * 20,
        'EXIF, ICC, APP13 with a thumbnail, COM, fill bytes before SOF': with_segments,
        'png rgb': saved(rgb, 'PNG'),
        'png rgba': saved(rgb.convert('RGBA'), 'PNG'),
        'png palette': saved(rgb.convert('P'), 'PNG'),
        'png 16-bit grey': saved(Image.fromarray(pixels()[..., 0].astype(np.uint16) * 257), 'PNG'),
        'garbage bytes': rng.bytes(3000),
        'JPEG header, garbage scan data': baseline[:scan_end] + rng.bytes(4000) + b'\xff\xd9',
        'truncated baseline': baseline[: len(baseline) // 2],
        'truncated progressive': progressive[: len(progressive) // 2],
        'cut in the header': baseline[: baseline.index(b'\xff\xc0') - 10],
        'SOI only': baseline[:2],
    }


FILES = special_files()
CORRUPT_DATA = corrupt_data_jpegs(Image.fromarray(pixels()))
GOOD = [kind for kind in FILES if not kind.startswith(('garbage', 'JPEG header', 'truncated', 'cut', 'SOI'))]
BAD = [kind for kind in FILES if kind not in GOOD]
JPEGS = [kind for kind in FILES if not kind.startswith('png')]


def outcome(decode):
    """The pixels ``decode()`` gives as an (H, W, 3) array, or its error as (type, message) with
    object addresses left out (an in-memory file's repr differs from one open to the next)."""
    try:
        return np.asarray(decode())
    except Exception as error:  # the type and message are what is compared
        return type(error), re.sub(r' at 0x[0-9a-f]+', '', str(error))


def assert_same(ours, pillow):
    if isinstance(pillow, np.ndarray):
        assert isinstance(ours, np.ndarray), ours
        np.testing.assert_array_equal(ours, pillow)
    else:
        assert ours == pillow


def pillow_decode(data: bytes, shrink: int = 1) -> np.ndarray:
    """Pillow's own decoding, converted to RGB; at 1/``shrink`` scale through ``draft`` for a JPEG."""
    image = Image.open(io.BytesIO(data))
    if shrink > 1:
        image.draft('RGB', (image.width // shrink, image.height // shrink))
    return np.asarray(image.convert('RGB'))


# --- special files --------------------------------------------------------------------------------------


@pytest.mark.parametrize('kind', FILES)
def test_decodes_exactly_as_pillow_or_raises_its_error(kind):
    """Full scale: the same pixels as ``Image.open(..).convert('RGB')``, or the same exception
    type and message; the same size from the header."""
    data = FILES[kind]
    ours = outcome(lambda: EncodedImage(data).decode().permute(1, 2, 0))
    assert_same(ours, outcome(lambda: pillow_decode(data)))
    assert (kind in GOOD) == isinstance(ours, np.ndarray)
    if kind in GOOD:
        assert EncodedImage(data).size == ours.shape[:2]


@pytest.mark.parametrize('kind', JPEGS)
@pytest.mark.parametrize('shrink', [2, 4, 8])
def test_scaled_decode_is_pillows_draft(kind, shrink):
    """At 1/2, 1/4, 1/8 scale: Pillow's ``draft`` decoding exactly (or its error), ceil(side / shrink) a side."""
    data = FILES[kind]
    ours = outcome(lambda: EncodedImage(data).decode(shrink).permute(1, 2, 0))
    assert_same(ours, outcome(lambda: pillow_decode(data, shrink)))
    if isinstance(ours, np.ndarray):
        assert ours.shape == (-(-117 // shrink), -(-150 // shrink), 3)


@pytest.mark.parametrize('kind', FILES)
def test_header_walk_reads_the_size_pillow_reads(kind, monkeypatch):
    """Every JPEG whose header Pillow reads is sized from its SOF segment alone (extra segments, a
    thumbnail's SOF and fill bytes skipped), with Pillow's size; other files are left to Pillow,
    which sizes them or raises its own error."""
    data = FILES[kind]
    header = outcome(lambda: Image.open(io.BytesIO(data)).size[::-1])
    if kind in JPEGS and isinstance(header, np.ndarray):
        monkeypatch.setattr(Image, 'open', lambda *args, **kwargs: pytest.fail('the header walk asked Pillow'))
    assert_same(outcome(lambda: EncodedImage(data).size), header)


def test_each_full_size_decoder_equals_pillow_on_what_it_takes():
    """Each fast decoder installed here, on every JPEG whose component count it claims: Pillow's pixels
    exactly; on a corrupt or truncated one, a RuntimeError or ValueError (Pillow then decides) or
    CorruptDataError (libjpeg's report of corrupt data: no other decoder is tried)."""
    from channels_last_algo.app.data.decode import FULL_SIZE_DECODERS

    assert FULL_SIZE_DECODERS, 'no fast decoder installed: simplejpeg or torchvision.io.decode_jpeg'
    for name, decode, components in FULL_SIZE_DECODERS:
        for kind in JPEGS:
            try:
                bands = len(Image.open(io.BytesIO(FILES[kind])).getbands())
            except OSError:
                continue  # no header: never reaches a fast decoder
            if bands not in components:
                continue
            ours = outcome(lambda decode=decode, data=FILES[kind]: decode(data).permute(1, 2, 0))
            if kind in GOOD:
                np.testing.assert_array_equal(ours, pillow_decode(FILES[kind]), err_msg=f'{name} on {kind}')
            else:
                assert isinstance(ours, tuple), (name, kind, ours)
                assert issubclass(ours[0], (RuntimeError, ValueError, CorruptDataError)), (name, kind, ours)


@pytest.mark.parametrize('shrink', [1, 2, 4, 8])
@pytest.mark.parametrize('kind', CORRUPT_DATA)
def test_data_libjpeg_reports_corrupt_is_refused_where_pillow_guesses(kind, shrink, monkeypatch):
    """Pillow (and so ImageFolder) decodes these files to guessed pixels without a word; here the
    strict decoder's report stops the decode at every scale, and no fallback decodes it after."""
    pytest.importorskip('simplejpeg')
    data = CORRUPT_DATA[kind]
    assert pillow_decode(data, shrink).shape[:2] == tuple(-(-side // shrink) for side in (117, 150))
    with pytest.raises(CorruptDataError, match=r'^Corrupt JPEG data: .* \(libjpeg-turbo, through simplejpeg\)$'):
        EncodedImage(data).decode(shrink)
    monkeypatch.setattr(
        'channels_last_algo.app.data.decode.decode_jpeg', lambda *args, **kwargs: pytest.fail('a fallback')
    )
    with pytest.raises(CorruptDataError):
        EncodedImage(data).decode(shrink)


def test_pixels_of_another_size_than_the_header_declares_are_refused():
    """The crop is planned from the header: pixels of another size would be cropped wrong, so they are refused."""
    image = EncodedImage(FILES['png rgb'])
    image.size = (100, 120)
    with pytest.raises(CorruptDataError, match=r'^its header declares 120 x 100 pixels at 1/1 scale, but its data '):
        image.decode()


@pytest.mark.parametrize('shrink', [1, 2, 4, 8])
@pytest.mark.parametrize('kind', ['baseline', 'progressive', 'grayscale'])
def test_a_good_jpeg_is_decoded_once_without_pillow(kind, shrink, monkeypatch):
    """The strict check costs nothing on a good file: one simplejpeg decode at the planned scale,
    Pillow never opened."""
    simplejpeg = pytest.importorskip('simplejpeg')
    calls = []
    decode = simplejpeg.decode_jpeg
    monkeypatch.setattr(simplejpeg, 'decode_jpeg', lambda *args, **kwargs: calls.append(1) or decode(*args, **kwargs))
    monkeypatch.setattr(Image, 'open', lambda *args, **kwargs: pytest.fail('Pillow opened a good JPEG'))
    image = EncodedImage(FILES[kind])
    assert image.decode(shrink).shape == (3, -(-117 // shrink), -(-150 // shrink)) and calls == [1]


# --- special but good files in a folder ------------------------------------------------------------------


def animated_gif() -> bytes:
    frames = [Image.fromarray(pixels(40, 50, seed)).convert('P') for seed in range(3)]
    return saved(frames[0], 'GIF', save_all=True, append_images=frames[1:])


RGB = Image.fromarray(pixels(40, 50))
GOOD_FILES = {
    '16-bit grey PNG': ('x.png', saved(Image.fromarray(np.arange(2000, dtype=np.uint16).reshape(40, 50) * 30), 'PNG')),
    'palette PNG with a transparent colour': ('x.png', saved(RGB.convert('P'), 'PNG', transparency=0)),
    'grey PNG with alpha (LA)': ('x.png', saved(RGB.convert('LA'), 'PNG')),
    '1-bit PNG': ('x.png', saved(RGB.convert('1'), 'PNG')),
    'CMYK JPEG': ('x.jpg', saved(RGB.convert('CMYK'))),
    'animated GIF named .jpg (its first frame)': ('x.jpg', animated_gif()),
    '1 x 1 PNG, smaller than the crop': ('x.png', saved(Image.fromarray(pixels(1, 1)), 'PNG')),
    '1 x 1 JPEG, smaller than the crop': ('x.jpg', saved(Image.fromarray(pixels(1, 1)))),
    '3 x 500 JPEG (extreme aspect)': ('x.jpg', saved(Image.fromarray(pixels(500, 3)))),
    '2000 x 2 PNG (extreme aspect)': ('x.png', saved(Image.fromarray(pixels(2, 2000)), 'PNG')),
    'PNG named .jpg': ('x.jpg', saved(RGB, 'PNG')),
    'float TIFF': ('x.tif', saved(RGB.convert('F'), 'TIFF')),
    'WebP': ('x.webp', saved(RGB, 'WEBP')),
}


@pytest.mark.parametrize('case', GOOD_FILES)
def test_special_but_good_image_in_a_folder_is_decoded_as_imagefolder_loads_it(tmp_path, case):
    """Read from its content, not its extension: the pixels of torchvision's loader (Pillow's
    ``convert('RGB')``), nothing reported by the pre-flight scan, both crops made, its own label."""
    root = image_tree(tmp_path / 'data', per_class=2, splits=('train',)) / 'train'
    name, data = GOOD_FILES[case]
    (root / 'cat' / name).write_bytes(data)
    decoded = EncodedImage.read(root / 'cat' / name).decode().permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(decoded, np.asarray(pil_loader(root / 'cat' / name)))
    for transform in (eval_transform(32, 36), train_transform(32)):
        data_set = CheckedImageFolder(root, transform)
        assert scan_images(data_set) == []
        image, label = data_set[2]
        assert image.shape == (32, 32, 3) and label == 0


# --- corrupt files in a checked folder -------------------------------------------------------------------

NHWC_CROP = eval_transform(32, 36)
PIL_CROP = transforms.Compose([transforms.Resize(36), transforms.CenterCrop(32), ToHWCUint8()])


@pytest.fixture
def folder_with(tmp_path):
    """A folder of 6 good JPEGs and two files of the given bad kind: cat/1_bad.jpg (sample 2) and
    dog/9_bad.jpg (sample 7, the last: skipping it wraps round to sample 0)."""

    def make(kind):
        root = image_tree(tmp_path / 'data', per_class=3, splits=('train',)) / 'train'
        (root / 'cat' / '1_bad.jpg').write_bytes(FILES[kind])
        (root / 'dog' / '9_bad.jpg').write_bytes(FILES[kind])
        return root

    return make


@contextlib.contextmanager
def warnings_logged(log):
    """Every warning shown inside, in this process or a DataLoader worker forked from it, appended
    to the file ``log`` as a '<category>: <message>' line (a worker's own records never reach pytest)."""

    def show(message, category, filename, lineno, file=None, line=None):
        with open(log, 'a') as out:
            out.write(f'{category.__name__}: {message}\n')

    with warnings.catch_warnings():
        warnings.simplefilter('always')
        warnings.showwarning = show
        yield


def fetch(data, how):
    """Every sample of ``data`` as ((N, H, W, 3) uint8 array, labels): one by one through
    ``__getitem__`` (``how='getitem'``), or in batches of 3 from build_loader (``'loader-<workers>'``)."""
    if how == 'getitem':
        samples = [data[index] for index in range(len(data))]
        return np.stack([np.asarray(image) for image, _ in samples]), [label for _, label in samples]
    batches = list(build_loader(data, batch_size=3, train=False, workers=int(how.split('-')[1])))
    assert [len(labels) for _, labels in batches] == [3, 3, 2]  # a skipped file keeps its batch full
    images = torch.cat([images for images, _ in batches]).permute(0, 2, 3, 1).numpy()
    return images, torch.cat([labels for _, labels in batches]).tolist()


def error_of(data, how):
    """The CorruptImageError message ``fetch`` ends with (from the traceback a worker's error arrives in)."""
    try:
        fetch(data, how)
    except CorruptImageError as error:
        message = str(error).strip().splitlines()[-1]
    else:
        pytest.fail(f'no CorruptImageError through {how}')
    gc.collect()  # the failed loader's workers are shut down now, while quick_worker_shutdown holds
    return re.sub(r'^[\w.]*CorruptImageError: ', '', message)


@pytest.fixture
def quick_worker_shutdown(monkeypatch):
    """After a worker has raised, a DataLoader iterator's shutdown waits torch's status interval
    (5 s) for each worker before it terminates it: 0.2 s here."""
    monkeypatch.setattr(torch.utils.data._utils, 'MP_STATUS_CHECK_INTERVAL', 0.2)


HOWS = ['getitem', 'loader-0', 'loader-2']
# Each kind of damage in the main process, and once through workers: how a worker's error or warning reaches
# the main process does not depend on the damage, and each worker pool costs more than a second to start.
BAD_HOWS = [(kind, how) for kind in BAD for how in HOWS if how != 'loader-2' or kind == BAD[0]]


@pytest.mark.parametrize(('kind', 'how'), BAD_HOWS)
def test_corrupt_file_raises_naming_it_as_with_pil_transforms(folder_with, quick_worker_shutdown, kind, how):
    """on_corrupt='raise': CorruptImageError naming the first bad file, word for word the error a
    torchvision PIL transform gives on the same folder."""
    root = folder_with(kind)
    ours = error_of(CheckedImageFolder(root, NHWC_CROP), how)
    assert ours.startswith(f'cannot decode image {root / "cat" / "1_bad.jpg"}: ')
    assert ours.endswith("Replace or delete the file, or pass on_corrupt='skip' to skip corrupt files.")
    assert ours == error_of(CheckedImageFolder(root, PIL_CROP), how)


@pytest.mark.parametrize(('kind', 'how'), BAD_HOWS)
def test_corrupt_file_is_skipped_with_the_next_image_as_with_pil_transforms(folder_with, tmp_path, kind, how):
    """on_corrupt='skip': one CorruptImageWarning per bad file, worded as with a torchvision PIL
    transform; its sample is the next decodable image with that image's label (the last wraps to
    the first), so every batch keeps its size; no other warning (no decoder deprecation) shows."""
    root = folder_with(kind)
    results = {}
    for name, transform in (('nhwc', NHWC_CROP), ('pil', PIL_CROP)):
        log = tmp_path / f'{name}.log'
        log.touch()
        data = CheckedImageFolder(root, transform, on_corrupt='skip')
        with warnings_logged(log):
            images, labels = fetch(data, how)
        results[name] = images, labels, sorted(log.read_text().splitlines())
    images, labels, shown = results['nhwc']
    bad = [root / 'cat' / '1_bad.jpg', root / 'dog' / '9_bad.jpg']
    assert [line.split(':')[0] for line in shown] == ['CorruptImageWarning'] * 2
    assert all(f'skipping corrupt image {path}: ' in '\n'.join(shown) for path in bad)
    assert shown == results['pil'][2]
    assert labels == [0, 0, 0, 0, 1, 1, 1, 0] == results['pil'][1]
    good = CheckedImageFolder(root, NHWC_CROP)
    for index, replacement in {2: 3, 7: 0}.items():
        np.testing.assert_array_equal(images[index], good[replacement][0])
    assert np.abs(images.astype(int) - results['pil'][0]).max() <= 1


def test_no_decoder_warning_reaches_the_user(tmp_path):
    """torchvision 0.29 warns DeprecationWarning at every call of its image decoders: with every
    warning shown, a folder of baseline, grey, CMYK and progressive JPEGs loads through every path
    without one, in this process and in DataLoader workers."""
    root = tmp_path / 'data'
    for label in ('a', 'b'):
        (root / label).mkdir(parents=True)
        for kind in ('baseline', 'grayscale', 'cmyk', 'progressive'):
            (root / label / f'{kind}.jpg').write_bytes(FILES[kind])
    log = tmp_path / 'warnings.log'
    log.touch()
    with warnings_logged(log):
        for how in HOWS:
            fetch(CheckedImageFolder(root, NHWC_CROP), how)
    assert log.read_text() == ''


@pytest.mark.parametrize('kind', BAD)
def test_training_crops_report_corrupt_files_as_pil_transforms_do(folder_with, kind):
    """The training crop decodes at reduced scale (1/2 to 1/8 here): a bad file still raises the
    error torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` on PIL images raises, and
    is skipped with the same warning and label."""
    root = folder_with(kind)
    pil_crop = transforms.Compose([transforms.RandomResizedCrop(12), transforms.RandomHorizontalFlip(), ToHWCUint8()])
    messages, skipped = [], []
    for transform in (train_transform(12), pil_crop):
        with pytest.raises(CorruptImageError) as caught:
            CheckedImageFolder(root, transform)[2]
        messages.append(str(caught.value))
        with pytest.warns(CorruptImageWarning) as shown:
            image, label = CheckedImageFolder(root, transform, on_corrupt='skip')[7]
        skipped.append(([str(warning.message) for warning in shown], label, image.shape))
    assert messages[0] == messages[1] and messages[0].startswith(f'cannot decode image {root / "cat" / "1_bad.jpg"}: ')
    assert skipped[0] == skipped[1] and skipped[0][1:] == (0, (12, 12, 3))


# --- filled batches ------------------------------------------------------------------------------------------


@pytest.fixture
def sources(tmp_path):
    """name -> data set factory(transform): a checked folder of 8 JPEGs, a synthetic set of 10."""
    root = image_tree(tmp_path / 'data', per_class=4, splits=('train',)) / 'train'
    return {
        'folder': lambda transform: CheckedImageFolder(root, transform),
        'synthetic': lambda transform: SyntheticImageNet(10, num_classes=3, image_size=(40, 52), transform=transform),
    }


def per_sample(data, indices):
    """``data[i]`` for each index, stacked as ((N, H, W, 3) array, labels)."""
    samples = [data[index] for index in indices]
    return np.stack([np.asarray(image) for image, _ in samples]), [label for _, label in samples]


def loaded(loader):
    batches = list(loader)
    for images, _ in batches:
        assert images.dtype == torch.uint8 and images.is_contiguous(memory_format=torch.channels_last)
    return torch.cat([images for images, _ in batches]).permute(0, 2, 3, 1).numpy(), [
        label for _, labels in batches for label in labels.tolist()
    ]


@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('source', ['folder', 'synthetic'])
def test_loader_batches_equal_the_per_sample_path(sources, source, workers):
    """build_loader's batches (filled in place by ``__getitems__``) equal ``data[i]`` for each i bit for
    bit: evaluation crops in workers 0 and 2, training crops (same seed) in the main process."""
    data = sources[source](eval_transform(32, 36))
    assert isinstance(data.__getitems__([0, 1]), FilledBatch)
    images, labels = loaded(build_loader(data, batch_size=3, train=False, workers=workers))
    expected_images, expected_labels = per_sample(data, range(len(data)))
    np.testing.assert_array_equal(images, expected_images)
    assert labels == expected_labels
    if workers == 0:  # the loader draws nothing from the global generator in evaluation order
        data = sources[source](train_transform(32))
        torch.manual_seed(5)
        images, labels = loaded(build_loader(data, batch_size=3, train=False))
        torch.manual_seed(5)
        expected_images, expected_labels = per_sample(data, range(len(data)))
        np.testing.assert_array_equal(images, expected_images)
        assert labels == expected_labels


@pytest.mark.parametrize('source', ['folder', 'synthetic'])
def test_filled_batch_still_collates_with_default_collate(sources, source):
    """``__getitems__``'s FilledBatch holds (HWC array, label) pairs over the batch: default_collate
    gives (N, H, W, 3) images and the labels, directly and in a plain DataLoader with 2 workers."""
    data = sources[source](eval_transform(32, 36))
    batch = data.__getitems__([4, 1, 2])
    assert isinstance(batch, FilledBatch) and len(batch) == 3
    images, labels = default_collate(batch)
    expected_images, expected_labels = per_sample(data, [4, 1, 2])
    assert images.shape == (3, 32, 32, 3) and images.dtype == torch.uint8
    np.testing.assert_array_equal(images.numpy(), expected_images)
    np.testing.assert_array_equal(batch.images.permute(0, 2, 3, 1).numpy(), expected_images)
    assert labels.tolist() == expected_labels
    (images, labels), *_ = DataLoader(data, batch_size=4, num_workers=2)
    assert images.shape == (4, 32, 32, 3)
    np.testing.assert_array_equal(images.numpy(), per_sample(data, range(4))[0])


@pytest.mark.parametrize('source', ['folder', 'synthetic'])
def test_subset_of_the_data_set_loads_with_build_loader(sources, source):
    """A torch Subset passes whole batches on to ``__getitems__``: the loader's batches are the
    chosen samples, in order, bit for bit."""
    data = sources[source](eval_transform(32, 36))
    subset = Subset(data, [5, 2, 7, 0, 3])
    assert isinstance(subset.__getitems__([0, 1]), FilledBatch)
    images, labels = loaded(build_loader(subset, batch_size=2, train=False))
    expected_images, expected_labels = per_sample(data, [5, 2, 7, 0, 3])
    np.testing.assert_array_equal(images, expected_images)
    assert labels == expected_labels
