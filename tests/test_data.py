"""The NHWC data path: collate, device normalisation, ImageFolder checks, synthetic ImageNet, Trainer."""

import io

import numpy as np
import pytest
import torch
import torchvision
from composer import Callback, Trainer
from composer.core import Evaluator
from composer.models import ComposerClassifier
from PIL import Image
from torch import nn
from torch.utils.data import DistributedSampler
from torchvision import transforms

from channels_last_algo import ChannelsLast, Layout, has_channels_last_strides, layout_of
from channels_last_algo.app.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CheckedImageFolder,
    CorruptImageError,
    CorruptImageWarning,
    DataPathError,
    NormalizeBatch,
    SyntheticImageNet,
    build_data_spec,
    build_loader,
    collate_nhwc,
    eval_transform,
    imagenet_dataset,
    train_transform,
)

COLOURS = {'cat': (200, 40, 40), 'dog': (40, 40, 200)}


def _jpeg(path, size, colour, seed, mode='RGB'):
    """A JPEG of ``colour`` with noise, so that decode, resize and crop all have work to do."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.integers(-30, 30, size=(size[1], size[0], 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).convert(mode).save(path, format='JPEG', quality=90)


def _image_tree(root, per_class, splits=('train', 'val')):
    """root/<split>/<cat|dog>/<i>.jpg, of varied sizes, one of them greyscale."""
    for split_index, split in enumerate(splits):
        for class_index, (name, colour) in enumerate(COLOURS.items()):
            for i in range(per_class):
                size = (40 + 7 * i, 56 - 5 * i)
                mode = 'L' if (i, class_index) == (1, 0) else 'RGB'
                _jpeg(root / split / name / f'{i}.jpg', size, colour, seed=(split_index, class_index, i), mode=mode)
    return root


@pytest.fixture
def image_root(tmp_path):
    return _image_tree(tmp_path / 'imagenet', per_class=4)


def _class_of(image):
    """The class whose colour the (N, C, H, W) or (H, W, C) image shows: red is cat, blue is dog."""
    image = torch.as_tensor(np.asarray(image)).float()
    red, blue = (image[..., 0], image[..., 2]) if image.shape[-1] == 3 else (image[0], image[2])
    return 0 if red.mean() > blue.mean() else 1


# --- collate and normalisation ------------------------------------------------------------------


@pytest.mark.parametrize('workers', [0, 2])
def test_normalized_batch_equals_torchvision_to_tensor_normalize_in_nhwc(image_root, workers):
    folder = image_root / 'val'
    ours = CheckedImageFolder(folder, eval_transform(32, resize_size=36))
    loader = build_loader(ours, batch_size=8, train=False, workers=workers)
    (images, labels), = list(loader)
    assert images.dtype == torch.uint8 and has_channels_last_strides(images)
    normalized = NormalizeBatch()((images, labels))[0]

    reference = torchvision.datasets.ImageFolder(
        str(folder),
        transforms.Compose([
            transforms.Resize(36),
            transforms.CenterCrop(32),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]),
    )
    expected = torch.stack([reference[i][0] for i in range(len(reference))]).to(memory_format=torch.channels_last)
    assert normalized.dtype == torch.float32
    assert layout_of(normalized) is Layout.NHWC and has_channels_last_strides(normalized)
    torch.testing.assert_close(normalized, expected, rtol=0, atol=1e-6)
    assert labels.dtype == torch.int64 and labels.tolist() == reference.targets


def test_normalize_to_training_dtype_rounds_the_float32_result_once():
    images = torch.randint(0, 256, (3, 3, 5, 7), dtype=torch.uint8).to(memory_format=torch.channels_last)
    full = NormalizeBatch()(images)
    for dtype in (torch.bfloat16, torch.float16):
        half = NormalizeBatch(dtype=dtype)(images)
        assert half.dtype == dtype and has_channels_last_strides(half)
        assert torch.equal(half, full.to(dtype))


def test_normalize_keeps_nhwc_for_a_cropped_view_and_passes_labels_through():
    images = torch.randint(0, 256, (2, 3, 12, 12), dtype=torch.uint8).to(memory_format=torch.channels_last)
    labels = torch.tensor([3, 1])
    out_images, out_labels = NormalizeBatch()([images[:, :, 2:10, 1:9], labels])
    assert has_channels_last_strides(out_images)
    torch.testing.assert_close(out_images, NormalizeBatch()(images)[:, :, 2:10, 1:9], rtol=0, atol=0)
    assert out_labels is labels


def test_normalize_rejects_what_collate_nhwc_does_not_make():
    with pytest.raises(TypeError, match='uint8 .* collate_nhwc, got torch.float32'):
        NormalizeBatch()(torch.rand(2, 3, 4, 4))
    with pytest.raises(TypeError, match='got dict'):
        NormalizeBatch()({'image': torch.zeros(1, 3, 2, 2, dtype=torch.uint8)})
    with pytest.raises(ValueError, match='one value per channel'):
        NormalizeBatch(mean=(0.5, 0.5), std=(0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match='floating-point'):
        NormalizeBatch(dtype=torch.int32)


def test_collate_copies_each_sample_into_its_nhwc_slot():
    samples = [(np.random.default_rng(i).integers(0, 256, (5, 6, 3), dtype=np.uint8), i) for i in range(3)]
    images, labels = collate_nhwc(samples)
    assert images.shape == (3, 3, 5, 6) and has_channels_last_strides(images)
    for i, (image, _) in enumerate(samples):
        assert torch.equal(images[i].permute(1, 2, 0), torch.from_numpy(image))
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 1, 2]


def test_collate_names_the_sample_that_does_not_fit():
    good = np.zeros((4, 4, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r'sample 1 is uint8 of shape \(5, 4, 3\)'):
        collate_nhwc([(good, 0), (np.zeros((5, 4, 3), dtype=np.uint8), 1)])
    with pytest.raises(TypeError, match=r'ToHWCUint8\(\) instead of ToTensor\(\)'):
        collate_nhwc([(torch.rand(3, 4, 4), 0)])


# --- loaders ----------------------------------------------------------------------------------------


def test_loader_settings_follow_train_and_workers():
    data = SyntheticImageNet(10, num_classes=2, image_size=8, transform=train_transform(8))
    train = build_loader(data, batch_size=4, train=True)
    val = build_loader(data, batch_size=4, train=False, workers=1)
    assert train.drop_last and not val.drop_last
    assert [len(images) for images, _ in train] == [4, 4]
    assert [len(images) for images, _ in val] == [4, 4, 2]
    assert not train.persistent_workers and val.persistent_workers
    assert train.pin_memory == torch.cuda.is_available()
    assert isinstance(train.sampler, DistributedSampler) and train.sampler.shuffle and not val.sampler.shuffle
    with pytest.raises(ValueError, match='fewer than batch_size 16'):
        build_loader(data, batch_size=16, train=True)


def test_loader_shards_the_data_set_across_ranks(monkeypatch):
    data = SyntheticImageNet(12, num_classes=3, image_size=8, transform=eval_transform(8))
    seen = []
    for rank in range(2):
        monkeypatch.setenv('WORLD_SIZE', '2')
        monkeypatch.setenv('RANK', str(rank))
        loader = build_loader(data, batch_size=3, train=True)
        assert loader.sampler.num_replicas == 2 and loader.sampler.rank == rank
        seen.append(set(loader.sampler))
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(12))


def test_data_spec_normalizes_microbatches():
    data = imagenet_dataset('train', crop_size=16, synthetic_samples=8, num_classes=4)
    spec = build_data_spec(data, batch_size=4, train=True, normalize=NormalizeBatch(dtype=torch.bfloat16))
    images, labels = spec.microbatch_transforms(next(iter(spec.dataloader)))
    assert images.dtype == torch.bfloat16 and has_channels_last_strides(images) and labels.dtype == torch.int64
    assert spec.num_samples == 8


# --- Composer Trainer with ChannelsLast ------------------------------------------------------------


class _LoaderLayout(Callback):
    """Records the layout of each batch as the loader gives it, before any algorithm runs."""

    def __init__(self):
        self.layouts = []

    def after_dataloader(self, state, logger):
        images = state.batch[0]
        self.layouts.append((images.dtype, layout_of(images)))


def test_image_folder_trains_a_resnet_in_composer_with_only_nhwc_batches(image_root):
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(weights=None, num_classes=2)
    reaching_model = []
    resnet.register_forward_pre_hook(lambda module, args: reaching_model.append(
        (args[0].dtype, layout_of(args[0]), bool(args[0].min() < 0))))
    train = imagenet_dataset('train', data_path=image_root, crop_size=32, num_classes=2)
    val = imagenet_dataset('val', data_path=image_root, crop_size=32, resize_size=36)
    loader_layout = _LoaderLayout()
    trainer = Trainer(
        model=ComposerClassifier(resnet, num_classes=2),
        train_dataloader=build_data_spec(train, batch_size=4, train=True),
        eval_dataloader=Evaluator(label='val', dataloader=build_data_spec(val, batch_size=8, train=False),
                                  metric_names=['MulticlassAccuracy']),
        eval_interval='2ba',
        max_duration='2ba',
        device='cpu',
        algorithms=[ChannelsLast()],
        callbacks=[loader_layout],
        optimizers=torch.optim.SGD(resnet.parameters(), lr=0.01),
        progress_bar=False,
        seed=0,
    )
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2
    assert loader_layout.layouts == [(torch.uint8, Layout.NHWC)] * 2
    assert len(reaching_model) == 3  # two training batches, one evaluation batch
    assert reaching_model == [(torch.float32, Layout.NHWC, True)] * 3


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
    _jpeg(root / 'cat' / '0.jpg', (16, 16), COLOURS['cat'], seed=0)
    with pytest.raises(DataPathError, match=f'1 class folder.* hold no images .*: {root / "dog"}'):
        CheckedImageFolder(root)


def test_splits_must_agree_on_classes(image_root):
    (image_root / 'val' / 'dog').rename(image_root / 'val' / 'wolf')
    with pytest.raises(DataPathError, match=r"only in train/: \['dog'\]; only in val/: \['wolf'\]"):
        imagenet_dataset('train', data_path=image_root)
    with pytest.raises(DataPathError, match='holds 2 class folders but num_classes is 1000'):
        imagenet_dataset('train', data_path=_image_tree(image_root.parent / 'other', 1), num_classes=1000)


def _corrupt(root):
    """Two broken files in the 'cat' class: a truncated JPEG and text named .jpg."""
    good = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, dtype=np.uint8)).save(good, format='JPEG')
    truncated = root / 'cat' / '1.jpg'
    truncated.write_bytes(good.getvalue()[:len(good.getvalue()) // 2])
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
    (images, labels), = batches
    assert len(labels) == 8
    assert labels.tolist() == [_class_of(image) for image in images]


def test_skipping_fails_when_nothing_decodes(tmp_path):
    (tmp_path / 'train' / 'cat').mkdir(parents=True)
    (tmp_path / 'train' / 'cat' / '0.jpg').write_text('broken')
    data = CheckedImageFolder(tmp_path / 'train', on_corrupt='skip')
    with pytest.warns(CorruptImageWarning), pytest.raises(CorruptImageError, match='no image under .* can be decoded'):
        data[0]


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
        nn.Conv2d(3, 16, 3, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA for pinned memory and device normalisation')
def test_pinned_batches_stay_nhwc_and_normalize_on_the_gpu(image_root):
    data = CheckedImageFolder(image_root / 'val', eval_transform(32))
    images, labels = next(iter(build_loader(data, batch_size=8, train=False, workers=1)))
    assert images.is_pinned() and has_channels_last_strides(images)
    on_gpu = NormalizeBatch()((images.to('cuda', non_blocking=True), labels.to('cuda')))[0]
    assert on_gpu.is_cuda and has_channels_last_strides(on_gpu)
    torch.testing.assert_close(on_gpu.cpu(), NormalizeBatch()(images), rtol=0, atol=1e-6)
