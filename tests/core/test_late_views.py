"""A ``.view()`` first reached after the watched steps runs as in NCHW (``core/late_views.py``).

The view watch follows the first training step and the first batch of each loop; code first run later (a branch a
schedule switches on, a gradient norm every k steps) used to raise "view size is not compatible". Each model here
takes such a branch from its third call: it trains 5 float64 steps through LayoutGuard, the Composer algorithm and
the Lightning callback, and every step's loss and parameters must equal the NCHW run's. The views: an activation's
(read, and written through), a view of ``z.flatten(2)``, ``view_as``, a weight's in the forward, a weight's gradient
after the backward, and a gradient's in a tensor hook during the backward.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.late_views import COMPILED_VIEW, RAN_BEFORE_THE_BREAK, UNWATCHED_VIEW, original

LATE = 3  # the call from which the branch runs


class LateBranch(nn.Module):
    """Two convolutions and a linear head; from the ``LATE``-th call on, ``what`` views something."""

    def __init__(self, what: str, evaluation_only: bool = False) -> None:
        super().__init__()
        self.what, self.calls, self.evaluation_only = what, 0, evaluation_only  # count evaluation calls only
        self.c0, self.c1 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def late(self) -> bool:
        self.calls += not (self.evaluation_only and self.training)
        return self.calls >= LATE

    def forward(self, x):
        late = self.late()
        y = F.relu(self.c0(x))
        if late and self.what == 'gradient in a hook' and y.requires_grad:
            y.register_hook(_halve_through_a_view)
        z = self.c1(y)
        n = z.size(0)
        if late and self.what == 'activation':
            return self.fc(z.view(n, -1))
        if late and self.what == 'write through':
            z.view(-1)[:7] = 0.0
        if late and self.what == 'flattened':
            return self.fc(z.flatten(2).view(n, -1))
        if late and self.what == 'view_as':
            return self.fc(z.view_as(torch.empty(n, 4 * 8 * 8)))
        if late and self.what == 'bits':  # float64 values truncated to their high words through an int32 view
            z.detach().view(torch.int32)[..., 0::2] = 0
        if late and self.what == 'weight':
            return self.fc(z.flatten(1)) + self.c1.weight.view(4, -1).sum(1).mean()
        return self.fc(z.flatten(1))


def _halve_through_a_view(grad: torch.Tensor) -> None:
    grad.view(grad.size(0), -1).mul_(0.5)


def _halve_filter_gradients(net: nn.Module) -> None:
    """From the ``LATE``-th step: each filter's gradient halved through ``grad.view(out_channels, -1)``."""
    if net.calls >= LATE:
        grad = net.c1.weight.grad
        grad.view(grad.size(0), -1).mul_(0.5)


def _run(what: str) -> Run:
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(2, 3, 8, 8, generator=generator, dtype=torch.float64), torch.randint(0, 5, (2,))) for _ in range(5)
    ]
    after_backward = _halve_filter_gradients if what == 'gradient' else lambda net: None
    return Run(
        build=lambda: LateBranch(what),
        batches=batches,
        loss=lambda output, batch: F.cross_entropy(output, batch[1]),
        after_backward=after_backward,
    )


CASES = ('activation', 'write through', 'flattened', 'view_as', 'bits', 'weight', 'gradient', 'gradient in a hook')


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('what', CASES)
def test_a_view_first_reached_after_the_watched_steps_matches_nchw(integration, what):
    run = _run(what)
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{integration}, {what}')
    assert torch.Tensor.view is original(torch.Tensor.view)  # torch's own method again once the steps are over


class CompiledLateBranch(LateBranch):
    """Its calls counted outside the graph: ``late`` a flag dynamo guards on (one graph each way)."""

    is_late = False

    def late(self) -> bool:
        return self.is_late


def _compiled_forward(net: nn.Module, batch: tuple) -> torch.Tensor:
    """``net`` compiled once (kept outside its modules), run on the images; the branch switches on from the
    ``LATE``-th call."""
    compiled = net.__dict__.get('_compiled')
    if compiled is None:
        compiled = net.__dict__['_compiled'] = torch.compile(net, backend='aot_eager')
    net.calls += 1
    net.is_late = net.calls >= LATE
    return compiled(batch[0])


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('what', ('activation', 'write through', 'flattened', 'view_as', 'weight'))
def test_a_compiled_network_traced_again_down_a_path_that_views_matches_nchw(integration, what):
    """Dynamo traces the network again when the branch switches on, and refuses the view as it traces: the
    network is rehearsed eagerly under a watch, which places the view's maker, and the call runs again."""
    run = dataclasses.replace(_run(what), build=lambda: CompiledLateBranch(what), forward=_compiled_forward)
    steps, _, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{integration}, compiled, {what}')


def test_a_network_that_holds_its_own_compiled_wrapper_is_collected_with_it():
    """The retry keeps a wrapper's inner modules weakly: a network that holds its compiled wrapper in an attribute
    (as ``CompiledLateBranch`` does) and the wrapper are collected once the run lets them go. In a process of its
    own: the log records of dynamo's refused trace, which a test run keeps, hold the wrapper's frames."""
    here = pathlib.Path(__file__).resolve().parent
    code = (
        'import dataclasses, gc, weakref\n'
        'import test_late_views as t\n'
        'from guarded_runs import guarded\n'
        "run = dataclasses.replace(t._run('activation'), build=lambda: t.CompiledLateBranch('activation'),\n"
        '                          forward=t._compiled_forward)\n'
        "steps, net, guard = guarded(run, 'guard')\n"
        "wrapper = weakref.ref(net.__dict__['_compiled'])\n"
        'del steps, net, guard\n'
        'gc.collect()\n'
        'assert wrapper() is None\n'
    )
    path = os.pathsep.join(str(p) for p in (here.parent, here, here.parent.parent))
    done = subprocess.run(
        [sys.executable, '-c', code],
        cwd=here.parent,  # the tests' conftest, not the root's
        env={**os.environ, 'PYTHONPATH': path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


class CountingNet(nn.Module):
    """A forward that counts its calls in an attribute of its own (a warm-up ramp kept in the model), and views an
    activation."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.head, self.calls = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 5), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.c(x) * min(1.0, self.calls / 3)
        return self.head(x.view(x.size(0), -1))


@pytest.mark.parametrize('integration', INTEGRATIONS)
def test_the_rehearsal_of_a_compiled_network_leaves_the_count_its_forward_keeps_as_it_was(integration):
    """The first step rehearses a compiled network eagerly, to place the view's maker: the count its forward
    advances is put back after, so the real call counts once, as in NCHW."""
    run = dataclasses.replace(_run('activation'), build=lambda: torch.compile(CountingNet(), backend='aot_eager'))
    steps, net, _ = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{integration}, compiled, counting')
    assert net._orig_mod.calls == len(run.batches)


class BreakingLateBranch(nn.Module):
    """Counts its training calls outside the graph (a graph break before the branch, so that dynamo keeps the
    convolutions' graph cached when it traces the branch); ``normalized``: a BatchNorm before the break."""

    def __init__(self, late: int, normalized: bool = False) -> None:
        super().__init__()
        self.late, self.calls = late, 0
        self.c0, self.c1 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4) if normalized else nn.Identity()
        self.fc = nn.Linear(4 * 8 * 8, 5)

    @torch.compiler.disable
    def counted(self) -> int:
        self.calls += self.training
        return self.calls

    def forward(self, x):
        z = self.c1(self.norm(F.relu(self.c0(x))))
        if self.counted() >= self.late:
            return self.fc(z.view(z.size(0), -1))
        return self.fc(z.flatten(1))


def test_a_forward_compiled_on_the_instance_that_views_past_a_graph_break_matches_nchw():
    """``model.forward = torch.compile(model.forward)``: the module runs as a graph, rehearsed as a wrapper's network;
    its late trace sees the placed maker although dynamo had cached the graph before the break. The call that failed
    had counted itself before the break: the count is put back before the call runs again, as in NCHW."""

    def compiled_forward(net: nn.Module, batch: tuple) -> torch.Tensor:
        if 'forward' not in vars(net):
            net.forward = torch.compile(net.forward, backend='aot_eager')
        return net(batch[0])

    run = dataclasses.replace(_run('activation'), build=lambda: BreakingLateBranch(LATE), forward=compiled_forward)
    steps, net, guard = guarded(run, 'guard')
    assert_same_run(steps, nchw(run), 'a forward compiled on the instance')
    assert guard._viewed.placed == ['c1'] and net.calls == len(run.batches)


@pytest.mark.parametrize('late', (0, LATE))
def test_composer_compile_config_with_a_model_that_views_matches_nchw(late):
    """Composer's ``compile_config`` compiles the model's forward on the instance: a view from the first step (a
    classic ``x.view(n, -1)`` flatten) and one first reached later both run as in NCHW."""
    pytest.importorskip('composer')
    from composer.models import ComposerClassifier

    from channels_last_algo.integrations.composer import ChannelsLast

    def run(*algorithms) -> dict:
        torch.manual_seed(0)
        model = ComposerClassifier(BreakingLateBranch(late).double(), num_classes=5)
        _composer_fit(model, algorithms, compile_config={'backend': 'aot_eager'})
        return model.module.state_dict()

    expected, actual = run(), run(ChannelsLast())
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-10, atol=1e-12)


def test_a_late_trace_after_a_graph_break_that_wrote_running_statistics_is_not_run_twice():
    """The BatchNorm before the break updated its statistics when the trace after it failed: the call fails, saying
    why, instead of updating them twice."""
    net = BreakingLateBranch(LATE, normalized=True).double()
    net.forward = torch.compile(net.forward, backend='aot_eager')
    guard = LayoutGuard()
    guard.on_init(net)
    images, forwards = torch.randn(2, 3, 8, 8, dtype=torch.float64), 0
    with pytest.raises(RuntimeError) as raised:
        for _ in range(LATE):
            forwards += 1
            with guard.step():
                net(guard.on_batch(images)).sum().backward()
            guard.on_batch_end()
    guard.close()
    assert RAN_BEFORE_THE_BREAK in getattr(raised.value, '__notes__', []), raised.value
    assert COMPILED_VIEW not in getattr(raised.value, '__notes__', [])
    assert int(net.norm.num_batches_tracked) == forwards  # once a call, the failed one's included


def test_a_compiled_function_that_calls_the_model_and_views_fails_with_a_note_that_says_what_would_fix_it():
    """Dynamo traces a compiled function before any eager run of the model it calls: no rehearsal places the view,
    so the step fails as under plain channels last, and says so."""
    net = CompiledLateBranch('activation').double()
    net.is_late = True
    guard = LayoutGuard()
    guard.on_init(net)
    loss = torch.compile(lambda images: net(images).sum(), backend='aot_eager')
    with pytest.raises(RuntimeError) as raised:
        with guard.step():
            loss(guard.on_batch(torch.randn(2, 3, 8, 8, dtype=torch.float64))).backward()
    guard.close()
    assert COMPILED_VIEW in getattr(raised.value, '__notes__', []), raised.value


def test_an_activation_viewed_late_is_placed_on_the_next_step(caplog):
    """The late view runs on a copy kept in step; the next step is watched whole and finds the module that made
    the tensor, which returns it channels first from then on, so the steps after run unwatched."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, guard = guarded(_run('activation'), 'guard')
    said = [record.getMessage() for record in caplog.records]
    late = [line for line in said if 'first run after the watched steps' in line]
    assert len(late) == 1 and 'test_late_views.py' in late[0], said
    assert guard._viewed.placed == ['c1'], said
    assert net.c0(torch.randn(1, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)).is_contiguous(
        memory_format=torch.channels_last
    )


def test_a_weight_viewed_late_makes_the_weights_contiguous(caplog):
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, _ = guarded(_run('weight'), 'guard')
    assert net.c1.weight.is_contiguous() and not net.c1.weight.is_contiguous(memory_format=torch.channels_last)
    assert any('weights contiguous' in record.getMessage() for record in caplog.records)


def _evaluated(net: nn.Module, guard: LayoutGuard, batches: list, loop) -> list[torch.Tensor]:
    outputs = []
    with torch.no_grad():
        for images in batches:
            outputs.append(net(guard.on_batch(images, loop=loop)))
            guard.on_batch_end()
    return outputs


def test_a_later_batch_of_a_named_loop_takes_a_late_view_and_an_unnamed_one_does_not():
    """A batch of a named loop is watched, or armed, until its end: a view first reached in a later batch's forward
    runs there, and the next batch's watch places the module. An unnamed batch (a plain loop's ``on_batch(images)``)
    ends with no word from its loop, so nothing is armed past its start: the view raises as under plain channels
    last."""
    batches = [torch.full((2, 3, 8, 8), float(k), dtype=torch.float64) for k in range(4)]
    net = LateBranch('activation').double().eval()
    with torch.no_grad():
        expected = [net(images) for images in batches]
    net.calls, unnamed = 0, LateBranch('activation').double().eval()
    unnamed.load_state_dict(net.state_dict())
    guard = LayoutGuard()
    guard.on_init(net)
    for output, reference in zip(_evaluated(net, guard, batches, loop='validate'), expected):
        torch.testing.assert_close(output, reference, rtol=1e-10, atol=1e-10)
    assert guard._viewed.placed == ['c1'] and torch.Tensor.view is original(torch.Tensor.view)
    guard.close()

    guard = LayoutGuard()
    guard.on_init(unnamed)
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        _evaluated(unnamed, guard, batches, loop=None)
    guard.close()


def _past_the_watched_step() -> tuple[LateBranch, LayoutGuard]:
    """A model that takes no late branch, and its guard, after a watched and an unwatched training step."""
    net = LateBranch('none').double()
    guard = LayoutGuard()
    guard.on_init(net)
    for _ in range(2):
        with guard.step():
            net(guard.on_batch(torch.randn(2, 3, 8, 8, dtype=torch.float64))).sum().backward()
    return net, guard


def test_a_view_that_fails_in_nchw_too_keeps_torchs_error():
    """Only views that NHWC strides refuse are taken: a transposed matrix's ``.view(-1)`` fails as in NCHW."""
    net, guard = _past_the_watched_step()
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        with guard.step():
            torch.randn(3, 4).t().view(-1)
    assert not guard._viewed.watching


def test_a_view_on_another_thread_is_not_taken_and_the_step_says_what_would_fix_it():
    """A thread the step did not arm (a pool's; autograd's GPU threads run backward hooks there) gets torch's
    error, which no watch can take from the training loop's thread; the guard's step adds what would fix it."""
    net, guard = _past_the_watched_step()

    def view_there() -> torch.Tensor:
        return net.c0(torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)).view(2, -1)

    with pytest.raises(RuntimeError, match='view size is not compatible') as caught:
        with guard.step(), concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(view_there).result()
    assert UNWATCHED_VIEW in str(caught.value) + ''.join(getattr(caught.value, '__notes__', []))
    assert torch.Tensor.view is original(torch.Tensor.view)


def _composer_fit(model: nn.Module, algorithms: tuple, **options) -> None:
    """4 batches of SGD through Composer's Trainer with ``algorithms`` and the Trainer ``options``."""
    from composer import Trainer

    trainer = Trainer(
        model=model,
        train_dataloader=_evaluation_batches(),
        max_duration='4ba',
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        device='cpu',
        algorithms=list(algorithms),
        progress_bar=False,
        **options,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()


def _evaluation_batches() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(2)
    images = torch.randn(8, 3, 8, 8, generator=generator, dtype=torch.float64)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, torch.randint(0, 5, (8,), generator=generator)), batch_size=2
    )


def _assert_same_evaluations(actual: tuple, expected: tuple) -> None:
    (read, weights), (expected_read, expected_weights) = actual, expected
    assert len(read) == len(expected_read) == 4
    for got, want in zip(read, expected_read):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, want in expected_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-10, atol=1e-10)


def test_lightning_a_later_validation_that_views_matches_nchw():
    """The second validation takes a branch that views: its first batch starts the watch there, its second
    is watched whole, and every output and the weights equal the NCHW run's."""
    pytest.importorskip('lightning')
    import lightning as L

    from channels_last_algo.integrations.lightning import ChannelsLastCallback
    from conftest import lightning_trainer

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net, self.read = LateBranch('activation', evaluation_only=True).double(), []

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.read.append(self.net(batch[0]).detach())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(*callbacks) -> tuple:
        module = Classifier()
        trainer = lightning_trainer(callbacks=list(callbacks), max_epochs=2, limit_train_batches=2, limit_val_batches=2)
        trainer.fit(module, train_dataloaders=_evaluation_batches(), val_dataloaders=_evaluation_batches())
        return module.read, module.net.state_dict()

    callback = ChannelsLastCallback()
    _assert_same_evaluations(run(callback), run())
    assert callback.guard._viewed.placed == ['net.c1'] and callback.guard._viewed._late_places


def test_composer_a_later_evaluation_that_views_matches_nchw():
    pytest.importorskip('composer')
    from composer.models import ComposerModel

    from channels_last_algo.integrations.composer import ChannelsLast

    class Classifier(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.module, self.read = LateBranch('activation', evaluation_only=True).double(), []

        def forward(self, batch):
            return self.module(batch[0])

        def loss(self, outputs, batch):
            return F.cross_entropy(outputs, batch[1])

        def eval_forward(self, batch, outputs=None):
            self.read.append(self(batch).detach())
            return self.read[-1]

        def get_metrics(self, is_train=False):
            return {}

    def run(*algorithms) -> tuple:
        model = Classifier()
        _composer_fit(
            model, algorithms, eval_dataloader=_evaluation_batches(), eval_interval='2ba', eval_subset_num_batches=2
        )
        return model.read, model.module.state_dict()

    algorithm = ChannelsLast()
    _assert_same_evaluations(run(algorithm), run())
    assert algorithm.guard._viewed.placed == ['module.c1'] and algorithm.guard._viewed._late_places


def test_a_permuted_nchw_tensor_that_nchw_cannot_view_keeps_torchs_error():
    """A 4D tensor the package did not lay out (a permute of a contiguous one) fails its view as in NCHW."""
    _, guard = _past_the_watched_step()
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        with guard.step():
            torch.randn(2, 3, 4, 4).permute(0, 2, 3, 1).view(2, -1)
    assert not guard._viewed.watching


def test_a_batch_begun_inside_the_step_is_the_steps():
    """A plain loop may call ``guard.on_batch`` inside ``guard.step()``: that batch is the step's, so the first step
    is watched once and the later ones run unwatched, armed for a view first reached there (before, each such batch
    ended the step's watch and every step was watched, at the cost of following each op)."""
    net, guard = _past_the_watched_step()
    with guard.step():
        batch = guard.on_batch(torch.randn(2, 3, 8, 8, dtype=torch.float64))
        assert not guard._viewed.watching and torch.Tensor.view is not original(torch.Tensor.view)
        z = net.c1(F.relu(net.c0(batch)))
        expected = z.detach().contiguous().view(2, -1).clone()
        torch.testing.assert_close(z.view(2, -1), expected)  # a view first reached here: the watch starts
        net.fc(z.flatten(1)).sum().backward()
    guard.close()
    assert torch.Tensor.view is original(torch.Tensor.view)
