"""ChannelsLast under distributed training: DDP and FSDP2 on 2 CPU ranks (gloo), and the weight-layout decision.

The multi-process test starts 2 ranks with Composer's own launcher (``python -m
composer.cli.launcher -n 2 tests/integrations/test_distributed.py OUT``, which sets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT). Run as that script, this
file is the rank's program: it trains a small conv net (3x3, depthwise 3x3 and 1x1 convs,
BatchNorm) with ``ChannelsLast`` in Composer's ``Trainer(device='cpu')``, which wraps it in DDP
(then FSDP2), and saves what it saw to ``OUT/rank{r}.pt``; the test compares that with a
single-process NCHW run over the same global batches. The DDP run resumed from its checkpoint has ``ChannelsLast``
among the Trainer's callbacks, the others among its algorithms.

BatchNorm normalises each rank's half-batch on its own under DDP, so the single-process
reference trains on the same global batch in two microbatches of one rank's half each:
parameters and gradients then match exactly in exact arithmetic. BatchNorm running statistics
stay per rank (DDP broadcasts rank 0's before each forward, and each rank then updates its own),
so only parameters are compared across runs; the checkpoint test compares the full state.

Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip('composer', reason='the Composer launcher and Trainer are in the Composer environment')
import torch
from torch import nn

from channels_last_algo import ChannelsLast, LayoutGuard, apply_channels_last
from channels_last_algo.core.weight_layout import WeightLayoutPlan, weight_layout_for
from conftest import STRIDE_WARNING, channels_last_strides, free_port, leave_rank, nhwc_bucket_views, small_net

pytestmark = pytest.mark.distributed

WORLD = 2
RANK_BATCH = 4  # samples per rank and step; the global batch is 8
STEPS = 3  # steps before the checkpoint; the resumed run trains as many again
IMAGE = 12


def dataset() -> torch.utils.data.TensorDataset:
    """2 * STEPS global batches of CHW images and labels, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    samples = 2 * STEPS * WORLD * RANK_BATCH
    return torch.utils.data.TensorDataset(
        torch.randn(samples, 3, IMAGE, IMAGE, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )


def probe_images() -> torch.Tensor:
    return torch.randn(5, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))


def parameters_of(net: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of ``net``'s parameters."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for name, p in net.named_parameters()
    }


# --- the rank's program (run by the launcher) -------------------------------------------------------


def _trainer(net: nn.Module, duration: str, callbacks=(), place='algorithms', **options):
    """A Composer Trainer of ``net`` on this rank's share of the data, with ChannelsLast (``options['algorithm']``,
    else one with default options) in its ``place``: its algorithms, or its callbacks ahead of ``callbacks``."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.utils import dist

    data = dataset()
    loader = torch.utils.data.DataLoader(data, batch_size=RANK_BATCH, sampler=dist.get_sampler(data, shuffle=False))
    algorithm = options.pop('algorithm', ChannelsLast())
    return Trainer(
        model=ComposerClassifier(net, num_classes=4),
        train_dataloader=loader,
        max_duration=duration,
        optimizers=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        algorithms=[algorithm] if place == 'algorithms' else [],
        callbacks=[algorithm, *callbacks] if place == 'callbacks' else list(callbacks),
        device='cpu',
        seed=17,
        progress_bar=False,
        log_to_console=False,
        **options,
    )


class _Recorder:
    """What one run did to layouts: the model type at INIT, each step's gradient strides, and
    (under DDP, through a comm hook) whether each bucket holds its gradients in NHWC order."""

    def __init__(self, net: nn.Module, ddp: bool):
        from composer import Callback

        self.record = {'init_model': None, 'wrapped_model': None, 'param_strides': {}, 'grads': [], 'buckets': []}
        recorder = self

        class Hooks(Callback):
            def init(self, state, logger):
                recorder.record['init_model'] = type(state.model).__name__

            def fit_start(self, state, logger):
                recorder.record['wrapped_model'] = type(state.model).__name__
                recorder.record['param_strides'] = {n: p.stride() for n, p in net.named_parameters() if p.dim() == 4}
                if ddp:
                    state.model.register_comm_hook(None, recorder.comm_hook)

            def after_backward(self, state, logger):
                if ddp:
                    recorder.record['grads'].append(
                        {n: (p.stride(), p.grad.stride()) for n, p in net.named_parameters() if p.dim() == 4}
                    )

        self.callback = Hooks()

    def comm_hook(self, process_group, bucket):
        """Read each 4D gradient back from the bucket's bytes with NHWC strides: equal to the
        rank's gradient only if DDP's bucket view for it is NHWC. Then the usual allreduce."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.record['buckets'].append(nhwc_bucket_views(bucket))
        return default_hooks.allreduce_hook(process_group, bucket)


def _conv_layouts(net: nn.Module) -> tuple[list, list]:
    """Forward hooks that note (input NHWC, output NHWC, weight contiguous) for each conv."""
    seen = []

    def note(module, inputs, output):
        seen.append(
            (
                inputs[0].is_contiguous(memory_format=torch.channels_last),
                output.is_contiguous(memory_format=torch.channels_last),
                module.weight.is_contiguous(),
            )
        )

    handles = [m.register_forward_hook(note) for m in net.modules() if isinstance(m, nn.Conv2d)]
    return seen, handles


def _run_rank(out: Path) -> None:
    from composer.utils import FSDP2Config, dist

    rank = int(os.environ['RANK'])
    result = {
        'env': {
            key: os.environ[key]
            for key in (
                'RANK',
                'WORLD_SIZE',
                'LOCAL_RANK',
                'LOCAL_WORLD_SIZE',
                'NODE_RANK',
                'MASTER_ADDR',
                'MASTER_PORT',
            )
        }
    }
    initial = torch.load(out / 'initial.pt')
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger('channels_last_algo').addHandler(handler)
    logging.getLogger('channels_last_algo').setLevel(logging.INFO)

    def train(name, net, duration, ddp=True, **options):
        recorder = _Recorder(net, ddp=ddp)
        messages.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            trainer = _trainer(net, duration, callbacks=[recorder.callback], run_name=name, **options)
            trainer.fit()
        recorder.record['warnings'] = [str(w.message) for w in caught if STRIDE_WARNING in str(w.message)]
        recorder.record['log'] = list(messages)
        recorder.record['parameters'] = parameters_of(net)
        result[name] = recorder.record
        return trainer

    # 1. DDP, STEPS steps from the initial weights, audited, checkpoint by rank 0 at the end.
    net = small_net()
    net.load_state_dict(initial)
    algorithm = ChannelsLast(audit_steps=STEPS)
    train(
        'ddp',
        net,
        f'{STEPS}ba',
        algorithm=algorithm,
        save_folder=str(out / 'checkpoints'),
        save_interval=f'{STEPS}ba',
        save_filename='ep{epoch}-ba{batch}-rank{rank}.pt',
    )
    result['ddp']['audit'] = (
        None if algorithm.report is None else (algorithm.report.steps, algorithm.report.ok, str(algorithm.report))
    )
    net.eval()
    with torch.no_grad():
        result['ddp']['probe_output'] = net(probe_images().to(memory_format=torch.channels_last))
    dist.barrier()

    # 2. Resume from rank 0's checkpoint on both ranks and train STEPS more, ChannelsLast among the callbacks.
    checkpoint = str(out / 'checkpoints' / f'ep0-ba{STEPS}-rank0.pt')
    train('resumed', small_net(), f'{2 * STEPS}ba', place='callbacks', load_path=checkpoint)

    # 3. FSDP2 from the same initial weights, with ChannelsLast (weights stay contiguous,
    # activations NHWC) and without it.
    for name, mode in (('fsdp2', 'on'), ('fsdp2_nchw', 'off')):
        net = small_net()
        net.load_state_dict(initial)
        convs, handles = _conv_layouts(net)
        train(
            name,
            net,
            f'{STEPS}ba',
            ddp=False,
            algorithm=ChannelsLast(mode=mode),
            parallelism_config={'fsdp': FSDP2Config()},
        )
        result[name]['conv_layouts'] = list(convs)
        for handle in handles:
            handle.remove()

    # 4. The failure this avoids: restriding after DDP is built warns (once per process, so last).
    net = small_net()
    wrapped = nn.parallel.DistributedDataParallel(net)
    try:
        LayoutGuard().on_init(wrapped)
    except ValueError as error:
        result['guard_refuses_ddp'] = str(error)
    try:
        apply_channels_last(net)
    except RuntimeError as error:
        result['restride_after_wrap_refused'] = str(error)
    for p in net.parameters():  # what the refusal avoids: restrided behind DDP's back
        p.data = p.data.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p.data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        wrapped(probe_images().to(memory_format=torch.channels_last)).sum().backward()
    result['restrided_after_wrap_warnings'] = [str(w.message) for w in caught if STRIDE_WARNING in str(w.message)]
    torch.save(result, out / f'rank{rank}.pt')
    leave_rank()


# --- the test process -----------------------------------------------------------------------------


def _reference(initial: Path, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """One process, NCHW, no ChannelsLast: each global batch of the 2-rank run (rank 0's samples,
    then rank 1's) in two microbatches of RANK_BATCH, parameters after ``STEPS`` and ``steps`` steps."""
    from composer import Callback, Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    data = dataset()
    per_rank = [list(DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=False)) for r in range(WORLD)]
    order = [
        index
        for step in range(steps)
        for rank_indices in per_rank
        for index in rank_indices[step * RANK_BATCH : (step + 1) * RANK_BATCH]
    ]
    net = small_net()
    net.load_state_dict(torch.load(initial))
    snapshots = {}

    class Snapshot(Callback):
        def batch_end(self, state, logger):
            snapshots[int(state.timestamp.batch)] = parameters_of(net)

    trainer = Trainer(
        model=ComposerClassifier(net, num_classes=4),
        train_dataloader=DataLoader(Subset(data, order), batch_size=WORLD * RANK_BATCH),
        max_duration=f'{steps}ba',
        device_train_microbatch_size=RANK_BATCH,
        optimizers=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        callbacks=[Snapshot()],
        device='cpu',
        seed=17,
        progress_bar=False,
        log_to_console=False,
    )
    trainer.fit()
    return snapshots


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    """Launch the 2-rank program once with Composer's launcher; the records of both ranks and the folder."""
    out = tmp_path_factory.mktemp('two_ranks')
    torch.manual_seed(0)
    torch.save(small_net().state_dict(), out / 'initial.pt')
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    }
    env['OMP_NUM_THREADS'] = '1'  # two ranks on a small CPU
    command = [
        sys.executable,
        '-m',
        'composer.cli.launcher',
        '-n',
        str(WORLD),
        '--master_port',
        str(free_port()),
        '--stdout',
        str(out / 'rank{rank}.stdout'),
        '--stderr',
        str(out / 'rank{rank}.stderr'),
        __file__,
        str(out),
    ]
    process = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=300)
    logs = '\n'.join(path.read_text()[-3000:] for path in sorted(out.glob('rank*.std*')))
    assert process.returncode == 0, (
        f'launcher exit {process.returncode}\n{process.stdout[-3000:]}\n{process.stderr[-5000:]}\n{logs}'
    )
    return [torch.load(out / f'rank{r}.pt', weights_only=False) for r in range(WORLD)], out


@pytest.fixture(scope='module')
def reference(two_ranks):
    return _reference(two_ranks[1] / 'initial.pt', 2 * STEPS)


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f'{what} {name}: {m}'
        )


def test_ranks_start_like_composers_launcher(two_ranks):
    ranks, _ = two_ranks
    for rank, record in enumerate(ranks):
        env = record['env']
        assert (env['RANK'], env['LOCAL_RANK'], env['WORLD_SIZE'], env['LOCAL_WORLD_SIZE'], env['NODE_RANK']) == (
            str(rank),
            str(rank),
            '2',
            '2',
            '0',
        )
        assert env['MASTER_ADDR'] == '127.0.0.1'


@pytest.mark.parametrize('run', ['ddp', 'resumed'])
def test_ddp_gradients_and_buckets_are_nhwc_with_no_stride_warning(two_ranks, run):
    ranks, _ = two_ranks
    for record in ranks:
        # INIT restrides the bare model; the Trainer wraps it in DDP afterwards.
        assert (record[run]['init_model'], record[run]['wrapped_model']) == (
            'ComposerClassifier',
            'DistributedDataParallel',
        )
        assert record[run]['warnings'] == []
        # The 3x3, depthwise and 1x1 weights, as DDP saw them when it built its buckets.
        wrapped_strides = record[run]['param_strides']
        assert list(wrapped_strides) == ['0.weight', '3.weight', '4.weight']
        assert len(record[run]['grads']) == STEPS
        for step in record[run]['grads']:
            for name, (param_stride, grad_stride) in step.items():
                assert param_stride == wrapped_strides[name], f'{run} {name}: weight restrided after wrapping'
                assert grad_stride == param_stride, f'{run} {name}: grad {grad_stride} vs weight {param_stride}'
        # Every bucket holds every 4D gradient in NHWC byte order, every step (for the 1x1 and
        # depthwise kernels NHWC and NCHW order are the same bytes: their strides, above, and
        # the absent warning, which compares strides, cover them).
        buckets = record[run]['buckets']
        assert sum(len(seen) for seen in buckets) == 3 * STEPS
        assert all(all(seen.values()) for seen in buckets), buckets


def test_ddp_weights_are_real_channels_last_including_1x1_and_depthwise(two_ranks):
    ranks, _ = two_ranks
    strides = ranks[0]['ddp']['param_strides']
    for name, shape in (('0.weight', (8, 3, 3, 3)), ('3.weight', (8, 1, 3, 3)), ('4.weight', (16, 8, 1, 1))):
        assert strides[name] == channels_last_strides(torch.Size(shape)), name


def test_ddp_audit_finds_no_layout_break(two_ranks):
    ranks, _ = two_ranks
    for record in ranks:
        steps, ok, table = record['ddp']['audit']
        assert (steps, ok) == (STEPS, True), table


def test_ddp_ranks_agree_and_match_one_process_over_the_global_batch(two_ranks, reference):
    ranks, _ = two_ranks
    for run, step in (('ddp', STEPS), ('resumed', 2 * STEPS)):
        first, second = (record[run]['parameters'] for record in ranks)
        for name in first:
            assert torch.equal(first[name], second[name]), f'{run}: {name} differs between ranks'
        _assert_close(first, reference[step], f'{run} vs one process:')


def test_fsdp2_with_channels_last_matches_fsdp2_without(two_ranks):
    # Not against the one-process run: FSDP2 on gloo sums the ranks' gradients instead of
    # averaging them in torch 2.7 (pytorch/pytorch#162338), with or without ChannelsLast.
    ranks, _ = two_ranks
    _assert_close(ranks[0]['fsdp2']['parameters'], ranks[0]['fsdp2_nchw']['parameters'], 'fsdp2 vs fsdp2 NCHW:')


def test_checkpoint_is_written_by_rank_0_and_loads_into_a_plain_nchw_model(two_ranks):
    ranks, out = two_ranks
    files = sorted(p.name for p in (out / 'checkpoints').iterdir())
    assert files == [f'ep0-ba{STEPS}-rank0.pt', 'latest-rank0.pt']  # and nothing from rank 1
    state = torch.load(out / 'checkpoints' / files[0], weights_only=False)['state']['model']
    plain = small_net()
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')
    plain.load_state_dict(state)
    assert all(p.stride() == torch.empty(p.shape, device='meta').stride() for p in plain.parameters())
    plain.eval()
    with torch.no_grad():
        output = plain(probe_images())
    torch.testing.assert_close(output, ranks[0]['ddp']['probe_output'], rtol=1e-5, atol=1e-6)


def test_fsdp2_keeps_weights_contiguous_and_activations_nhwc(two_ranks):
    ranks, _ = two_ranks
    for record in ranks:
        fsdp = record['fsdp2']
        assert fsdp['wrapped_model'] == 'ComposerClassifier'  # Composer shards its submodules in place: no DDP
        assert any('weights contiguous, activations NHWC (FSDP2Config' in line for line in fsdp['log']), fsdp['log']
        assert fsdp['warnings'] == []
        layouts = fsdp['conv_layouts']
        assert len(layouts) == 3 * STEPS
        # Input NHWC and weight contiguous: the convolution computes, and returns, NHWC.
        assert all(layout == (True, True, True) for layout in layouts), layouts


def test_restriding_after_ddp_is_built_warns_and_the_guard_refuses_it(two_ranks):
    ranks, _ = two_ranks
    for record in ranks:
        assert 'already wrapped in DistributedDataParallel' in record['guard_refuses_ddp']
        assert 'then wrap it' in record['guard_refuses_ddp']
        assert 'DistributedDataParallel wraps it' in record['restride_after_wrap_refused']
        assert record['restrided_after_wrap_warnings'], 'the stride warning check would miss a real mismatch'


# --- the decision, in this process ----------------------------------------------------------------


def test_plain_model_gets_channels_last_weights():
    plan = weight_layout_for(small_net())
    assert plan == WeightLayoutPlan(False, plan.reason) and plan.memory_format == 'channels_last'


@pytest.mark.parametrize('config', ['FSDPConfig', 'FSDP2Config', 'TPConfig'])
def test_composer_sharding_configs_keep_weights_contiguous(config):
    import composer.utils.parallelism as parallelism

    plan = weight_layout_for(
        small_net(), **{('tp_config' if config == 'TPConfig' else 'fsdp_config'): getattr(parallelism, config)()}
    )
    assert plan.contiguous and not plan.sharded and plan.memory_format == 'channels_first'
    assert config in plan.reason


def test_contiguous_plan_restores_weights_made_channels_last_and_still_computes_nhwc():
    from composer.utils import FSDP2Config

    torch.manual_seed(0)
    reference_net = small_net()
    net = small_net()
    net.load_state_dict(reference_net.state_dict())
    net.to(memory_format=torch.channels_last)  # as done before the Trainer, which FSDP2 would refuse
    guard = LayoutGuard(mode='auto')
    summary = guard.on_init(net, weight_layout=weight_layout_for(net, fsdp_config=FSDP2Config()))
    assert guard.effective_mode == 'on'  # auto would time channels-last weights
    assert summary.converted == ['0.weight', '3.weight', '4.weight']
    assert all(p.stride() == torch.empty(p.shape, device='meta').stride() for p in net.parameters())

    images = probe_images()
    batch = guard.on_batch(images)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    activations = []
    net[0].register_forward_hook(lambda module, inputs, output: activations.append(output))
    output = net(batch)
    assert activations[0].is_contiguous(memory_format=torch.channels_last)
    output.sum().backward()
    expected = reference_net(images)
    expected.sum().backward()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(net.named_parameters(), reference_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
        assert p.grad.is_contiguous(), name


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize('wrap', ['fsdp1', 'fsdp2'])
def test_models_already_sharded_are_left_alone_and_run_nhwc(one_rank_group, wrap):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    net = small_net()
    model = FullyShardedDataParallel(net, device_id=torch.device('cpu')) if wrap == 'fsdp1' else fully_shard(net)
    before = [(name, p.stride(), p.data_ptr()) for name, p in model.named_parameters()]
    guard = LayoutGuard()
    summary = guard.on_init(model)
    assert guard.weight_layout.contiguous and guard.weight_layout.sharded
    assert ('FSDP1' if wrap == 'fsdp1' else 'FSDP2') in guard.weight_layout.reason
    assert summary.converted == []
    assert [(name, p.stride(), p.data_ptr()) for name, p in model.named_parameters()] == before
    output = model(guard.on_batch(probe_images()))
    output.sum().backward()
    assert output.shape == (5, 4)


def test_guard_refuses_a_model_already_wrapped_in_ddp(one_rank_group):
    wrapped = nn.parallel.DistributedDataParallel(small_net())
    with pytest.raises(ValueError, match='already wrapped in DistributedDataParallel.*then wrap it'):
        LayoutGuard().on_init(wrapped)


class _ViewsAWeight(nn.Module):
    """From its second call the forward views a convolution's weight (a penalty by filter)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.head(self.conv(images).mean((2, 3)))
        return out + 1e-3 * self.conv.weight.view(8, -1).norm(dim=1).sum() if self.calls >= 2 else out


def _ddp_steps(options: Optional[dict]) -> dict[str, torch.Tensor]:
    """Three float64 DDP steps of _ViewsAWeight; through a guard with ``options`` unless None."""
    torch.manual_seed(0)
    net = _ViewsAWeight().double()
    guard = None if options is None else LayoutGuard(**options)
    if guard is not None:
        guard.on_init(net)
    model = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            images = torch.rand(2, 3, 8, 8, generator=generator, dtype=torch.float64)
            optimizer.zero_grad()
            with guard.step() if guard is not None else contextlib.nullcontext():
                model(guard.on_batch(images) if guard is not None else images).sum().backward()
            optimizer.step()
    finally:
        if guard is not None:
            guard.close()
    return parameters_of(net)


def test_a_weight_viewed_under_ddp_is_refused_and_weights_contiguous_trains_as_nchw(one_rank_group):
    with pytest.raises(RuntimeError, match="DistributedDataParallel wraps it.*weights='contiguous'"):
        _ddp_steps({})
    _assert_close(_ddp_steps({'weights': 'contiguous'}), _ddp_steps(None), "weights='contiguous'")


if __name__ == '__main__':
    _run_rank(Path(sys.argv[1]))
