"""The NHWC data path's batch side: collate, device normalisation, loaders, and a Composer run on an
image folder with only NHWC batches. The sources (folders, corrupt files, links, the pre-flight scan,
synthetic ImageNet) are tested in test_datasets.py."""

import numpy as np
import pytest
import torch
import torchvision
from image_folders import image_tree
from torch.utils.data import DistributedSampler
from torchvision import transforms

from channels_last_algo import Layout, has_channels_last_strides, layout_of
from channels_last_algo.app.data.image_folder import CheckedImageFolder
from channels_last_algo.app.data.imagenet import imagenet_dataset
from channels_last_algo.app.data.loaders import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    NormalizeBatch,
    build_data_spec,
    build_loader,
    collate_nhwc,
)
from channels_last_algo.app.data.synthetic import SyntheticImageNet
from channels_last_algo.app.data.transforms import ToHWCUint8, eval_transform, train_transform


@pytest.fixture
def image_root(tmp_path):
    return image_tree(tmp_path / 'imagenet', per_class=4)


# --- collate and normalisation ------------------------------------------------------------------


GREY_LEVEL = 1 / (255 * min(IMAGENET_STD))  # one uint8 step after normalisation


@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('crop', ['torchvision', 'nhwc'])
def test_normalized_batch_equals_torchvision_to_tensor_normalize_in_nhwc(image_root, workers, crop):
    """torchvision's crop + ToHWCUint8 + NormalizeBatch equals ToTensor + Normalize exactly; the
    NHWC crop (torch's antialiased resize instead of Pillow's) within one grey level."""
    folder = image_root / 'val'
    geometry = [transforms.Resize(36), transforms.CenterCrop(32)]
    transform = transforms.Compose([*geometry, ToHWCUint8()]) if crop == 'torchvision' else eval_transform(32, 36)
    ours = CheckedImageFolder(folder, transform)
    loader = build_loader(ours, batch_size=8, train=False, workers=workers)
    ((images, labels),) = list(loader)
    assert images.dtype == torch.uint8 and has_channels_last_strides(images)
    normalized = NormalizeBatch()((images, labels))[0]

    reference = torchvision.datasets.ImageFolder(
        str(folder),
        transforms.Compose(
            [
                *geometry,
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        ),
    )
    expected = torch.stack([reference[i][0] for i in range(len(reference))]).to(memory_format=torch.channels_last)
    assert normalized.dtype == torch.float32
    assert layout_of(normalized) is Layout.NHWC and has_channels_last_strides(normalized)
    torch.testing.assert_close(normalized, expected, rtol=0, atol=1e-6 + (GREY_LEVEL if crop == 'nhwc' else 0))
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
    pytest.importorskip('composer')
    data = imagenet_dataset('train', crop_size=16, synthetic_samples=8, num_classes=4)
    spec = build_data_spec(data, batch_size=4, train=True, normalize=NormalizeBatch(dtype=torch.bfloat16))
    images, labels = spec.microbatch_transforms(next(iter(spec.dataloader)))
    assert images.dtype == torch.bfloat16 and has_channels_last_strides(images) and labels.dtype == torch.int64
    assert spec.num_samples == 8


# --- Composer Trainer with ChannelsLast ------------------------------------------------------------


def test_image_folder_trains_a_resnet_in_composer_with_only_nhwc_batches(image_root):
    pytest.importorskip('composer')
    from composer import Callback, Trainer
    from composer.core import Evaluator
    from composer.models import ComposerClassifier

    from channels_last_algo import ChannelsLast

    class LoaderLayout(Callback):
        """Records the layout of each batch as the loader gives it, before any algorithm runs."""

        def __init__(self):
            self.layouts = []

        def after_dataloader(self, state, logger):
            images = state.batch[0]
            self.layouts.append((images.dtype, layout_of(images)))

    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(weights=None, num_classes=2)
    reaching_model = []
    resnet.register_forward_pre_hook(
        lambda module, args: reaching_model.append((args[0].dtype, layout_of(args[0]), bool(args[0].min() < 0)))
    )
    train = imagenet_dataset('train', data_path=image_root, crop_size=32, num_classes=2)
    val = imagenet_dataset('val', data_path=image_root, crop_size=32, resize_size=36)
    loader_layout = LoaderLayout()
    trainer = Trainer(
        model=ComposerClassifier(resnet, num_classes=2),
        train_dataloader=build_data_spec(train, batch_size=4, train=True),
        eval_dataloader=Evaluator(
            label='val', dataloader=build_data_spec(val, batch_size=8, train=False), metric_names=['MulticlassAccuracy']
        ),
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


@pytest.mark.cuda
def test_pinned_batches_stay_nhwc_and_normalize_on_the_gpu(image_root):
    data = CheckedImageFolder(image_root / 'val', eval_transform(32))
    images, labels = next(iter(build_loader(data, batch_size=8, train=False, workers=1)))
    assert images.is_pinned() and has_channels_last_strides(images)
    on_gpu = NormalizeBatch()((images.to('cuda', non_blocking=True), labels.to('cuda')))[0]
    assert on_gpu.is_cuda and has_channels_last_strides(on_gpu)
    torch.testing.assert_close(on_gpu.cpu(), NormalizeBatch()(images), rtol=0, atol=1e-6)
