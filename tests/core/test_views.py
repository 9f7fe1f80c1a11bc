"""Code that ``.view()``s activations, weights or gradients runs under the package as it runs in NCHW.

Each model trains 3 float64 steps through LayoutGuard, the Composer algorithm and the Lightning callback,
and every step's loss and parameters must equal the NCHW run's: a LeNet-style flatten, a loss that views
a convolution's output, a forward hook and a tensor hook that view, writes through views (of
activations, of a gradient in a tensor hook, of ``weight.data``), LBFGS (``p.grad.view(-1)``),
``parameters_to_vector`` with ``weights='contiguous'``, a Muon-style optimizer, a weight bank that the model
views and mixes, a positional embedding added to an activation, and writes through ``.reshape()``,
``.flatten()`` and ``.contiguous()`` copies that NCHW has as aliases (of activations, a gradient, a
weight, a batch tensor), and through what NHWC views where NCHW copies (a permute's reshape, a
channels-last ``.contiguous()``), reads and writes through ``.as_strided()`` with NCHW's strides, and a
teacher outside the model that views its activations, a WGAN-GP penalty that views an input gradient,
backward hooks registered with the model (on a weight, on a module) that view their gradients, per-sample
gradients unfolded in a backward hook as Opacus does (``.as_strided()`` strides partly from ``x.stride()``),
a custom autograd Function whose forward and backward view (autograd runs the backward outside every mode), and
values truncated in place through a view as another dtype (``z.detach().view(torch.int32)``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import types
import warnings

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.late_views import SCRIPTED_VIEW, UNWATCHED_VIEW
from conftest import lightning_trainer

EACH_INTEGRATION = pytest.mark.parametrize('integration', INTEGRATIONS)


def _batches(shape=(2, 3, 32, 32), classes=10, steps=3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(shape, generator=generator, dtype=torch.float64), torch.randint(0, classes, (shape[0],)))
        for _ in range(steps)
    ]


def _cross_entropy(output, batch):
    return F.cross_entropy(output, batch[1])


class LeNet(nn.Module):
    """The tutorials' LeNet: ``x.view(-1, 16 * 5 * 5)`` after a convolution and a pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 5 * 5, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc(x.view(-1, 16 * 5 * 5))


class BitsTruncated(LeNet):
    """Each activation's float64 values truncated to their high 32 bits in place: ``z.detach().view(torch.int32)``
    (twice the last size: a view NHWC's last stride refuses) zeroing the low words: a value-only rounding that
    autograd does not see, as quantization emulators write it."""

    def forward(self, x):
        z = self.pool(F.relu(self.conv1(x)))
        z.detach().view(torch.int32)[..., 0::2] = 0  # the low word of each value, on a little-endian machine
        z = self.pool(F.relu(self.conv2(z)))
        return self.fc(z.flatten(1))


class DenseHead(nn.Module):
    """A detector-style head whose loss views the class map as (N * K, H * W)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.logits = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.logits(F.relu(self.stem(x)))


def _heatmap_loss(output, batch):
    n, k, h, w = output.shape
    return F.cross_entropy(output.view(n * k, h * w), torch.zeros(n * k, dtype=torch.long))


class Hooked(nn.Module):
    """A forward hook views the stem's output (feature extraction); a tensor hook views its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Sequential(nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
        self.features: list[torch.Tensor] = []
        self.stem.register_forward_hook(lambda m, args, out: self.features.append(out.view(out.size(0), -1).sum(1)))

    def forward(self, x):
        x = F.relu(self.stem(x))
        if x.requires_grad:
            x.register_hook(lambda grad: grad.view(grad.size(0), -1).clone().view(grad.shape))
        return self.head(x)


class WeightBank(nn.Module):
    """A dynamic convolution: a (K, C_out, C_in, k, k) bank viewed as (K, -1) and mixed per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bank = nn.Parameter(torch.randn(2, 4, 4, 3, 3) / 6)
        self.route = nn.Linear(4, 2)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x):
        x = self.stem(x)
        mix = torch.softmax(self.route(x.mean((2, 3))).mean(0), 0)
        weight = (mix @ self.bank.view(2, -1)).view(self.bank.shape[1:])
        return self.head(F.conv2d(x, weight, padding=1))


class Embedded(nn.Module):
    """A (1, C, H, W) positional embedding added to an activation, then viewed as tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 4, stride=4)
        self.pos_embed = nn.Parameter(torch.randn(1, 4, 8, 8) / 10)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        x = self.stem(x)
        tokens = self.pos_embed.view(1, 4, 64) + x.flatten(2)
        return self.fc(tokens.mean(2))


class Penalised(nn.Module):
    """Returns its logits and a penalty on all its weights, flattened by ``parameters_to_vector``
    (each weight's ``.view(-1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _flat_net()

    def forward(self, x):
        return self.net(x), 1e-3 * torch.nn.utils.parameters_to_vector(self.parameters()).pow(2).sum()


def _penalised_loss(output, batch):
    logits, penalty = output
    return F.cross_entropy(logits, batch[1]) + penalty


def _compiled_forward(net: nn.Module, batch: tuple) -> torch.Tensor:
    """``net`` compiled once (kept outside its modules), run on the images."""
    compiled = net.__dict__.get('_compiled')
    if compiled is None:
        compiled = net.__dict__['_compiled'] = torch.compile(net, backend='aot_eager')
    return compiled(batch[0])


class WrittenThroughViews(nn.Module):
    """Writes through views of activations, which alias them in NCHW: a convolution's output scaled
    through ``z.view(n, -1)``, and a slice of another zeroed through a chained view
    (``y.view(n, c, h * w).view(n, -1)``, whose second view NHWC strides cannot take)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mid = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x):
        z = self.stem(x)
        z.view(z.size(0), -1).mul_(1.5)
        y = self.mid(F.relu(z))
        flat = y.view(y.size(0), 4, -1).view(y.size(0), -1)
        flat[:, :10] = 0
        return self.head(y)


class GradientScaledInPlace(nn.Module):
    """A tensor hook that scales its gradient in place through a view and returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Sequential(nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x):
        x = F.relu(self.stem(x))
        if x.requires_grad:
            x.register_hook(self._scale)
        return self.head(x)

    @staticmethod
    def _scale(grad):
        grad.view(grad.size(0), -1).mul_(2.0)


class MaxNormed(nn.Module):
    """A max-norm constraint written through ``weight.data.view(out_channels, -1)`` in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x):
        with torch.no_grad():
            rows = self.stem.weight.data.view(self.stem.weight.size(0), -1)
            rows.mul_(0.5 / rows.norm(dim=1, keepdim=True).clamp(min=0.5))
        return self.head(F.relu(self.stem(x)))


class _ThreeConvolutions(nn.Module):
    """``stem``, ``mid`` and ``last`` convolutions of 4 channels, and a pooled linear ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mid, self.last = (nn.Conv2d(c, 4, 3, padding=1) for c in (3, 4, 4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


class WrittenThroughReshapes(_ThreeConvolutions):
    """Writes through copies that NCHW has as aliases: ``z.reshape(n, -1).mul_()``, ``y = z.contiguous();
    y += 1`` and ``z.flatten(2).reshape(n, -1)[:, :10] = 0`` each change the activation in NCHW. A
    channel shuffle's ``.contiguous()`` (a copy in NCHW too) is written without reaching the activation."""

    def forward(self, x):
        z = self.stem(x)
        z.reshape(z.size(0), -1).mul_(1.5)
        y = self.mid(F.relu(z))
        y.contiguous().add_(1.0)
        w = self.last(F.relu(y))
        w.flatten(2).reshape(w.size(0), -1)[:, :10] = 0
        n, c, h, width = w.shape
        shuffled = w.view(n, 2, c // 2, h, width).transpose(1, 2).contiguous()
        shuffled.mul_(2.0)
        return self.head(w + shuffled.view(n, c, h, width))


class WrittenThroughNhwcViews(_ThreeConvolutions):
    """Writes through what NCHW copies and NHWC views: ``z.permute(0, 2, 3, 1).reshape(-1, c)``, and
    ``y.contiguous(memory_format=torch.channels_last)`` (``y`` itself in NHWC); each write leaves the
    activation as it was in NCHW. A detector head's ``permute(...).reshape(n, -1, k)`` that nothing
    writes is left a view."""

    def forward(self, x):
        z = self.stem(x)
        z.permute(0, 2, 3, 1).reshape(-1, 4).mul_(3.0)
        y = self.mid(F.relu(z))
        y.contiguous(memory_format=torch.channels_last).add_(1.0)
        w = self.last(F.relu(y))
        n = w.size(0)
        anchors = w.view(n, 2, 2, 8, 8).permute(0, 3, 4, 1, 2).reshape(n, -1, 2)
        return self.head(w) + anchors.mean(1).sum(1, keepdim=True)


class GradientReshapedInPlace(GradientScaledInPlace):
    """A tensor hook that scales its gradient in place through ``grad.reshape(n, -1)``, a view in NCHW."""

    @staticmethod
    def _scale(grad):
        grad.reshape(grad.size(0), -1).mul_(2.0)


class MaxNormedThroughReshape(MaxNormed):
    """A max-norm written through ``weight.reshape(out_channels, -1)`` under ``no_grad``, a view in NCHW."""

    def forward(self, x):
        with torch.no_grad():
            rows = self.stem.weight.reshape(self.stem.weight.size(0), -1)
            rows.mul_(0.5 / rows.norm(dim=1, keepdim=True).clamp(min=0.5))
        return self.head(F.relu(self.stem(x)))


class ReadThroughAsStrided(_ThreeConvolutions):
    """Sliding 2 x 2 windows through ``z.as_strided()`` with strides written for NCHW memory (from the
    shape), a write through another such view, and windows whose strides come from ``y.stride()``."""

    def forward(self, x):
        z = self.stem(x)
        n, c, h, w = z.shape
        windows = z.as_strided((n, c, h - 1, w - 1, 2, 2), (c * h * w, h * w, w, 1, w, 1))
        y = self.mid(F.relu(z) + F.pad(windows.amax((-1, -2)), (0, 1, 0, 1)))
        torch.as_strided(y, (n, c, w), (c * h * w, h * w, 1), storage_offset=y.storage_offset())[:, :, :3] = 0
        sn, sc, sh, sw = y.stride()
        pooled = y.as_strided((n, c, h // 2, w // 2, 2, 2), (sn, sc, 2 * sh, 2 * sw, sh, sw)).mean((-1, -2))
        return self.head(self.last(y + F.interpolate(pooled, scale_factor=2.0)))


class BatchMixedInPlace(LeNet):
    """CutMix written into its input batch in place, then the batch's first pixels zeroed through
    ``x.view(n, -1)``; neither is idempotent, so a write lost or doubled shows."""

    def forward(self, x):
        x[:, :, 4:12, 4:12] = x.flip(0)[:, :, 4:12, 4:12] * 0.5
        x.view(x.size(0), -1)[:, :50] = 0
        return super().forward(x)


class GradientPenalised(nn.Module):
    """A WGAN-GP critic: a penalty on the gradient with respect to interpolates of the batch and its
    mirror image, flattened with ``gradients.view(n, -1)``. No module makes a gradient, whatever
    module made what it is taken with respect to."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = _flat_net()

    def forward(self, x):
        alpha = torch.linspace(0.2, 0.8, x.size(0), dtype=x.dtype).view(-1, 1, 1, 1)
        interpolates = (alpha * x + (1 - alpha) * x.flip(-1)).requires_grad_(True)
        (gradients,) = torch.autograd.grad(self.critic(interpolates).sum(), interpolates, create_graph=True)
        penalty = ((gradients.view(gradients.size(0), -1).norm(2, dim=1) - 1) ** 2).mean()
        return self.critic(x) + penalty


class ActivationGradientPenalised(_ThreeConvolutions):
    """A penalty on the gradient with respect to an activation, flattened with ``g.view(n, -1)``: making
    the activation's module channels first would not make its gradient contiguous."""

    def forward(self, x):
        z = F.relu(self.stem(x))
        (g,) = torch.autograd.grad(self.mid(z).pow(2).sum(), z, create_graph=True)
        return self.head(self.last(F.relu(self.mid(z)))) + g.view(g.size(0), -1).norm(dim=1, keepdim=True).mean()


class HookedAtConstruction(_ThreeConvolutions):
    """Backward hooks registered when the model is built, before any watch: one on ``mid.weight`` that
    normalises each filter's gradient through ``grad.view(out_channels, -1)``, and a full backward hook
    on ``last`` that scales its input gradient through ``grad_input[0].view(n, -1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.mid.weight.register_hook(self._per_filter)
        self.last.register_full_backward_hook(self._scaled)

    @staticmethod
    def _per_filter(grad):
        rows = grad.view(grad.size(0), -1)
        return (rows / (rows.norm(dim=1, keepdim=True) + 1.0)).view_as(grad)

    @staticmethod
    def _scaled(module, grad_input, grad_output):
        flat = grad_input[0].view(grad_input[0].size(0), -1)
        return ((flat * torch.linspace(0.5, 1.5, flat.size(1), dtype=flat.dtype)).view_as(grad_input[0]),)

    def forward(self, x):
        return self.head(self.last(F.relu(self.mid(F.relu(self.stem(x))))))


class PerSampleClipped(_ThreeConvolutions):
    """DP-SGD as Opacus's hooks run it: a forward hook keeps the input of ``mid`` and ``last``, and a full
    backward hook unfolds it into 3 x 3 windows through ``.as_strided()`` whose batch and channel strides
    come from ``x.stride()`` and whose spatial ones are written for NCHW (``opacus.utils.unfold2d``), for
    each sample's weight gradient; after the backward each sample's gradient is clipped to norm 1 and
    their sum is the weight's gradient."""

    def __init__(self) -> None:
        super().__init__()
        for conv in (self.mid, self.last):
            conv.register_forward_hook(self._keep)
            conv.register_full_backward_hook(self._per_sample)

    @staticmethod
    def _keep(module, inputs, output):
        module.kept = inputs[0].detach()

    @staticmethod
    def _per_sample(module, grad_input, grad_output):
        x = F.pad(module.kept, (1, 1, 1, 1))
        n, c, h, w = x.shape
        windows = x.as_strided((n, c, 3, 3, h - 2, w - 2), (*x.stride()[:2], w, 1, w, 1))
        grads = grad_output[0].reshape(n, module.out_channels, -1)
        module.grad_sample = torch.einsum('noq,npq->nop', grads, windows.reshape(n, c * 9, -1))

    def forward(self, x):
        return self.head(self.last(F.relu(self.mid(F.relu(self.stem(x))))))


class PerSampleClippedSquare(PerSampleClipped):
    """:class:`PerSampleClipped` with 10 channels on 8 x 8 maps, padded to 10 x 10: the windows' strides, the
    channel count's and the padded width's, are the same numbers in NCHW and NHWC."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mid, self.last = (nn.Conv2d(c, 10, 3, padding=1) for c in (3, 10, 10))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(10, 10))
        for conv in (self.mid, self.last):
            conv.register_forward_hook(self._keep)
            conv.register_full_backward_hook(self._per_sample)


class _TokenNorm(nn.LayerNorm):
    """ConvNeXt's LayerNorm2d: normalized over the channels of tokens, its output permuted back (NHWC in NCHW too)."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class PerSampleClippedAfterATokenNorm(PerSampleClipped):
    """:class:`PerSampleClipped` with a token norm before ``mid``, hooked backward too (as Opacus hooks every layer):
    the windows of ``mid``'s input read NHWC memory in NCHW as well, and must read the same here."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = _TokenNorm(4)
        self.norm.register_full_backward_hook(lambda module, grad_input, grad_output: None)

    def forward(self, x):
        return self.head(self.last(F.relu(self.mid(self.norm(F.relu(self.stem(x)))))))


class _FunctionalStem(nn.Module):
    """A convolution by ``F.conv2d`` of a weight of its own: no module tells its channel count, so the first batch
    runs channels first (the guard's guess), and the later ones NHWC."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(4, 3, 3, 3) / 5)

    def forward(self, x):
        return F.conv2d(x, self.kernel, padding=1)


class PerSampleClippedAfterAFunctionalStem(PerSampleClipped):
    """:class:`PerSampleClipped` whose stem is a :class:`_FunctionalStem`: the input ``mid`` keeps is first NHWC
    on the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = _FunctionalStem()


def _clipped_per_sample(net: nn.Module) -> None:
    for conv in (net.mid, net.last):
        samples = conv.grad_sample
        factors = (1.0 / samples.flatten(1).norm(dim=1)).clamp(max=1.0)
        conv.weight.grad = torch.einsum('n,nop->op', factors, samples).view(conv.weight.shape)


class _GatedBySigmoid(torch.autograd.Function):
    """A custom autograd Function that views: its forward its input as (N, -1); its backward, which autograd
    calls outside every mode, the gradient and the saved input, and it writes its result through
    ``.view(-1)`` of an ``empty_like`` of the gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        rows = x.view(x.size(0), -1)
        return (rows * torch.sigmoid(rows)).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        rows, gate = grad.view(grad.size(0), -1), torch.sigmoid(x.view(x.size(0), -1))
        result = torch.empty_like(grad)
        result.view(-1).copy_((rows * gate * (1 + x.view(x.size(0), -1) * (1 - gate))).reshape(-1))
        return result


class _TripledByVjp(torch.autograd.Function):
    """A custom autograd Function whose backward is a ``vjp`` (autograd calls that one) that views the gradient."""

    @staticmethod
    def forward(ctx, x):
        return 3 * x

    @staticmethod
    def vjp(ctx, grad):
        return (3 * grad.view(grad.size(0), -1)).view_as(grad)


class CustomFunctionViewing(_ThreeConvolutions):
    """``function`` (default ``_GatedBySigmoid``) between two convolutions, applied from the second call on
    (first reached on an unwatched step)."""

    def __init__(self, function: type = _GatedBySigmoid) -> None:
        super().__init__()
        self.function, self.calls = function, 0

    def forward(self, x):
        self.calls += 1
        x = F.relu(self.stem(x))
        x = self.function.apply(self.mid(x)) if self.calls > 1 else self.mid(x)
        return self.head(self.last(x))


class DistilledFromATeacher(nn.Module):
    """A student trained on a frozen LeNet teacher that is no submodule (kept outside the model, as
    distillation code keeps it out of the optimizer and the checkpoint); the teacher views its activations."""

    def __init__(self) -> None:
        super().__init__()
        self.student = _flat_net()
        torch.manual_seed(1)
        self._teacher = (LeNet().double().requires_grad_(False),)  # a tuple: not registered

    def forward(self, x):
        with torch.no_grad():
            taught = self._teacher[0](x).softmax(-1)
        logits = self.student(x)
        return logits - (logits.log_softmax(-1) * taught).sum(-1, keepdim=True)


class ReadAtTheStart(_ThreeConvolutions):
    """Reads the first element of each parameter and of an activation through ``.as_strided()`` of sizes of one
    (torchdiffeq's adjoint takes ``torch.as_strided(param, (), ())`` of every parameter): the same element in
    either layout, whatever the strides given."""

    def forward(self, x):
        z = F.relu(self.stem(x))
        firsts = sum(torch.as_strided(p, (), ()) for p in self.parameters())
        corner = torch.as_strided(z, (1, 1, 1), (7, 5, 3), storage_offset=z.storage_offset())
        return self.head(self.last(F.relu(self.mid(z)))) + firsts + corner.view(1, 1)


class ReadThroughAsStridedSquare(ReadThroughAsStrided):
    """The same with 8 channels on 8 x 8 maps, where NHWC and NCHW strides are the same numbers in
    another order."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mid, self.last = (nn.Conv2d(c, 8, 3, padding=1) for c in (3, 8, 8))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


class BatchReshapedInPlace(LeNet):
    """Zeroes the first pixels of its input batch through ``x.reshape(n, -1)``, a view in NCHW."""

    def forward(self, x):
        x.reshape(x.size(0), -1)[:, :50] = 0
        return super().forward(x)


class Reconstructed(nn.Module):
    """An autoencoder whose loss views both its reconstruction and the batch: ``F.mse_loss(out.view(n, -1),
    images.view(n, -1))``."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Conv2d(3, 8, 4, 2, 1), nn.ReLU())
        self.decode = nn.ConvTranspose2d(8, 3, 4, 2, 1)

    def forward(self, x):
        return self.decode(self.encode(x))


def _reconstruction_viewed(output, batch):
    n = output.size(0)
    return F.mse_loss(output.view(n, -1), batch[0].view(n, -1))


class ScriptedBlockViewed(nn.Module):
    """A block compiled with ``torch.jit.script``, which takes no hooks, whose output the head ``.view()``s."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = torch.jit.script(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        z = self.block(F.relu(self.stem(x)))
        return self.head(z.view(z.size(0), -1))


def _flat_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(4 * 28 * 28, 10))


RUNS = {
    'lenet': Run(LeNet, _batches(), _cross_entropy),
    'lenet-compiled': Run(LeNet, _batches(), _cross_entropy, forward=_compiled_forward),
    'loss-view': Run(DenseHead, _batches((2, 3, 8, 8)), _heatmap_loss),
    'hooks': Run(Hooked, _batches((2, 3, 8, 8))[:3], _cross_entropy),
    'weight-bank': Run(WeightBank, _batches((2, 3, 8, 8)), _cross_entropy),
    'embedding': Run(Embedded, _batches(), _cross_entropy),
    'lbfgs': Run(_flat_net, _batches(), _cross_entropy, lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=2)),
    'parameters-to-vector': Run(Penalised, _batches(), _penalised_loss),
    'written-through-views': Run(WrittenThroughViews, _batches((2, 3, 8, 8)), _cross_entropy),
    'gradient-scaled-in-place': Run(GradientScaledInPlace, _batches((2, 3, 8, 8)), _cross_entropy),
    'max-normed-weights': Run(MaxNormed, _batches((2, 3, 8, 8)), _cross_entropy),
    'written-through-reshapes': Run(WrittenThroughReshapes, _batches((2, 3, 8, 8)), _cross_entropy),
    'written-through-nhwc-views': Run(WrittenThroughNhwcViews, _batches((2, 3, 8, 8)), _cross_entropy),
    'gradient-reshaped-in-place': Run(GradientReshapedInPlace, _batches((2, 3, 8, 8)), _cross_entropy),
    'max-normed-through-reshape': Run(MaxNormedThroughReshape, _batches((2, 3, 8, 8)), _cross_entropy),
    'batch-reshaped-in-place': Run(BatchReshapedInPlace, _batches(), _cross_entropy),
    'reconstruction-viewed': Run(Reconstructed, _batches((2, 3, 8, 8)), _reconstruction_viewed),
    'read-through-as-strided': Run(ReadThroughAsStrided, _batches((2, 3, 8, 8)), _cross_entropy),
    'read-through-as-strided-square': Run(ReadThroughAsStridedSquare, _batches((2, 3, 8, 8)), _cross_entropy),
    'distilled-from-a-teacher': Run(DistilledFromATeacher, _batches(), _cross_entropy),
    'batch-mixed-in-place': Run(BatchMixedInPlace, _batches(), _cross_entropy),
    'gradient-penalty': Run(GradientPenalised, _batches(), _cross_entropy),
    'activation-gradient-penalty': Run(ActivationGradientPenalised, _batches((2, 3, 8, 8)), _cross_entropy),
    'hooked-at-construction': Run(HookedAtConstruction, _batches((2, 3, 8, 8)), _cross_entropy),
    'per-sample-clipped': Run(
        PerSampleClipped, _batches((2, 3, 8, 8)), _cross_entropy, after_backward=_clipped_per_sample
    ),
    'per-sample-clipped-square': Run(
        PerSampleClippedSquare, _batches((2, 3, 8, 8)), _cross_entropy, after_backward=_clipped_per_sample
    ),
    'per-sample-clipped-after-a-token-norm': Run(
        PerSampleClippedAfterATokenNorm, _batches((2, 3, 8, 8)), _cross_entropy, after_backward=_clipped_per_sample
    ),
    'per-sample-clipped-after-a-functional-stem': Run(
        PerSampleClippedAfterAFunctionalStem, _batches((2, 3, 8, 8)), _cross_entropy, after_backward=_clipped_per_sample
    ),
    'custom-function-viewing': Run(CustomFunctionViewing, _batches((2, 3, 8, 8)), _cross_entropy),
    'bits-truncated': Run(BitsTruncated, _batches(), _cross_entropy),
    'custom-function-vjp': Run(lambda: CustomFunctionViewing(_TripledByVjp), _batches((2, 3, 8, 8)), _cross_entropy),
    'scripted-block-viewed': Run(ScriptedBlockViewed, _batches((2, 3, 8, 8)), _cross_entropy),
    'read-at-the-start': Run(ReadAtTheStart, _batches((2, 3, 8, 8)), _cross_entropy),
}
WEIGHTS_FLATTENED = ('lbfgs', 'parameters-to-vector', 'max-normed-through-reshape')


@EACH_INTEGRATION
@pytest.mark.parametrize('name', list(RUNS))
def test_views_train_as_in_nchw(name, integration):
    """No step raises, and every step equals the NCHW run's, with an audit of the first two steps."""
    run = RUNS[name]
    if name == 'lbfgs' and integration == 'composer':
        pytest.skip("Composer's Trainer does not pass LBFGS a closure")
    steps, net, owner = guarded(run, integration, audit_steps=2)
    assert_same_run(steps, nchw(run), f'{name} through {integration}')
    guard = owner if isinstance(owner, LayoutGuard) else owner.guard
    convolutions = [m.weight for m in net.modules() if isinstance(m, nn.Conv2d) and m.weight.shape[-1] > 1]
    if name in WEIGHTS_FLATTENED:
        assert all(w.is_contiguous() for w in convolutions), 'the weights are viewed: they must stay contiguous'
        assert guard.weight_layout.contiguous
    else:
        assert all(not w.is_contiguous() for w in convolutions), 'the convolutions should be channels last'


@pytest.mark.parametrize(
    'name', ['lenet', 'hooks', 'written-through-views', 'gradient-reshaped-in-place', 'parameters-to-vector']
)
def test_views_train_as_in_nchw_with_the_algorithm_among_composers_callbacks(name):
    """``callbacks=[ChannelsLast()]`` does the algorithm's work: at ``Event.INIT`` before the algorithms, at the
    other events after them."""
    run = RUNS[name]
    steps, net, _ = guarded(run, 'composer_callback', audit_steps=2)
    assert_same_run(steps, nchw(run), f'{name} with ChannelsLast among the callbacks')
    convolutions = [m.weight for m in net.modules() if isinstance(m, nn.Conv2d) and m.weight.shape[-1] > 1]
    assert all(w.is_contiguous() == (name in WEIGHTS_FLATTENED) for w in convolutions)


def test_non_convolution_tensors_keep_their_layout():
    """The weight bank and the embedding are no convolution's weight: left as they are, and said so."""
    for build, name in ((WeightBank, 'bank'), (Embedded, 'pos_embed')):
        guard = LayoutGuard()
        summary = guard.on_init(build())
        assert name in summary.left and 'not a convolution weight' in summary.left[name]
        assert 'left as is' in str(guard.start_block)


def test_the_placed_view_is_an_exit_and_later_steps_alias(caplog):
    """The pool runs twice a step, so conv2's output is made channels first: the flatten is a view again,
    and the copy is an exit, not a break."""
    run = RUNS['lenet']
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        steps, net, guard = guarded(run, 'guard', audit_steps=3)
    placed = [r.getMessage() for r in caplog.records if 'made channels first' in r.getMessage()]
    assert len(placed) == 1 and placed[0].startswith('channels last: conv2 outputs made channels first (viewed at ')
    assert 'test_views.py' in placed[0]
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).to(memory_format=torch.channels_last)
    pooled = net.pool(F.relu(net.conv2(net.pool(F.relu(net.conv1(x))))))
    assert pooled.is_contiguous()
    assert guard.report.steps == 3 and not guard.report.breaks, guard.report.breaks


def test_writes_through_reshapes_place_their_modules_and_later_steps_alias(caplog):
    """Each module whose output is written through a copy NCHW has as an alias is made channels first,
    once, naming the place of the copy; the channel shuffle's copy is not. Afterwards each reshape
    aliases the activation as in NCHW."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, _ = guarded(RUNS['written-through-reshapes'], 'guard')
    placed = [r.getMessage() for r in caplog.records if 'channels first' in r.getMessage()]
    assert [line.split(' outputs made channels first (written in place through the ')[1][:12] for line in placed] == [
        '.reshape() a',
        '.contiguous(',
        '.reshape() a',
    ]
    assert [line.split(' ')[2] for line in placed] == ['stem', 'mid', 'last']
    assert all(line.endswith('(a copy here, an alias in NCHW))') and 'test_views.py:' in line for line in placed)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    z, y = net.stem(x), net.mid(x.new_zeros(2, 4, 8, 8).to(memory_format=torch.channels_last))
    assert z.reshape(2, -1).data_ptr() == z.data_ptr() and y.contiguous() is y


def test_writes_through_nhwc_views_place_their_modules_and_later_steps_copy(caplog):
    """The modules whose outputs are written through what NHWC views and NCHW copies are made channels
    first, naming the place; the unwritten detector-head reshape is not. Afterwards each copies as in NCHW."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, _ = guarded(RUNS['written-through-nhwc-views'], 'guard')
    placed = [r.getMessage() for r in caplog.records if 'channels first' in r.getMessage()]
    assert [line.split(' ')[2] for line in placed] == ['stem', 'mid'], placed
    assert all(line.endswith('(an alias here, a copy in NCHW))') and 'test_views.py:' in line for line in placed)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    z = net.stem(x)
    assert z.permute(0, 2, 3, 1).reshape(-1, 4).data_ptr() != z.data_ptr()


def test_writes_no_module_can_place_keep_the_watch_on_saying_so(caplog):
    """A gradient is no module's output: the watch stays on, and says where and why."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        guarded(RUNS['gradient-reshaped-in-place'], 'guard')
    lines = [r.getMessage() for r in caplog.records if 'every step' in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(
        'so no module can make it channels first: every step is watched (slower)'
    )
    assert 'test_views.py:' in lines[0] and "(a copy here, an alias in NCHW) is no module's output" in lines[0]


class TiedAutoencoder(nn.Module):
    """A decoder that is the encoder's transpose (``F.conv_transpose2d`` on its weight), its error viewed."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        decoded = F.conv_transpose2d(F.relu(self.norm(self.enc(x))), self.enc.weight, padding=1)
        return (decoded - x).view(x.size(0), -1).pow(2).mean(1)


def test_a_view_of_what_a_channels_last_weight_lays_out_places_no_module_and_stays_watched(caplog):
    """A functional convolution on a channels-last weight gives NHWC whatever its input: making the module before
    it channels first would only add a copy each step. No module is placed; every step is watched, as NCHW."""
    run = Run(TiedAutoencoder, _batches((2, 3, 8, 8)), lambda output, batch: output.mean())
    with caplog.at_level(logging.INFO, logger='channels_last_algo.core.guard'):
        steps, net, _ = guarded(run, 'guard')
    assert_same_run(steps, nchw(run), 'tied autoencoder')
    messages = [r.getMessage() for r in caplog.records]
    assert not any('outputs made channels first' in m for m in messages), messages
    assert any("is no module's output" in m and 'every step is watched' in m for m in messages), messages


def test_a_view_of_a_torchscript_modules_output_is_watched_every_step_and_its_tensors_are_left(caplog):
    """A TorchScript module takes no hooks, so its viewed output cannot be made channels first where it is made:
    the console names it and every step is watched; its weights, which no watch sees used, keep their layout."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, guard = guarded(RUNS['scripted-block-viewed'], 'guard')
    said = [r.getMessage() for r in caplog.records]
    assert any(
        'test_views.py:' in line and 'made by a TorchScript module (block), which takes no hooks' in line
        for line in said
    ), said
    assert guard.summary.left['block.0.weight'] == "a TorchScript module's tensor (no watch sees into TorchScript)"
    assert net.block.state_dict()['0.weight'].is_contiguous()


@pytest.mark.parametrize(
    ('name', 'use'),
    [('batch-reshaped-in-place', '(a copy here, an alias in NCHW)'), ('reconstruction-viewed', 'viewed at')],
)
def test_a_batch_tensor_that_a_step_needs_as_it_came_is_left_as_it_comes(name, use, caplog):
    """A batch tensor the guard made NHWC, written through a ``.reshape()`` (a view in NCHW) or viewed by the loss,
    is left as it comes from the next batch on, where the reshape aliases it and the view takes it as in NCHW: no
    watch on every step, one line that says so."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, _, guard = guarded(RUNS[name], 'guard')
    lines = [r.getMessage() for r in caplog.records if 'batch' in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith('channels last: batch[0] left as it comes from the next batch on ')
    assert 'test_views.py:' in lines[0] and use in lines[0], lines
    assert not any('every step' in r.getMessage() for r in caplog.records)
    assert guard.on_batch(RUNS[name].batches[0])[0].is_contiguous()


def test_activations_kept_for_a_backward_hook_place_their_modules(caplog):
    """Opacus-style per-sample gradients: the inputs a forward hook kept and a full backward hook unfolds through
    ``.as_strided()`` have the origins the step's watch saw, so the modules that made them return them channels
    first from then on, and no step after the first is watched."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        guarded(RUNS['per-sample-clipped'], 'guard')
    said = [r.getMessage() for r in caplog.records]
    placed = sorted(line.split(' ')[2] for line in said if 'outputs made channels first (read through' in line)
    assert placed == ['mid', 'stem'], said
    assert not any('every step' in line for line in said), said


def test_the_copies_the_package_makes_are_not_taken_for_the_users(caplog):
    """The batch's failing ``.view()`` runs on a copy the first batch's input search makes with
    ``.contiguous()``: the console says nothing of a ``.contiguous()`` the user did not write."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        guarded(RUNS['batch-mixed-in-place'], 'guard')
    said = [r.getMessage() for r in caplog.records]
    assert not any('.contiguous()' in line for line in said), said


def test_a_model_whose_view_placed_a_hook_scripts_traces_and_exports_as_it_runs(tmp_path):
    """The hook that makes conv2's output channels first compiles under ``torch.jit.script`` (and saves
    and loads), and tracing and ``torch.export`` keep it: each gives the eager model's output."""
    _, net, _ = guarded(RUNS['lenet'], 'guard')
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).to(memory_format=torch.channels_last)
    expected = net(x)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # TorchScript is deprecated in the newest torch
        torch.jit.save(torch.jit.script(net), tmp_path / 'lenet.pt')
        copies = {'script': torch.jit.load(tmp_path / 'lenet.pt'), 'trace': torch.jit.trace(net, (x,))}
    copies['export'] = torch.export.export(net, (x,), strict=False).module()
    for name, saved in copies.items():
        torch.testing.assert_close(saved(x), expected, rtol=1e-12, atol=1e-12, msg=name)


def test_parameters_to_vector_with_contiguous_weights():
    """``weights='contiguous'`` for code that flattens the weights itself; activations still go NHWC."""
    net = _flat_net().double()
    guard = LayoutGuard(weights='contiguous')
    guard.on_init(net)
    vector = torch.nn.utils.parameters_to_vector(net.parameters())
    torch.nn.utils.vector_to_parameters(vector * 2, net.parameters())
    seen = []
    net[2].register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    with guard.step():
        net(guard.on_batch(torch.randn(2, 3, 32, 32, dtype=torch.float64))).sum().backward()
    torch.nn.utils.parameters_to_vector(p.grad for p in net.parameters())
    assert seen == [True] and 'contiguous' in str(guard.start_block)


def test_weights_option_is_checked():
    with pytest.raises(ValueError, match="weights must be one of 'auto', 'contiguous', got 'nhwc'"):
        LayoutGuard(weights='nhwc')


class _Muon(torch.optim.Optimizer):
    """Muon's update rule as github.com/KellerJordan/Muon writes it: ``update.view(len(update), -1)``."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault('momentum_buffer', torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group['momentum'])
                update = p.grad.lerp(buf, group['momentum'])
                if update.ndim == 4:
                    update = update.view(len(update), -1)
                update = update / (update.norm() + 1e-7)
                p.add_(update.reshape(p.shape), alpha=-group['lr'])


@pytest.fixture
def muon_module(monkeypatch):
    module = types.ModuleType('muon')
    _Muon.__module__ = 'muon'
    _Muon.__qualname__ = _Muon.__name__ = 'Muon'
    module.Muon = _Muon
    monkeypatch.setitem(sys.modules, 'muon', module)
    return module


@EACH_INTEGRATION
def test_muon_style_optimizer_trains_as_in_nchw(integration, muon_module):
    run = Run(_flat_net, _batches(), _cross_entropy, lambda params: muon_module.Muon(params))
    steps, net, owner = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'Muon through {integration}')
    guard = owner if isinstance(owner, LayoutGuard) else owner.guard
    assert guard.weight_layout.contiguous and 'Muon' in guard.weight_layout.reason


def test_an_optimizer_made_after_on_init_is_seen_at_its_first_step():
    """A plain loop that gives on_init no optimizer: LBFGS's first step turns the weights contiguous."""
    run = RUNS['lbfgs']
    torch.manual_seed(0)
    net = run.build().double()
    guard = LayoutGuard()
    guard.on_init(net)
    assert not net[0].weight.is_contiguous()
    opt = run.optimizer(net.parameters())
    for batch in run.batches:
        from guarded_runs import _step  # the closure step the other runs take

        _step(run, net, opt, guard.on_batch(batch), guard)
    assert net[0].weight.is_contiguous() and guard.weight_layout.contiguous


def _lightning_classifier(net: nn.Module):
    """A LightningModule that trains and validates ``net`` with cross-entropy and SGD."""
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return _cross_entropy(self.net(batch[0]), batch)

        def validation_step(self, batch, batch_idx):
            self.log('val_loss', _cross_entropy(self.net(batch[0]), batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier()


def _loader(batches: list) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*map(torch.cat, zip(*batches))), batch_size=2)


def test_a_view_in_evaluation_before_training():
    """Lightning's sanity check evaluates before the first training step: its forward's view runs too."""
    pytest.importorskip('lightning')
    from channels_last_algo.integrations.lightning import ChannelsLastCallback

    data = _loader(_batches())
    trainer = lightning_trainer(
        callbacks=[ChannelsLastCallback()],
        max_steps=3,
        num_sanity_val_steps=2,
        limit_val_batches=2,
    )
    trainer.fit(_lightning_classifier(LeNet().double()), train_dataloaders=data, val_dataloaders=data)
    assert trainer.global_step == 3


class ViewsInEvaluation(LeNet):
    """Flattens with ``torch.flatten`` in training and with ``.view`` in evaluation only."""

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc(torch.flatten(x, 1) if self.training else x.view(-1, 16 * 5 * 5))


def test_a_view_only_evaluation_makes_is_found_at_the_first_evaluation_after_training():
    torch.manual_seed(0)
    reference = ViewsInEvaluation().double()
    net = copy.deepcopy(reference)
    guard = LayoutGuard()
    guard.on_init(net)
    batches = _batches()
    for model, watched in ((reference, None), (net, guard)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in batches:
            batch = watched.on_batch(batch) if watched is not None else batch
            with watched.step() if watched is not None else contextlib.nullcontext():
                _cross_entropy(model(batch[0]), batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    images = batches[0][0]
    net.eval()
    with torch.no_grad():
        outputs = [net(guard.on_batch(images)) for _ in range(2)]  # found at the first, a true view after
        expected = reference.eval()(images)
    for output in outputs:
        torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    guard.close()


def test_a_view_inside_torchscript_fails_saying_no_watch_sees_into_it():
    """A scripted function's ``.view()`` runs in the TorchScript interpreter, past every watch: torch's
    error carries the note that says so, and what works in either layout."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # torch.jit.script is deprecated from torch 2.10

        @torch.jit.script
        def flatten(z: torch.Tensor) -> torch.Tensor:
            return z.view(z.size(0), -1)

    conv = nn.Conv2d(3, 4, 3).double()
    guard = LayoutGuard()
    guard.on_init(conv)
    (images, _), *_ = _batches((2, 3, 8, 8))
    with pytest.raises(RuntimeError, match='view size is not compatible') as caught:
        with guard.step():
            flatten(conv(guard.on_batch(images))).sum().backward()
    said = str(caught.value) + ''.join(getattr(caught.value, '__notes__', []))
    assert SCRIPTED_VIEW in said and UNWATCHED_VIEW not in said


def test_inference_without_training_leaves_no_mode_behind():
    """Evaluation only: each forward's view works, and no watch outlives a forward."""
    torch.manual_seed(0)
    net = LeNet().double().eval()
    expected = [net(images) for images, _ in _batches()]
    guard = LayoutGuard()
    guard.on_init(net)
    with torch.no_grad():
        for (images, _), reference in zip(_batches(), expected):
            torch.testing.assert_close(net(guard.on_batch(images)), reference, rtol=1e-10, atol=1e-10)
            assert torch._C._len_torch_function_stack() == 0


def test_a_batch_whose_forward_never_runs_leaves_no_mode_on():
    """The forward-only watch enters its mode with the forward's outermost module call: a batch
    that is never run (skipped, or only inspected) leaves no mode that would run views on copies."""
    net = LeNet().double()
    guard = LayoutGuard()
    guard.on_init(net)
    images, _ = _batches()[0]
    guard.on_batch(images)
    assert torch._C._len_torch_function_stack() == 0
    flat = net(guard.on_batch(images))  # the next batch runs as usual
    assert flat.shape[0] == images.shape[0] and torch._C._len_torch_function_stack() == 0
    guard.close()


@EACH_INTEGRATION
def test_auto_modes_trial_steps_run_a_model_that_views_as_in_nchw(integration):
    """Auto mode times forward and backward passes before the first training step: the warm-up is watched as a
    first step is, so the LeNet flatten runs there (and is placed) instead of raising inside the trial."""
    run = Run(build=LeNet, batches=_batches(), loss=_cross_entropy)
    steps, _, _ = guarded(run, integration, mode='auto')
    assert_same_run(steps, nchw(run), f'{integration}, auto mode')


def _gradient_penalty_loss(critic: nn.Module, batch: tuple) -> torch.Tensor:
    """WGAN-GP: the critic's gradient at images between the batch and its reverse, flattened by ``.view``
    (NHWC, as the batch is: a tensor no module made)."""
    images = batch[0]
    alpha = torch.linspace(0, 1, images.shape[0], dtype=images.dtype).view(-1, 1, 1, 1)
    between = (alpha * images + (1 - alpha) * images.flip(0)).requires_grad_(True)
    (gradient,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    penalty = ((gradient.view(gradient.size(0), -1).norm(2, dim=1) - 1) ** 2).mean()
    return critic(images).mean() + 10 * penalty


@EACH_INTEGRATION
def test_auto_modes_timed_steps_watch_a_view_no_module_can_place(integration):
    """A view of a tensor no module made (a gradient penalty's input gradient) is watched on every step: auto
    mode's timed steps in channels last are watched so too, instead of raising inside the trial."""
    run = Run(
        build=lambda: nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(4 * 8 * 8, 1)),
        batches=[(images,) for images, _ in _batches(shape=(4, 3, 16, 16))],
        loss=lambda output, batch: output,
        forward=_gradient_penalty_loss,
    )
    steps, _, _ = guarded(run, integration, mode='auto')
    assert_same_run(steps, nchw(run), f'{integration}, auto mode')


class _WeightNormalizingNet(nn.Module):
    """Normalizes each filter through a ``.view`` of its weight, which NHWC strides refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.conv.weight.view(8, -1)
        weight = (flat / flat.norm(dim=1, keepdim=True)).view_as(self.conv.weight)
        return self.head(F.conv2d(x, weight, self.conv.bias, padding=1))


class _ViewsFromItsFourthCall(nn.Module):
    """Flattens by ``.reshape`` on its first three calls, then by ``.view``: a view first reached in a later trial."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 32 * 32, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = F.relu(self.conv(x))
        return self.head(y.view(y.size(0), -1) if self.calls > 3 else y.reshape(y.size(0), -1))


@EACH_INTEGRATION
@pytest.mark.parametrize('build', [_WeightNormalizingNet, _ViewsFromItsFourthCall])
def test_auto_modes_channels_last_trials_take_views_as_training_steps_do(integration, build):
    """Auto mode's trial steps with channels-last weights find a weight viewed (the warm-up's channels-first
    weights cannot show it) and take a view first reached on a later trial, instead of raising inside the trial."""
    run = Run(build=build, batches=_batches(steps=5), loss=_cross_entropy)
    steps, net, owner = guarded(run, integration, mode='auto')
    assert_same_run(steps, nchw(run), f'{integration}, auto mode')
    if build is _WeightNormalizingNet:
        guard = getattr(owner, 'guard', owner)
        assert guard.effective_mode == 'on' and net.conv.weight.is_contiguous()


@EACH_INTEGRATION
def test_a_teacher_outside_the_model_keeps_no_hook_after_the_run(integration, caplog):
    """The teacher is the user's: the hook that made its viewed output channels first comes off when the run
    ends, and it pickles as its class makes it."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, owner = guarded(RUNS['distilled-from-a-teacher'], integration)
    teacher = net._teacher[0]
    if integration == 'guard':
        assert any('a Conv2d outside the model outputs made channels first' in r.getMessage() for r in caplog.records)
    assert not [path for path, m in teacher.named_modules() if m._forward_hooks or '__getstate__' in vars(m)]
    guard = owner if isinstance(owner, LayoutGuard) else owner.guard
    assert not [path for path in guard._viewed.placed if 'outside the model' in path]


def test_a_read_of_the_first_element_through_as_strided_keeps_the_weights_and_outputs_channels_last(caplog):
    """Strides given for one element read the same one in either layout: nothing is made contiguous."""
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _, net, guard = guarded(RUNS['read-at-the-start'], 'guard')
    assert not guard.weight_layout.contiguous and not guard._viewed.placed, [r.getMessage() for r in caplog.records]
