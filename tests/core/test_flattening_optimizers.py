"""Each row of the flattening-optimizer table keeps a guarded model's weights contiguous, and training
through it equals NCHW training (LBFGS, Muon: tests/core/test_views.py; here ZeroRedundancyOptimizer)."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from channels_last_algo.core.flattening_optimizers import flattening
from channels_last_algo.core.guard import LayoutGuard


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(64, 2)).double()


@pytest.fixture
def one_rank():
    """A gloo process group of one rank, for ZeroRedundancyOptimizer."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _zero(params, bucket_view: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        params, optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9, parameters_as_bucket_view=bucket_view
    )


def _train(net: nn.Module, opt: torch.optim.Optimizer, guard: LayoutGuard | None) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        images = torch.randn(2, 3, 8, 8, generator=generator, dtype=torch.float64)
        opt.zero_grad()
        if guard is None:
            net(images).sum().backward()
        else:
            with guard.step():
                net(guard.on_batch(images)).sum().backward()
        opt.step()


def test_zero_with_bucket_views_keeps_the_buckets(one_rank):
    """ZeRO's parameters are views of its buckets: the guard leaves them be, and updates reach them."""
    reference = _net()
    _train(reference, _zero(reference.parameters(), True), None)
    net = _net()
    opt = _zero(net.parameters(), True)
    guard = LayoutGuard()
    guard.on_init(net, opt)
    assert guard.weight_layout.contiguous and guard.weight_layout.sharded
    assert 'ZeroRedundancyOptimizer keeps the parameters as views of flat buckets' in str(guard.start_block)
    buckets = {p.untyped_storage().data_ptr() for p in net.parameters()}
    _train(net, opt, guard)
    assert {p.untyped_storage().data_ptr() for p in net.parameters()} == buckets
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10, msg=name)


def test_zero_without_bucket_views_leaves_the_weights_channels_last(one_rank):
    net = _net()
    guard = LayoutGuard()
    guard.on_init(net, _zero(net.parameters(), False))
    assert not guard.weight_layout.contiguous and not net[0].weight.is_contiguous()


def test_a_subclass_of_a_row_counts_and_other_optimizers_do_not():
    class MyLBFGS(torch.optim.LBFGS):
        pass

    params = [nn.Parameter(torch.zeros(4, 3, 1, 1))]
    assert flattening(MyLBFGS(params)) == ('MyLBFGS gathers the gradients with p.grad.view(-1)', False)
    for optimizer in (torch.optim.SGD(params, lr=0.1), torch.optim.AdamW(params)):
        assert flattening(optimizer) is None


@pytest.mark.parametrize('collected', [False, True])
def test_the_optimizer_watch_leaves_a_steps_hook_table_alone_while_it_is_walked(collected):
    """torch walks its live table of step pre-hooks: neither the watch that finds a flattening
    optimizer nor one collected during the walk may take a hook off while others follow it."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from channels_last_algo.core.weight_layout import OptimizerWatch

    held = []  # the other watch, let go during the walk where ``collected``
    first = register_optimizer_step_pre_hook(lambda *args: (collected and held.clear(), gc.collect()) and None)
    model, found = _net(), []
    watch = OptimizerWatch(model, lambda optimizer, plan: found.append(plan.reason))
    held.append(OptimizerWatch(nn.Conv2d(3, 3, 1), lambda optimizer, plan: None))
    try:
        images = torch.randn(1, 3, 8, 8, dtype=torch.float64)
        torch.optim.LBFGS(model.parameters(), max_iter=1).step(lambda: model(images).sum())
    finally:
        first.remove()
        watch.close()
        for other in held:
            other.close()
    assert found == ['LBFGS gathers the gradients with p.grad.view(-1)']
