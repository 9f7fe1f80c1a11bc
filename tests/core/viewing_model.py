"""A model that views what its modules make, in a module of its own: a child without this package loads it."""

from typing import NamedTuple

import torch
from torch import nn
from torchvision.models.shufflenetv2 import InvertedResidual


class Pair(NamedTuple):
    doubled: torch.Tensor
    more: dict


class Paired(nn.Module):
    """A block of two outputs in a namedtuple, a tensor and a dict of one, made by its own ops."""

    def forward(self, x):
        return Pair(x * 2, {'shifted': x + 1, 'channels': x.shape[1]})


class ViewedEverywhere(nn.Module):
    """Views what a convolution, a two-output block and a channel-shuffle block (a swapped layer) make, and
    writes through one of the views, as in NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pair = Paired()
        self.block = InvertedResidual(8, 8, 1)
        self.head = nn.Linear(4 * 8 * 8 * 8, 4)

    def forward(self, x):
        n, features = x.shape[0], self.conv(x)
        doubled, more = self.pair(features)
        flat = features.view(n, -1)
        flat.mul_(0.5)  # lands in features, as in NCHW
        views = [flat, doubled.view(n, -1), more['shifted'].view(n, -1), self.block(features).view(n, -1)]
        return self.head(torch.cat(views, 1))
