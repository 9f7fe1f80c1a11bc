"""ImageNet-like JPEG folders for the data-path benchmarks, generated (nothing downloaded).

ImageNet's JPEGs are about 500 x 375 pixels on average, most of them 500 px on the long side
in 4:3 or 3:2, landscape about three times in four, about 110 KB each at the quality they were
saved with. :func:`write_imagenet_like_folder` writes ``ROOT/<class>/<n>.JPEG`` with sizes
drawn from :data:`SIZES` and content with a natural image's spectrum (amplitude falling as
1/f, channels correlated), which JPEG compresses as it does photographs: at quality 90 a
500 x 375 image comes to about 110 KB (stripes or flat colours would compress to a few KB and
decode several times faster than real photographs).

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     summary = write_imagenet_like_folder(Path(root), images=4, classes=2, seed=0)
    >>> summary['images'], summary['classes']
    (4, 2)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# (height, width): weight. 500 px long sides in 4:3 and 3:2, landscape three times in four,
# a few squares and a few larger photographs, as in ImageNet's training set
SIZES = {
    (375, 500): 0.45,
    (333, 500): 0.15,
    (500, 375): 0.15,
    (500, 333): 0.05,
    (500, 500): 0.10,
    (600, 800): 0.05,
    (281, 500): 0.05,
}
QUALITY = 90


def natural_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """An ``(height, width, 3)`` uint8 image whose amplitude spectrum falls as 1/f, with
    correlated channels and a random mean colour."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    falloff = np.hypot(fy, fx)
    falloff[0, 0] = 1.0

    def noise() -> np.ndarray:
        shape = (height, width // 2 + 1)
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) / falloff

    shared = noise()
    channels = []
    for _ in range(3):
        channel = np.fft.irfft2(shared + 0.4 * noise(), s=(height, width))
        channels.append((channel - channel.mean()) / (channel.std() + 1e-9))
    pixels = np.stack(channels, axis=-1) * 45 + rng.uniform(60, 190, size=3)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_imagenet_like_folder(root: Path, images: int, classes: int, seed: int) -> dict[str, Any]:
    """Write ``images`` JPEGs (quality :data:`QUALITY`) under ``root/<class>/`` and return
    their count, classes, mean size and mean file size."""
    rng = np.random.default_rng(seed)
    sizes = list(SIZES)
    choices = rng.choice(len(sizes), size=images, p=np.array(list(SIZES.values())) / sum(SIZES.values()))
    pixels, file_bytes = [], []
    for index, choice in enumerate(choices):
        height, width = sizes[choice]
        folder = root / f'n{index % classes:08d}'
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f'{index:06d}.JPEG'
        Image.fromarray(natural_image(height, width, rng)).save(path, quality=QUALITY)
        pixels.append((height, width))
        file_bytes.append(path.stat().st_size)
    return {
        'images': images,
        'classes': min(classes, images),
        'quality': QUALITY,
        'mean_height': float(np.mean([h for h, _ in pixels])),
        'mean_width': float(np.mean([w for _, w in pixels])),
        'mean_kib': float(np.mean(file_bytes) / 1024),
    }
