"""The NHWC data path's sources: checked image folders (missing and empty folders, corrupt files,
directory links), the pre-flight scan, a corrupt validation image in a recipe run, and the synthetic ImageNet."""

import io

import numpy as np
import pytest
import torch
from image_folders import COLOURS, class_of, image_tree, jpeg
from PIL import Image
from recipe_runs import RECIPE, sets
from torch import nn

from channels_last_algo.app.data.image_folder import (
    CheckedImageFolder,
    CorruptImageError,
    CorruptImageWarning,
    DataPathError,
    scan_images,
)
from channels_last_algo.app.data.imagenet import imagenet_dataset
from channels_last_algo.app.data.loaders import NormalizeBatch, build_loader
from channels_last_algo.app.data.synthetic import SyntheticImageNet
from channels_last_algo.app.data.transforms import eval_transform


@pytest.fixture
def image_root(tmp_path):
    return image_tree(tmp_path / 'imagenet', per_class=4)


# --- data path errors --------------------------------------------------------------------------------


def test_missing_and_empty_data_paths_are_named(tmp_path):
    missing = tmp_path / 'nowhere'
    with pytest.raises(DataPathError, match=f'{missing} does not exist'):
        imagenet_dataset('train', data_path=missing)
    with pytest.raises(DataPathError, match=f'{missing} does not exist'):
        CheckedImageFolder(missing)
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(DataPathError, match=f'{empty} has no train/ folder'):
        imagenet_dataset('train', data_path=empty)
    with pytest.raises(DataPathError, match=f'image folder {empty} is empty'):
        CheckedImageFolder(empty)
    (empty / 'notes.txt').write_text('no class folders here')
    with pytest.raises(DataPathError, match='holds files but no class folders'):
        CheckedImageFolder(empty)


def test_folders_without_images_are_named(tmp_path):
    root = tmp_path / 'train'
    (root / 'cat').mkdir(parents=True)
    (root / 'cat' / 'readme.txt').write_text('not an image')
    (root / 'dog').mkdir()
    with pytest.raises(DataPathError, match=f'{root} has class folders but no images'):
        CheckedImageFolder(root)
    jpeg(root / 'cat' / '0.jpg', (16, 16), COLOURS['cat'], seed=0)
    with pytest.raises(DataPathError, match=f'1 class folder.* hold no images .*: {root / "dog"}'):
        CheckedImageFolder(root)


def test_splits_must_agree_on_classes(image_root):
    (image_root / 'val' / 'dog').rename(image_root / 'val' / 'wolf')
    with pytest.raises(DataPathError, match=r"only in train/: \['dog'\]; only in val/: \['wolf'\]"):
        imagenet_dataset('train', data_path=image_root)
    with pytest.raises(DataPathError, match='holds 2 class folders but num_classes is 1000'):
        imagenet_dataset('train', data_path=image_tree(image_root.parent / 'other', 1), num_classes=1000)


def _corrupt(root):
    """Two broken files in the 'cat' class: a truncated JPEG and text named .jpg."""
    good = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, dtype=np.uint8)).save(good, format='JPEG')
    truncated = root / 'cat' / '1.jpg'
    truncated.write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    garbage = root / 'cat' / '2.jpg'
    garbage.write_text('this is not a JPEG')
    return truncated, garbage


def test_corrupt_image_raises_naming_the_file(image_root):
    truncated, garbage = _corrupt(image_root / 'train')
    data = CheckedImageFolder(image_root / 'train', eval_transform(32))
    paths = [path for path, _ in data.samples]
    for broken in (truncated, garbage):
        with pytest.raises(CorruptImageError, match=f"cannot decode image {broken}: .*on_corrupt='skip'"):
            data[paths.index(str(broken))]
    with pytest.raises(CorruptImageError, match=f'cannot decode image {truncated}'):
        list(build_loader(data, batch_size=8, train=False, workers=1))
    with pytest.raises(ValueError, match="on_corrupt must be 'raise' or 'skip'"):
        CheckedImageFolder(image_root / 'train', on_corrupt='ignore')


def test_skipped_corrupt_images_are_reported_and_never_mislabel(image_root):
    truncated, garbage = _corrupt(image_root / 'train')
    data = CheckedImageFolder(image_root / 'train', eval_transform(32), on_corrupt='skip')
    with pytest.warns(CorruptImageWarning) as caught:
        batches = list(build_loader(data, batch_size=8, train=False))
    reported = ' '.join(str(warning.message) for warning in caught)
    assert str(truncated) in reported and str(garbage) in reported
    ((images, labels),) = batches
    assert len(labels) == 8
    assert labels.tolist() == [class_of(image) for image in images]


def test_skipping_fails_when_nothing_decodes(tmp_path):
    (tmp_path / 'train' / 'cat').mkdir(parents=True)
    (tmp_path / 'train' / 'cat' / '0.jpg').write_text('broken')
    data = CheckedImageFolder(tmp_path / 'train', on_corrupt='skip')
    with pytest.warns(CorruptImageWarning), pytest.raises(CorruptImageError, match='no image under .* can be decoded'):
        data[0]


def test_directory_links_that_loop_or_repeat_a_folder_are_refused(image_root, tmp_path):
    train = image_root / 'train'
    loop = train / 'cat' / 'loop'
    loop.symlink_to('..')  # the split itself again, inside the cat class: dogs would become cats, forever
    with pytest.raises(
        DataPathError,
        match=rf'{loop / "cat"} is the folder {train / "cat"} again through the '
        rf'directory link {loop} -> \.\. \(a loop, under another label\); remove',
    ):
        CheckedImageFolder(train)
    loop.unlink()
    dogs = train / 'cat' / 'dogs'
    dogs.symlink_to(train / 'dog')
    with pytest.raises(DataPathError, match=rf'{train / "dog"} is the folder {dogs} again .*counted twice'):
        CheckedImageFolder(train)
    dogs.unlink()
    (tmp_path / 'more_cats').mkdir()
    jpeg(tmp_path / 'more_cats' / 'x.jpg', (20, 20), COLOURS['cat'], seed=9)
    (train / 'cat' / 'more').symlink_to(tmp_path / 'more_cats')  # a folder outside the split: fine, once
    assert sum(label == 0 for _, label in CheckedImageFolder(train).samples) == 5


def test_pre_flight_scan_names_every_image_that_cannot_be_decoded(image_root):
    truncated, garbage = _corrupt(image_root / 'train')
    for workers in (0, 2):
        problems = scan_images(CheckedImageFolder(image_root / 'train'), workers=workers)
        assert [path for path, _ in problems] == [str(truncated), str(garbage)]
    assert 'truncated' in problems[0][1].lower()
    assert scan_images(CheckedImageFolder(image_root / 'val')) == []


def test_pre_flight_scan_plans_random_crops_without_moving_the_random_state(image_root):
    """The scan plans each training crop as training will (torch's generator draws the boxes) and
    leaves the generator where it was, so a checked run trains on the batches an unchecked one would."""
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert scan_images(imagenet_dataset('train', data_path=image_root, crop_size=32), workers=2) == []
    assert torch.equal(torch.rand(3), expected)


def test_a_corrupt_validation_image_loses_no_training(image_root, tmp_path, capfd):
    pytest.importorskip('composer')
    from channels_last_algo.app.cli.entry import main
    from channels_last_algo.app.runs.checkpoint_files import read_state

    broken = image_root / 'val' / 'dog' / '2.jpg'
    broken.write_bytes(broken.read_bytes()[:300])
    folder = tmp_path / 'run'
    overrides = sets(
        [
            f'data.path={image_root}',
            'model.name=channels_last_algo.app.runs.demo:TinyResNet',
            'model.num_classes=2',
            'data.train_crop=32',
            'data.eval_crop=32',
            'data.eval_resize=36',
            'data.workers=0',
            'train.global_batch_size=4',
            'train.max_duration=2ep',
            'scheduler.t_warmup=1ba',
            f'train.save_folder={folder}',
        ]
    )
    assert main(['train', RECIPE, '--check-data', *overrides]) == 2  # the pre-flight scan finds it first
    err = capfd.readouterr().err
    assert err.startswith(f'channels-last train: error: --check-data: 1 of 16 images cannot be decoded: {broken} (')
    assert (
        err.endswith(
            f'); replace or delete them, or set data.on_corrupt: skip in {RECIPE} (--set data.on_corrupt=skip)\n'
        )
        and err.count('\n') == 1
    )
    assert not folder.exists()
    assert main(['train', RECIPE, *overrides]) == 2  # evaluated after the first epoch, and saved before that
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f'channels-last train: error: cannot decode image {broken}: ')
    assert err.endswith(
        f'Replace or delete the file, or set data.on_corrupt: skip in {RECIPE} (--set '
        f'data.on_corrupt=skip) to skip corrupt files.; the training up to {folder}/ep1-ba2-rank0.pt '
        'is saved: continue with --resume'
    )
    assert read_state(folder / 'ep1-ba2-rank0.pt')['timestamp']['Timestamp']['epoch'] == 1
    with pytest.warns(CorruptImageWarning, match=f'skipping corrupt image {broken}: '):
        assert main(['train', RECIPE, '--resume', *overrides, '--set', 'data.on_corrupt=skip']) == 0
    assert read_state(folder / 'latest-rank0.pt')['timestamp']['Timestamp']['epoch'] == 2


# --- synthetic ImageNet -----------------------------------------------------------------------------


def test_synthetic_set_is_deterministic_and_class_dependent():
    data = SyntheticImageNet(20, num_classes=5, image_size=(24, 40))
    again = SyntheticImageNet(20, num_classes=5, image_size=(24, 40))
    other_seed = SyntheticImageNet(20, num_classes=5, image_size=(24, 40), seed=1)
    val = SyntheticImageNet(20, num_classes=5, image_size=(24, 40), split='val')
    assert data.image(7).shape == (24, 40, 3) and data.image(7).dtype == np.uint8
    assert np.array_equal(data.image(7), again.image(7))
    assert not np.array_equal(data.image(7), other_seed.image(7))
    assert not np.array_equal(data.image(7), val.image(7))
    assert [data[i][1] for i in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    colour = lambda i: data.image(i).reshape(-1, 3).mean(0)
    assert np.abs(colour(0) - colour(5)).max() < np.abs(colour(0) - colour(1)).max()
    with pytest.raises(IndexError, match='sample 20 is out of range'):
        data[20]


def test_synthetic_imagenet_defaults_to_imagenet_shape():
    train = imagenet_dataset('train', crop_size=176)
    val = imagenet_dataset('val', crop_size=224)
    assert (len(train), len(train.classes), train.image_size) == (1_281_167, 1000, (201, 201))
    assert (len(val), len(val.classes)) == (50_000, 1000)
    assert train[0][0].shape == (176, 176, 3) and val[0][0].shape == (224, 224, 3)


def test_synthetic_set_is_learnable():
    torch.manual_seed(0)
    data = imagenet_dataset('train', crop_size=32, synthetic_samples=32 * 40, num_classes=10)
    loader = build_loader(data, batch_size=32, train=True)
    normalize = NormalizeBatch()
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for images, labels in map(normalize, loader):
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    chance = np.log(10)
    assert len(losses) == 40 and losses[0] > 0.8 * chance, losses
    assert np.mean(losses[-5:]) < 0.5 * chance, losses
