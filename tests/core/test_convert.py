"""apply_channels_last: restrides in place, keeps objects and keys, handles 3D and ambiguous kernels."""

import copy

import pytest
import torch
from torch import nn

from channels_last_algo import apply_channels_last, has_channels_last_strides
from channels_last_algo.core.convert import apply_channels_first
from conftest import TinyResNet


def _four_and_five_d(model):
    return [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.dim() in (4, 5)]


def test_parameters_keep_identity_keys_and_values():
    model = TinyResNet()
    before = copy.deepcopy(model.state_dict())
    params = list(model.parameters())
    summary = apply_channels_last(model)
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    assert list(model.state_dict()) == list(before)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert sorted(summary.converted) == sorted(n for n, _ in _four_and_five_d(model))
    assert all(has_channels_last_strides(t) for _, t in _four_and_five_d(model))


def test_ambiguous_kernels_get_real_strides_and_conversion_is_idempotent():
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3),  # in_channels=1
        nn.Conv2d(8, 8, 1),  # 1x1
        nn.Conv2d(8, 8, 3, groups=8),  # depthwise
    )
    apply_channels_last(model)
    for conv in model:
        expected = torch.empty(conv.weight.shape).to(memory_format=torch.channels_last).stride()
        assert conv.weight.stride() == expected
    strides = [conv.weight.stride() for conv in model]
    data_ptrs = [conv.weight.data_ptr() for conv in model]
    again = apply_channels_last(model)
    assert again.converted == [] and len(again.unchanged) == 3
    assert [conv.weight.stride() for conv in model] == strides
    assert [conv.weight.data_ptr() for conv in model] == data_ptrs


def test_conv3d_model_converts_where_composers_algorithm_raises():
    composer_apply = pytest.importorskip('composer.algorithms.channels_last').apply_channels_last
    from torchvision.models.video import r3d_18

    model = r3d_18(weights=None)
    with pytest.raises(RuntimeError, match='required rank 4 tensor'):
        composer_apply(copy.deepcopy(model))
    summary = apply_channels_last(model)
    assert summary.converted
    assert all(w.is_contiguous(memory_format=torch.channels_last_3d) for n, w in _four_and_five_d(model))


def test_conv3d_model_trains_in_channels_last_3d_and_matches_ncdhw():
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Conv3d(2, 8, 3, padding=1),
        nn.BatchNorm3d(8),
        nn.ReLU(),
        nn.Conv3d(8, 4, 1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    converted = copy.deepcopy(base)
    apply_channels_last(converted)
    x = torch.randn(2, 2, 4, 8, 8)
    x_cl = x.to(memory_format=torch.channels_last_3d)
    opt_a = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(converted.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        for model, opt, inp in ((base, opt_a, x), (converted, opt_b, x_cl)):
            opt.zero_grad()
            model(inp).square().mean().backward()
            opt.step()
    for (name, a), b in zip(base.named_parameters(), converted.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
        if a.dim() == 5:
            assert b.is_contiguous(memory_format=torch.channels_last_3d), name
            assert b.grad.is_contiguous(memory_format=torch.channels_last_3d), name


def test_existing_gradients_and_optimizer_state_are_restrided():
    model = TinyResNet()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    summary = apply_channels_last(model, optimizers=optimizer)
    assert summary.optimizer_states == 2 * len([p for p in model.parameters() if p.dim() == 4])
    for p in model.parameters():
        if p.dim() == 4:
            assert has_channels_last_strides(p.grad)
            assert has_channels_last_strides(optimizer.state[p]['exp_avg'])
            assert has_channels_last_strides(optimizer.state[p]['exp_avg_sq'])


def test_model_without_conv_weights_is_left_alone_with_a_warning():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match='no 4D or 5D parameter'):
        summary = apply_channels_last(model)
    assert summary.tensors == 0


def test_a_layer_that_would_crash_and_keeps_its_class_leaves_the_model_nchw_with_a_warning(monkeypatch):
    """On an AVX2 CPU a 1x1 stride-2 convolution over 3 channels corrupts the heap channels last; a subclass with
    its own forward cannot take the safe path, so nothing is restrided or swapped."""
    import dataclasses

    from channels_last_algo.core.runtime import Runtime
    from channels_last_algo.core.safety import bugs

    cpu = dataclasses.replace(Runtime.current('cpu'), cpu_isa='AVX2')
    monkeypatch.setattr(bugs, 'default_runtimes', lambda model: [cpu])

    class Stem(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Conv2d(3, 3, 3), Stem(3, 8, 1, stride=2), nn.AdaptiveAvgPool2d(1))
    with pytest.warns(UserWarning, match=r'kept NCHW: layer 1 \(Stem.forward\) reaches .*onednn_1x1_strided'):
        summary = apply_channels_last(model)
    assert summary.nothing_channels_last and [u.path for u in summary.kept_channels_first] == ['1']
    assert model[0].weight.is_contiguous() and type(model[2]) is nn.AdaptiveAvgPool2d
    model[1] = nn.Conv2d(3, 8, 1, stride=2)  # computes as Conv2d: on its safe path, the model channels last
    assert apply_channels_last(model).made_safe and has_channels_last_strides(model[0].weight)


def test_lazy_parameters_are_skipped_with_advice_then_converted_after_a_forward():
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.Conv2d(8, 8, 3))
    with pytest.warns(UserWarning, match='run one forward pass'):
        summary = apply_channels_last(model)
    assert summary.uninitialized == ['0.weight', '0.bias'] and summary.converted == ['1.weight']
    model(torch.randn(1, 3, 8, 8))
    assert apply_channels_last(model).converted == ['0.weight']


def test_apply_channels_first_undoes_the_conversion_with_optimizer_state():
    model = TinyResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    apply_channels_last(model)
    model(torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)).sum().backward()
    optimizer.step()
    summary = apply_channels_first(model, optimizers=optimizer)
    assert summary.layout == 'channels first' and summary.converted
    for p in model.parameters():
        if p.dim() == 4:
            contiguous = torch.empty(p.shape).stride()
            assert p.stride() == contiguous and p.grad.stride() == contiguous
            assert optimizer.state[p]['momentum_buffer'].stride() == contiguous


def test_weights_that_share_memory_keep_it_and_their_layout():
    """Two convolutions given one memory (``b.weight.data = a.weight.data``), and a convolution whose
    weight is a view into a larger buffer, keep their layout: a restrided copy would split what the
    model writes through one from what it reads through the other. The others go channels last."""
    first, second, third = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3)
    third.weight.data = second.weight.data
    bank = torch.randn(3 * 4 * 4 * 3 * 3)
    viewed = nn.Conv2d(4, 4, 3)
    viewed.weight.data = bank[144:288].view(4, 4, 3, 3)
    model = nn.Sequential(first, second, third, viewed)
    summary = apply_channels_last(model)
    assert summary.converted == ['0.weight']
    assert summary.left['1.weight'] == 'shares its memory with 2.weight: a restrided copy would not'
    assert summary.left['3.weight'].startswith('a view into a larger buffer')
    assert second.weight.data_ptr() == third.weight.data_ptr() and viewed.weight.data_ptr() == bank[144:].data_ptr()
    with torch.no_grad():
        second.weight.mul_(2.0)
    assert torch.equal(second.weight, third.weight)


def test_a_model_whose_only_weights_share_memory_is_left_alone_saying_why():
    first, second = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)
    second.weight.data = first.weight.data
    with pytest.warns(UserWarning, match='0.weight: shares its memory with 1.weight'):
        summary = apply_channels_last(nn.Sequential(first, second))
    assert summary.tensors == 0


def test_weights_that_share_memory_and_already_have_the_strides_count_as_channels_last():
    """No copy is needed, so nothing is split: the model counts as converted (a guard then watches it)."""
    first, second = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)
    first.weight.data = first.weight.data.to(memory_format=torch.channels_last)
    second.weight.data = first.weight.data
    summary = apply_channels_last(nn.Sequential(first, second))
    assert summary.unchanged == ['0.weight', '1.weight'] and not summary.left
    assert first.weight.data_ptr() == second.weight.data_ptr()


def test_weights_in_memory_shared_with_other_processes_keep_it_and_their_layout():
    """``model.share_memory()`` (Hogwild workers, an A3C shared model): a restrided copy would be this
    process's alone, so the other processes would stop seeing its updates."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)).share_memory()
    with pytest.warns(UserWarning, match='0.weight: shares its memory with other processes'):
        summary = apply_channels_last(model)
    assert summary.tensors == 0 and all(p.is_shared() and p.is_contiguous() for p in model.parameters())


def test_a_hogwild_worker_trains_the_models_its_parent_shares():
    """pytorch/examples' mnist_hogwild with a guard in the spawned worker: the parent's models take every update,
    equal to NCHW training's in float64; the one converted before it is shared trains channels last."""
    import multiprocessing

    from hogwild_training import Net, train, train_each

    torch.manual_seed(0)
    expected, shared, converted = Net().double(), Net().double(), Net().double()
    shared.load_state_dict(expected.state_dict())
    converted.load_state_dict(expected.state_dict())
    train(expected, guarded=False)
    apply_channels_last(converted)
    models = [shared.share_memory(), converted.share_memory()]
    worker = multiprocessing.get_context('spawn').Process(target=train_each, args=(models,))
    worker.start()
    worker.join(timeout=600)
    assert worker.exitcode == 0
    for model in models:
        for (name, value), wanted in zip(model.state_dict().items(), expected.state_dict().values()):
            torch.testing.assert_close(value, wanted, rtol=0, atol=1e-12, msg=name)
        assert model.conv2.weight.is_shared()
    assert [has_channels_last_strides(model.conv2.weight) for model in models] == [False, True]
