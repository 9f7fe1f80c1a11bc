"""Hostile image files and data folders: each is refused in one line that names the file or folder
and the fix, or skipped and reported under ``on_corrupt='skip'``; never trained on silently,
never a traceback (special but good files: tests/app/test_decode.py).

Folder problems are DataPathError before any image is read (``RecipeError``, exit 2, in the CLI);
file problems are found by the pre-flight scan (``--check-data``) and, in training, raise
CorruptImageError naming the file or are skipped with a CorruptImageWarning and the next image
in their slot. Decompression bombs, pipes and files over the size limit run in one subprocess
under a memory limit; the CLI cases need Composer.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from image_folders import COLOURS, image_tree
from PIL import Image
from recipe_runs import RECIPE, TINY, sets
from torchvision import transforms

from channels_last_algo.app.data.decode import MAX_FILE_BYTES, EncodedImage
from channels_last_algo.app.data.image_folder import (
    CheckedImageFolder,
    CorruptImageError,
    CorruptImageWarning,
    DataPathError,
    printable,
    scan_images,
)
from channels_last_algo.app.data.imagenet import imagenet_dataset
from channels_last_algo.app.data.transforms import ToHWCUint8, eval_transform

FIX = "Replace or delete the file, or pass on_corrupt='skip' to skip corrupt files."
AS_ROOT = os.geteuid() == 0  # root reads a file whatever its permissions

# --- hostile bytes ---------------------------------------------------------------------------------------


def encoded(image: Image.Image, format: str = 'JPEG', **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    return buffer.getvalue()


def photo(width: int = 50, height: int = 40, seed: int = 0) -> Image.Image:
    """An RGB image of noise over a red tint, so that every decoder has real work to do."""
    noise = np.random.default_rng(seed).integers(-60, 60, size=(height, width, 3))
    return Image.fromarray(np.clip(np.array(COLOURS['cat']) + noise, 0, 255).astype(np.uint8))


def _scan_start(data: bytes) -> int:
    scan = data.index(b'\xff\xda')
    return scan + 2 + int.from_bytes(data[scan + 2 : scan + 4], 'big')


def corrupt_data_jpegs(image: Image.Image) -> dict[str, bytes]:
    """JPEGs of ``image`` whose scan data libjpeg reports corrupt (a warning) but Pillow, and so
    ImageFolder, decodes to guessed pixels without a word."""

    def marker_inside(data):  # an RST marker in the middle of a scan that has none
        middle = (_scan_start(data) + len(data) - 2) // 2
        return data[:middle] + b'\xff\xd0' + data[middle:]

    def scan_replaced(data):  # the scans replaced by bytes without markers, up to the EOI
        noise = np.random.default_rng(3).bytes(len(data) - 2 - _scan_start(data))
        return data[: _scan_start(data)] + bytes(min(byte, 0xFE) for byte in noise) + data[-2:]

    baseline, progressive = encoded(image, quality=90), encoded(image, quality=90, progressive=True)
    return {
        'premature end of data segment': marker_inside(baseline),
        'extraneous bytes before EOI': scan_replaced(baseline),
        'bad Huffman code (progressive)': scan_replaced(progressive),
        'grey, premature end of data segment': marker_inside(encoded(image.convert('L'), quality=90)),
    }


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return len(payload).to_bytes(4, 'big') + kind + payload + zlib.crc32(kind + payload).to_bytes(4, 'big')


def png_declaring(width: int, height: int) -> bytes:
    """A small valid-looking PNG (checksums right) whose header declares ``width`` x ``height`` RGB pixels."""
    header = width.to_bytes(4, 'big') + height.to_bytes(4, 'big') + bytes((8, 2, 0, 0, 0))
    rows = zlib.compress(bytes(1 + 3 * min(width, 64)) * 4)
    return b'\x89PNG\r\n\x1a\n' + png_chunk(b'IHDR', header) + png_chunk(b'IDAT', rows) + png_chunk(b'IEND', b'')


def jpeg_declaring(width: int, height: int) -> bytes:
    """A small real JPEG whose start-of-frame segment is made to declare ``width`` x ``height``."""
    data = bytearray(encoded(photo()))
    frame = data.index(b'\xff\xc0')
    data[frame + 5 : frame + 9] = height.to_bytes(2, 'big') + width.to_bytes(2, 'big')
    return bytes(data)


def patched(data: bytes, offset: int, *values: int, size: int) -> bytes:
    """``data`` with little-endian integers of ``size`` bytes written from ``offset`` on."""
    fields = b''.join(value.to_bytes(size, 'little') for value in values)
    return data[:offset] + fields + data[offset + len(fields) :]


def write(data: bytes):
    return lambda path: path.write_bytes(data)


def unreadable(path: Path) -> None:
    path.write_bytes(encoded(photo()))
    path.chmod(0)


def sparse_file_over_the_limit(path: Path) -> None:
    with open(path, 'wb') as file:
        file.truncate(MAX_FILE_BYTES + 1)


CORRUPT_DATA = corrupt_data_jpegs(photo())
JPEG = encoded(photo())
PNG = encoded(photo(), 'PNG')

# name -> (file name in cat/, make(path), the fragment every report of it holds); each is the last
# file of cat/, so a skip puts dog/0.jpg (label 1) in its slot
FILE_CASES = {
    'empty file': ('x.jpg', write(b''), 'the file is empty (0 bytes)'),
    'text named .jpg': ('x.jpg', write(b'this is not an image'), 'cannot identify image file'),
    'random bytes named .png': ('x.png', write(np.random.default_rng(1).bytes(900)), 'cannot identify image file'),
    'HTML error page named .jpeg': ('x.jpeg', write(b'<html><body>404</body></html>'), 'cannot identify image'),
    'truncated JPEG': ('x.jpg', write(JPEG[: len(JPEG) // 2]), 'image file is truncated'),
    'truncated PNG': ('x.png', write(PNG[: len(PNG) // 2]), 'image file is truncated'),
    'JPEG cut in its header': ('x.jpg', write(JPEG[:30]), 'Truncated File Read'),
    'PNG with a broken IDAT stream': ('x.png', write(PNG[:60] + bytes(40) + PNG[100:]), 'broken data stream'),
    'PPM with a bad maxval (a ValueError in Pillow)': ('x.ppm', write(b'P6\n50 40\n-3\n' + bytes(6000)), 'maxval'),
    **{f'JPEG, {kind}': ('x.jpg', write(data), 'Corrupt JPEG data: ') for kind, data in CORRUPT_DATA.items()},
    'link to a missing file': ('x.jpg', lambda path: path.symlink_to('missing.jpg'), 'No such file or directory'),
    'link to itself': ('x.jpg', lambda path: path.symlink_to('x.jpg'), 'Too many levels of symbolic links'),
    'unreadable file': ('x.jpg', unreadable, 'Permission denied'),
    'line break in the name': ('x\ny.jpg', write(b'broken'), 'cannot identify image file'),
    'name that is not UTF-8': (os.fsdecode(b'x\xff.jpg'), write(b'broken'), 'cannot identify image file'),
}
EXTREME_ASPECT = 'PNG of 6000000 x 1 pixels (the eval resize would make 216000000 x 36)'
# cases that would block or take gigabytes if the checks failed: run in a subprocess under a memory limit
UNSAFE_CASES = {
    'PNG declaring 100000 x 100000 pixels': ('x.png', write(png_declaring(100_000, 100_000)), 'decompression'),
    'JPEG declaring 65535 x 65535 pixels': (
        'x.jpg',
        write(jpeg_declaring(65535, 65535)),
        'its header declares 65535 x 65535 pixels (width x height), more than MAX_IMAGE_PIXELS',
    ),
    'JPEG declaring 20000 x 9000 pixels': ('x.jpg', write(jpeg_declaring(20000, 9000)), 'decompression-bomb limit'),
    'GIF named .jpg declaring 65535 x 65535 pixels': (
        'x.jpg',
        write(patched(encoded(photo().convert('P'), 'GIF'), 6, 65535, 65535, size=2)),
        'decompression',
    ),
    'BMP declaring 60000 x 60000 pixels': (
        'x.bmp',
        write(patched(encoded(photo(), 'BMP'), 18, 60000, 60000, size=4)),
        'decompression',
    ),
    EXTREME_ASPECT: (
        'x.png',
        lambda path: Image.new('RGB', (6_000_000, 1), (200, 40, 40)).save(path),
        'its crop would resize its 6000000 x 1 pixels to 216000000 x 36 pixels',
    ),
    'named pipe': ('x.jpg', os.mkfifo, 'it is a pipe, socket or device, not a regular file'),
    'link to /dev/zero': ('x.jpg', lambda path: path.symlink_to('/dev/zero'), 'not a regular file'),
    'sparse file over MAX_FILE_BYTES': ('x.jpg', sparse_file_over_the_limit, 'more than MAX_FILE_BYTES'),
}


NHWC_CROP = eval_transform(32, 36)
PIL_CROP = transforms.Compose([transforms.Resize(36), transforms.CenterCrop(32), ToHWCUint8()])
# what the PIL-transform path decodes as ImageFolder does: corrupt JPEG data without a word (only
# the strict decoder reports it), the extreme aspect into gigabytes (torchvision's Resize)
NHWC_ONLY = {*(case for case in FILE_CASES if case.startswith('JPEG, ')), EXTREME_ASPECT}

# --- outcomes --------------------------------------------------------------------------------------------


def outcome_of(split: Path, path: Path, case: str) -> dict:
    """What the scan, a raising folder and a skipping folder (evaluation crops) make of ``path``,
    the third sample of ``split``, and a raising folder with torchvision's PIL transforms unless
    ``case`` is NHWC_ONLY: JSON-able, so a subprocess can report it too."""

    def folder(on_corrupt, transform=NHWC_CROP):
        return CheckedImageFolder(split, transform, on_corrupt=on_corrupt)

    assert [sample for sample, _ in folder('raise').samples].index(str(path)) == 2
    result = {'scan': scan_images(folder('raise'))}
    raising = {
        'raise': NHWC_CROP,
        **({} if case in NHWC_ONLY else {'raise with PIL transforms': PIL_CROP}),
    }
    for key, transform in raising.items():
        try:
            folder('raise', transform)[2]
            result[key] = 'no CorruptImageError'
        except CorruptImageError as error:
            result[key] = str(error)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter('always')
        image, result['label'] = folder('skip')[2]
    result['skip'] = [f'{warning.category.__name__}: {warning.message}' for warning in shown]
    result['replaced by the next image'] = bool(np.array_equal(image, folder('raise')[3][0]))
    return result


def assert_refused(result: dict, path: Path, fragment: str) -> None:
    """Scanned, raised and skipped, each in one line that names ``path`` (shown by printable) and holds ``fragment``."""
    ((found, problem),) = result['scan']
    assert found == str(path) and fragment in problem and '\n' not in problem, problem
    message = result['raise']
    assert message.startswith(f'cannot decode image {printable(path)}: ') and fragment in message, message
    assert message.endswith(FIX) and '\n' not in message, message
    if 'raise with PIL transforms' in result:  # Pillow's own words, or this path's where Pillow has none
        message = result['raise with PIL transforms']
        assert message.startswith(f'cannot decode image {printable(path)}: ') and message.endswith(FIX), message
        assert '\n' not in message
    (skipped,) = result['skip']
    assert (
        skipped.startswith(f'CorruptImageWarning: skipping corrupt image {printable(path)}: ') and fragment in skipped
    )
    assert result['label'] == 1 and result['replaced by the next image']


@pytest.fixture
def split(tmp_path) -> Path:
    """train/ of a tree of cat/0.jpg, cat/1.jpg, dog/0.jpg, dog/1.jpg (and val/ alike)."""
    return image_tree(tmp_path / 'data', per_class=2) / 'train'


@pytest.mark.parametrize('case', FILE_CASES)
def test_hostile_file_is_refused_naming_it_or_skipped_and_reported(split, case):
    name, make, fragment = FILE_CASES[case]
    if case.startswith('JPEG, '):
        pytest.importorskip('simplejpeg', reason='corrupt JPEG data is reported by the strict decoder, simplejpeg')
    if case == 'unreadable file' and AS_ROOT:
        pytest.skip('root reads a file whatever its permissions')
    path = split / 'cat' / name
    make(path)
    assert_refused(outcome_of(split, path, case), path, fragment)


def report_unsafe_cases(folder: str) -> None:
    """In a subprocess: make each unsafe case in its own tree under ``folder`` and print the
    outcomes as JSON, under an address-space limit 2 GiB above what the imports took."""
    import resource

    status = Path('/proc/self/status').read_text()
    used = int(re.search(r'VmSize:\s+(\d+) kB', status).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), used + (2 << 30)))
    results = {}
    for index, (case, (name, make, _)) in enumerate(UNSAFE_CASES.items()):
        split = image_tree(Path(folder) / str(index), per_class=2, splits=('train',)) / 'train'
        make(split / 'cat' / name)
        results[case] = outcome_of(split, split / 'cat' / name, case)
    print(json.dumps(results))


@pytest.fixture(scope='module')
def unsafe_outcomes(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp('unsafe')
    tests = str(Path(__file__).parent)
    code = '\n'.join(
        [
            'import sys',
            f'sys.path[:0] = [{tests!r}]',
            'import test_hostile_data as cases',
            f'cases.report_unsafe_cases({str(folder)!r})',
        ]
    )
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return folder, json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('case', UNSAFE_CASES)
def test_bomb_pipe_or_huge_file_is_refused_before_it_is_decoded(unsafe_outcomes, case):
    """Checked from the header, the crop plan or the file's kind and size, before a byte of pixels
    is allocated: within 2 GiB, with no hang."""
    folder, results = unsafe_outcomes
    name, _, fragment = UNSAFE_CASES[case]
    path = folder / str(list(UNSAFE_CASES).index(case)) / 'train' / 'cat' / name
    assert_refused(results[case], path, fragment)


# --- hostile folders: DataPathError before any image is read ------------------------------------------------


def rename(root: Path, old: str, new: str, splits=('train', 'val')) -> None:
    for split in splits:
        (root / split / old).rename(root / split / new)


def add_class(root: Path, name: str, file_name: str = '0.jpg') -> None:
    """A class folder ``name`` in both splits, holding one file ``file_name`` (a JPEG), or none for ''."""
    for split in ('train', 'val'):
        (root / split / name).mkdir()
        if file_name:
            (root / split / name / file_name).write_bytes(JPEG)


def chmod_class(root: Path) -> None:
    (root / 'train' / 'cat').chmod(0)


NFC, NFD = 'caf\u00e9', 'cafe\u0301'
# name -> (make(root), fragments of the message, '{root}' standing for the data path)
FOLDER_CASES = {
    'class names in NFC in train/ and NFD in val/': (
        lambda root: (rename(root, 'cat', NFC, ('train',)), rename(root, 'cat', NFD, ('val',))),
        [
            '{root}/train and {root}/val spell a class folder name in different Unicode normalisations '
            "('caf\\xe9' in train/; 'cafe\\u0301' in val/)",
            'Rename one to the other spelling',
        ],
    ),
    'two class folders that differ only in Unicode normalisation': (
        lambda root: (rename(root, 'cat', NFC), rename(root, 'dog', NFD)),
        [
            'image folder {root}/train holds class folders whose names differ only in Unicode normalisation: '
            "'cafe\\u0301', 'caf\\xe9'",
            'Merge them into one folder',
        ],
    ),
    'an image outside the class folders': (
        lambda root: (root / 'train' / 'stray.JPEG').write_bytes(JPEG),
        [
            '{root}/train holds 1 image file(s) outside its class folders (stray.JPEG)',
            'move each into its class folder',
        ],
    ),
    'a class folder link to a missing folder': (
        lambda root: (root / 'train' / 'bird').symlink_to(root / 'unmounted' / 'bird'),
        ['{root}/train/bird is a link to {root}/unmounted/bird, which does not exist or loops', 'remove the link'],
    ),
    'a class folder link to itself': (
        lambda root: (root / 'train' / 'bird').symlink_to('bird'),
        ['{root}/train/bird is a link to bird, which does not exist or loops', 'remove the link'],
    ),
    'val/ a link to train/': (
        lambda root: (os.rename(root / 'val', root / 'old_val'), (root / 'val').symlink_to('train')),
        ['{root}/train and {root}/val are the same folder', 'give val/ images of its own'],
    ),
    'a class folder that is a file in val/': (
        lambda root: (rename(root, 'dog', 'dog_folder', ('val',)), (root / 'val' / 'dog').write_bytes(JPEG)),
        ["only in train/: ['dog']; only in val/: ['dog_folder']", 'Give both splits the same class folders'],
    ),
    'train/ is a file': (
        lambda root: (os.rename(root / 'train', root / 'old'), (root / 'train').write_bytes(b'')),
        ['ImageNet data path {root}: train/ is a file, not a folder', 'expected {root}/train/<class>/<image>'],
    ),
    'the data path a link to itself': (
        lambda root: (os.rename(root, root.with_name('old')), root.symlink_to(root.name)),
        ['cannot look at {root}: Too many levels of symbolic links', 'fix the path or its permissions'],
    ),
    'no train/': (
        lambda root: os.rename(root / 'train', root / 'training'),
        ['ImageNet data path {root} has no train/ folder', 'expected {root}/train/<class>/<image>'],
    ),
    'an empty class folder in both splits': (
        lambda root: add_class(root, 'bird', ''),
        ['1 class folder(s) under {root}/train hold no images', '{root}/train/bird. Add images or remove the folders'],
    ),
    'a class of files that are not images by extension': (
        lambda root: add_class(root, 'bird', 'x.heic'),
        ['{root}/train hold no images (extensions: .jpg', '{root}/train/bird. Add images or remove the folders'],
    ),
    'a notebook checkpoint folder in train/ only': (
        lambda root: (root / 'train' / '.ipynb_checkpoints').mkdir(),
        ["only in train/: ['.ipynb_checkpoints']", 'Give both splits the same class folders'],
    ),
    'a class name with a line break': (
        lambda root: rename(root, 'dog', 'do\ng', ('train',)),
        ["only in train/: ['do\\ng']", 'Give both splits the same class folders'],
    ),
    'a class name that is not UTF-8': (
        lambda root: rename(root, 'dog', os.fsdecode(b'do\xffg'), ('train',)),
        ["only in train/: ['do\\udcffg']", 'Give both splits the same class folders'],
    ),
    'a directory link that loops inside a class': (
        lambda root: (root / 'train' / 'cat' / 'loop').symlink_to('..'),
        ['{root}/train/cat/loop/cat is the folder {root}/train/cat again', 'remove the link'],
    ),
    'more class folders than num_classes': (
        lambda root: add_class(root, 'bird'),
        ['{root}/train holds 3 class folders but num_classes is 2', 'set num_classes to the folder count'],
    ),
    'an unreadable class folder': (
        chmod_class,
        ['cannot list the folder {root}/train/cat: Permission denied', 'make it readable, or remove it'],
    ),
}


@pytest.mark.parametrize('case', FOLDER_CASES)
def test_hostile_folder_is_refused_in_one_line_before_any_image_is_read(tmp_path, monkeypatch, case):
    make, fragments = FOLDER_CASES[case]
    if case == 'an unreadable class folder' and AS_ROOT:
        pytest.skip('root lists a folder whatever its permissions')
    root = image_tree(tmp_path / 'data', per_class=2)
    make(root)
    monkeypatch.setattr(EncodedImage, 'read', lambda path: pytest.fail(f'{path} was read'))
    with pytest.raises(DataPathError) as caught:
        imagenet_dataset('train', data_path=root, crop_size=32, num_classes=2)
    message = str(caught.value)
    assert '\n' not in message
    for fragment in fragments:
        assert fragment.format(root=root) in message, message


# --- the CLI: train --check-data -----------------------------------------------------------------------------


@pytest.fixture
def train_cli(tmp_path, capfd):
    """``run(root, *overrides)``: ``channels-last train`` of the tiny recipe on ``root`` with
    --check-data, saving to tmp_path/run; returns (exit code, stderr)."""
    pytest.importorskip('composer')
    from channels_last_algo.app.cli.entry import main

    def run(root, *overrides):
        args = sets(
            [*TINY, 'model.num_classes=2', f'data.path={root}', f'train.save_folder={tmp_path / "run"}', *overrides]
        )
        code = main(['train', RECIPE, *args, '--check-data'])
        return code, capfd.readouterr().err

    return run


def test_check_data_refuses_corrupt_jpeg_data_before_training(tmp_path, train_cli):
    pytest.importorskip('simplejpeg')
    root = image_tree(tmp_path / 'data', per_class=2)
    bad = root / 'val' / 'dog' / '1.jpg'
    bad.write_bytes(CORRUPT_DATA['premature end of data segment'])
    code, err = train_cli(root)
    assert code == 2 and err.count('\n') == 1
    assert err.startswith(
        f'channels-last train: error: --check-data: 1 of 8 images cannot be decoded: {bad} (Corrupt JPEG data: '
        'premature end of data segment (libjpeg-turbo, through simplejpeg)); replace or delete them, or set '
        f'data.on_corrupt: skip in {RECIPE}'
    )
    assert not (tmp_path / 'run').exists()


def test_check_data_reports_a_skipped_file_and_trains_without_it(tmp_path, train_cli):
    root = image_tree(tmp_path / 'data', per_class=2)
    bad = root / 'train' / 'cat' / 'x.jpg'
    bad.write_bytes(b'')
    with pytest.warns(
        CorruptImageWarning, match=re.escape(f'skipping corrupt image {bad}: the file is empty (0 bytes)')
    ):
        code, err = train_cli(root, 'data.on_corrupt=skip', 'train.max_duration=2ba')
    assert code == 0, err
    assert (
        f'channels-last train: --check-data: skipping 1 of 9 images that cannot be decoded (data.on_corrupt: skip): '
        f'{bad} (the file is empty (0 bytes))\n'
    ) in err
    assert list((tmp_path / 'run').glob('ep*-ba2-rank0.pt'))


def test_check_data_refuses_to_skip_every_image_of_a_class(tmp_path, train_cli):
    root = image_tree(tmp_path / 'data', per_class=2)
    for image in (root / 'train' / 'cat').iterdir():
        image.write_bytes(b'not an image')
    code, err = train_cli(root, 'data.on_corrupt=skip')
    assert code == 2 and err.count('\n') == 1, err
    assert 'none of the images of the training class cat can be decoded' in err
    assert 'data.on_corrupt: skip would train without the class' in err
    assert not list((tmp_path / 'run').glob('ep*.pt'))


@pytest.mark.parametrize('case', ['class names in NFC in train/ and NFD in val/', 'an image outside the class folders'])
def test_a_hostile_folder_stops_the_cli_naming_data_path(tmp_path, train_cli, case):
    make, fragments = FOLDER_CASES[case]
    root = image_tree(tmp_path / 'data', per_class=2)
    make(root)
    code, err = train_cli(root)
    assert code == 2 and err.count('\n') == 1
    assert err.startswith(f'channels-last train: error: {RECIPE}: data.path: ')
    assert all(fragment.format(root=root) in err for fragment in fragments), err
    assert not (tmp_path / 'run').exists()
