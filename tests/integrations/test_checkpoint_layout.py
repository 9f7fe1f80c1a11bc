"""Canonical checkpoints: what a channels-last run saves is NCHW-contiguous under the original keys
(model, optimizer state), loads back into channels-last strides, and moves between NCHW and
channels-last runs bit for bit; across 2 gloo ranks through ``torch.distributed.checkpoint`` and
``set_model_state_dict(..., broadcast_from_rank0=True)`` no weight arrives permuted.

Run as a script (``python -m torch.distributed.run --nproc_per_node 2 tests/integrations/test_checkpoint_layout.py
CHECKPOINT OUT``), this file is a rank's program for the distributed test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from channels_last_algo import LayoutGuard, apply_channels_last
from channels_last_algo.core.canonical_checkpoints import canonical_state, is_canonical
from channels_last_algo.core.layout import is_channels_last

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest
from conftest import leave_rank, small_net  # noqa: E402


def _conv_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.dim() == 4}


def _momentum_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s['momentum_buffer'] for s in optimizer.state.values() if s['momentum_buffer'].dim() == 4]


def _sgd_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        model(x.contiguous(memory_format=torch.channels_last)).square().mean().backward()
        optimizer.step()


def test_canonical_state_copies_only_channels_last_tensors_and_leaves_live_state_alone():
    model = small_net().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    apply_channels_last(model, optimizer)
    _sgd_steps(model, optimizer, 2)
    assert all(is_channels_last(buffer) for buffer in _momentum_of(optimizer))
    saved = canonical_state({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epoch': 1})
    assert is_canonical(saved) and saved['epoch'] == 1
    assert saved['model'].keys() == model.state_dict().keys()
    for name, weight in _conv_weights(model).items():
        assert torch.equal(saved['model'][name], weight)
        saved['model'][name].view(weight.shape[0], -1)  # what .view()-based consumers do
    safetensors = pytest.importorskip('safetensors.torch')  # which refuses any non-contiguous tensor
    loaded = safetensors.load(safetensors.save(saved['model']))
    assert all(torch.equal(loaded[name], value) for name, value in saved['model'].items())
    # the optimizer's own per-parameter state stays channels last (the saved dict has new containers)
    assert all(is_channels_last(buffer) for buffer in _momentum_of(optimizer))
    # model.state_dict() itself still aliases the weights, so in-place EMA updates through it work
    assert model.state_dict()['0.weight'].data_ptr() == model[0].weight.data_ptr()


@pytest.mark.parametrize('assign', [False, True])
def test_a_canonical_checkpoint_loads_back_into_channels_last_bit_for_bit(assign):
    torch.manual_seed(0)
    source, target = small_net().double(), small_net().double()
    source_optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    apply_channels_last(source, source_optimizer)
    _sgd_steps(source, source_optimizer, 2)
    saved = canonical_state({'model': source.state_dict(), 'optimizer': source_optimizer.state_dict()})

    guard = LayoutGuard()
    guard.on_init(target)
    target.load_state_dict(saved['model'], assign=assign)  # assign=True: new Parameters, so the optimizer after
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(saved['optimizer'])
    guard.on_load(target, optimizer)
    for name, weight in _conv_weights(target).items():
        assert is_channels_last(weight), name
        assert torch.equal(weight, saved['model'][name])
    assert all(is_channels_last(buffer) for buffer in _momentum_of(optimizer))
    for mine, theirs in zip(_momentum_of(optimizer), _momentum_of(source_optimizer)):
        assert torch.equal(mine, theirs)


# --- Composer: the algorithm's checkpoints, both directions ------------------------------------------


def _composer_run(tmp_path: Path, name: str, channels_last: bool, duration: str, load_path=None):
    """A float64 Composer run of small_net with SGD + momentum; returns (trainer, state seen at FIT_START)."""
    pytest.importorskip('composer')
    from composer import Callback, Event, Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from channels_last_algo import ChannelsLast

    seen = {}

    class AtFitStart(Callback):
        def run_event(self, event, state, logger):
            if event == Event.FIT_START and not seen:
                seen['weights'] = {k: v.detach().clone() for k, v in _conv_weights(state.model.module).items()}
                seen['channels_last'] = [is_channels_last(v) for v in _conv_weights(state.model.module).values()]
                seen['momentum'] = [b.clone() for b in _momentum_of(state.optimizers[0])]
                seen['momentum_channels_last'] = [is_channels_last(b) for b in _momentum_of(state.optimizers[0])]

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16, 3, 8, 8, generator=generator, dtype=torch.float64),
        torch.randint(0, 4, (16,), generator=generator),
    )
    model = ComposerClassifier(small_net().double(), num_classes=4)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=4),
        max_duration=duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        algorithms=[ChannelsLast()] if channels_last else [],
        callbacks=[AtFitStart()],
        save_folder=str(tmp_path / name),
        save_interval='2ba',
        save_filename='ba{batch}.pt',
        load_path=load_path,
        device='cpu',
        progress_bar=False,
        log_to_console=False,
    )
    trainer.fit()
    return trainer, seen


@pytest.mark.parametrize('first, second', [(True, False), (False, True)])
def test_composer_checkpoints_are_canonical_and_resume_across_layouts_bit_for_bit(tmp_path, first, second):
    _composer_run(tmp_path, 'a', first, '2ba')
    checkpoint = tmp_path / 'a' / 'ba2.pt'
    saved = torch.load(checkpoint, weights_only=False)['state']
    assert is_canonical(saved)
    weights = {k.removeprefix('module.'): v for k, v in saved['model'].items() if v.dim() == 4}
    weights['0.weight'].view(8, -1)
    trainer, seen = _composer_run(tmp_path, 'b', second, '4ba', load_path=str(checkpoint))
    assert all(flag == second for flag in seen['channels_last'] + seen['momentum_channels_last'])
    for name, weight in seen['weights'].items():
        assert torch.equal(weight, weights[name]), name
    saved_momentum = [v['momentum_buffer'] for v in saved['optimizers']['SGD']['state'].values()]
    saved_momentum = [m for m in saved_momentum if m.dim() == 4]
    assert all(torch.equal(a, b) for a, b in zip(seen['momentum'], saved_momentum))
    # and training goes on as the NCHW run does (float64)
    reference, _ = _composer_run(tmp_path, 'c', False, '4ba', load_path=str(checkpoint))
    for (name, mine), theirs in zip(
        _conv_weights(trainer.state.model.module).items(), _conv_weights(reference.state.model.module).values()
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=name)


# --- 2 gloo ranks: torch.distributed.checkpoint and broadcast_from_rank0 -------------------------------


def _rank_program(checkpoint: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    dist.init_process_group('gloo')
    rank = dist.get_rank()
    expected = torch.load(checkpoint)
    results = {}

    def fresh() -> nn.Module:
        torch.manual_seed(100 + rank)  # each rank starts from other weights
        model = small_net().double()
        apply_channels_last(model)
        return model

    def check(model: nn.Module) -> list[str]:
        return [
            name
            for name, tensor in model.state_dict().items()
            if not torch.equal(tensor, expected[name]) or (tensor.dim() == 4 and not is_channels_last(tensor))
        ]

    model = fresh()
    full = torch.load(checkpoint) if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    results['broadcast_from_rank0'] = check(model)

    source = fresh()
    source.load_state_dict(expected)
    folder = os.path.join(out, 'dcp')
    dcp.save({'model': canonical_state(get_model_state_dict(source))}, checkpoint_id=folder)
    model = fresh()
    state = {'model': get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state['model'])
    results['distributed_checkpoint'] = check(model)
    torch.save(results, os.path.join(out, f'rank{rank}.pt'))
    leave_rank()


@pytest.mark.distributed
def test_two_ranks_restore_channels_last_weights_unpermuted(tmp_path):
    torch.manual_seed(0)
    model = small_net().double()
    apply_channels_last(model)
    checkpoint = tmp_path / 'model.pt'
    torch.save(canonical_state(model.state_dict()), checkpoint)
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', f'--master_port={port}']
    command += [__file__, str(checkpoint), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        results = torch.load(tmp_path / f'rank{rank}.pt')
        assert results == {'broadcast_from_rank0': [], 'distributed_checkpoint': []}, (rank, results)


if __name__ == '__main__':
    _rank_program(*sys.argv[1:3])
