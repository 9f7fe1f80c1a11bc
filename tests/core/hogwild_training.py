"""Hogwild training as pytorch/examples' mnist_hogwild runs it, in a module a spawned worker imports: the
parent shares the model's memory, each worker trains it with a guard of its own."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """The example's network: two convolutions, then ``x.view(-1, 320)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.view(-1, 320)))), dim=1)


def batches() -> list:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(8, 1, 28, 28, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (8,), generator=generator),
        )
        for _ in range(3)
    ]


def train(model: nn.Module, guarded: bool) -> None:
    """Three SGD steps with momentum on ``model``, under a ``LayoutGuard`` where ``guarded``."""
    from channels_last_algo import LayoutGuard

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    guard = LayoutGuard(audit_steps=0) if guarded else None
    if guard:
        guard.on_init(model, optimizer)
    for data, target in batches():
        optimizer.zero_grad()
        if guard:
            data, target = guard.on_batch((data, target))
            with guard.step():
                F.nll_loss(model(data), target).backward()
        else:
            F.nll_loss(model(data), target).backward()
        optimizer.step()
        if guard:
            guard.on_batch_end()
    if guard:
        guard.close()


def train_each(models: list) -> None:
    """:func:`train` each of ``models`` under a guard, one after the other (one worker process for them all)."""
    for model in models:
        train(model, guarded=True)
