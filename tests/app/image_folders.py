"""Small ImageNet-style JPEG folders for the data tests: two classes told apart by colour."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

COLOURS = {'cat': (200, 40, 40), 'dog': (40, 40, 200)}


def jpeg(path, size, colour, seed, mode='RGB'):
    """A JPEG of ``colour`` with noise, so that decode, resize and crop all have work to do."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.integers(-30, 30, size=(size[1], size[0], 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).convert(mode).save(path, format='JPEG', quality=90)


def image_tree(root, per_class, splits=('train', 'val')):
    """root/<split>/<cat|dog>/<i>.jpg, of varied sizes, one of them greyscale."""
    for split_index, split in enumerate(splits):
        for class_index, (name, colour) in enumerate(COLOURS.items()):
            for i in range(per_class):
                size = (40 + 7 * i, 56 - 5 * i)
                mode = 'L' if (i, class_index) == (1, 0) else 'RGB'
                jpeg(root / split / name / f'{i}.jpg', size, colour, seed=(split_index, class_index, i), mode=mode)
    return root


def class_of(image):
    """The class whose colour the (N, C, H, W) or (H, W, C) image shows: red is cat, blue is dog."""
    image = torch.as_tensor(np.asarray(image)).float()
    red, blue = (image[..., 0], image[..., 2]) if image.shape[-1] == 3 else (image[0], image[2])
    return 0 if red.mean() > blue.mean() else 1
