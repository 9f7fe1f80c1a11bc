"""Models that call their convolutions inside ``torch.func`` transforms train under the package as in NCHW.

Inside ``vmap`` each op sees batched tensors, whose channels-last contiguity torch does not report ("NYI:
querying is_contiguous inside of vmap"); the view watch must still follow them. Each model trains 3 float64
steps through every integration, each step equal to the NCHW run's: an ensemble whose stacked members run
through ``vmap(functional_call(...))`` of one of its own modules, which ``.view()``s its activations, and a
penalty on per-sample gradient norms (``vmap(grad(...))``, viewed) computed in the forward.
"""

from __future__ import annotations

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, classification_batches, guarded, nchw
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap
from torch.nn import functional as F


class ViewingNet(nn.Module):
    """Two convolutions and a head that flattens with ``.view()``."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(y.view(y.size(0), -1))


class Ensemble(nn.Module):
    """Three stacked members run by ``vmap`` through ``functional_call`` of ``member``, plus ``member`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.member = ViewingNet()
        stacked, _ = stack_module_state([ViewingNet() for _ in range(3)])
        self.names = list(stacked)
        self.stacked = nn.ParameterList(nn.Parameter(t) for t in stacked.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(zip(self.names, self.stacked))
        members = vmap(lambda p: functional_call(self.member, p, (x,)))(params)
        return members.mean(0) + self.member(x)


class PerSampleGradientPenalty(nn.Module):
    """The logits plus a penalty on each sample's gradient norm, as ``vmap(grad(...))`` computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ViewingNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())

        def energy(p: dict, sample: torch.Tensor) -> torch.Tensor:
            return functional_call(self.net, p, (sample[None],)).pow(2).sum()

        grads = vmap(grad(energy), in_dims=(None, 0))(params, x)
        penalty = sum(g.view(g.size(0), -1).norm(dim=1) for g in grads.values())
        return self.net(x) + 0.01 * penalty[:, None]


def _cross_entropy(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


RUNS = {
    'ensemble-through-vmap': Run(Ensemble, classification_batches((2, 3, 8, 8), classes=5), _cross_entropy),
    'per-sample-gradient-penalty': Run(
        PerSampleGradientPenalty, classification_batches((2, 3, 8, 8), classes=5), _cross_entropy
    ),
}


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('name', list(RUNS))
def test_convolutions_called_inside_function_transforms_train_as_in_nchw(name, integration):
    run = RUNS[name]
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{name} through {integration}')
    convolutions = [m.weight for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convolutions)
