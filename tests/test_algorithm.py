"""ChannelsLast in a plain loop (through the guard) and inside Composer's Trainer."""

import copy

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import ChannelsLast, LayoutGuard, batch_to_channels_last, has_channels_last_strides, is_channels_last
from channels_last_algo.app.demo import TinyResNet


def _images(n=16, size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=generator), torch.randint(0, 10, (n,), generator=generator)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_ten_sgd_steps_match_nchw_and_stay_channels_last(dtype):
    # fp32: the losses agree to float tolerance; fp64 shows the weights agree exactly (the
    # fp32 spread is summation order, amplified in near-zero BN biases over the steps).
    torch.manual_seed(0)
    base = TinyResNet(width=16).to(dtype)
    converted = copy.deepcopy(base)
    guard = LayoutGuard()
    guard.on_init(converted)
    opt_base = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
    opt_cl = torch.optim.SGD(converted.parameters(), lr=0.05, momentum=0.9)
    four_d = [p for p in converted.parameters() if p.dim() == 4]
    assert four_d

    for step in range(10):
        images, labels = _images(n=8, seed=step)
        images = images.to(dtype)
        losses = []
        for model, optimizer, batch in ((base, opt_base, (images, labels)),
                                        (converted, opt_cl, guard.on_batch((images, labels)))):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5, msg=f'loss at step {step}')
        for p in four_d:
            assert has_channels_last_strides(p), f'weight at step {step}'
            assert has_channels_last_strides(p.grad), f'gradient at step {step}'
            assert has_channels_last_strides(opt_cl.state[p]['momentum_buffer']), f'momentum at step {step}'
    if dtype == torch.float64:
        for (name, a), b in zip(base.named_parameters(), converted.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)


def test_batch_conversion_makes_no_copy_when_already_nhwc():
    images = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    labels = torch.arange(2)
    out = batch_to_channels_last([images, labels])
    assert out[0] is images and out[1] is labels


def test_composer_trainer_feeds_nhwc_in_train_eval_and_predict():
    images, labels = _images(n=24)
    loader = DataLoader(TensorDataset(images, labels), batch_size=8)
    module = TinyResNet()
    seen, grads = [], []
    module.register_forward_pre_hook(lambda mod, args: seen.append(is_channels_last(args[0])))
    for p in module.parameters():
        if p.dim() == 4:
            p.register_post_accumulate_grad_hook(lambda p: grads.append(has_channels_last_strides(p.grad)))
    model = ComposerClassifier(module, num_classes=10)
    algorithm = ChannelsLast()
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        eval_dataloader=loader,
        max_duration='2ba',
        device='cpu',
        algorithms=[algorithm],
        progress_bar=False,
    )
    assert all(has_channels_last_strides(p) for p in module.parameters() if p.dim() == 4)
    trainer.fit()
    train_and_eval = len(seen)
    assert train_and_eval >= 2 + 3  # two training batches and the three evaluation batches
    trainer.predict(loader)
    assert len(seen) == train_and_eval + 3
    assert all(seen)
    assert len(grads) == 2 * len([p for p in module.parameters() if p.dim() == 4])
    assert all(grads)


def test_repr_rebuilds_the_algorithm():
    algorithm = ChannelsLast()
    assert repr(eval(repr(algorithm), {'ChannelsLast': ChannelsLast})) == repr(algorithm)
