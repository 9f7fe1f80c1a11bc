"""The fx route: trace the model symbolically, apply :data:`~.patterns.FUSION_PATTERNS` at
every convolution node, and let a fused residual add write into its input where that is safe.

A module-level function that fails on tracing proxies (Composer's ``blur_2d`` sizes its filter from
the input's channels) is called whole (:mod:`.tracing`). A submodule whose own forward symbolic
tracing cannot follow (control flow on a value) is kept whole, as a leaf that runs as it is, and fused
inside by the module route (:func:`~.modules.fuse_modules`) where it has children; so is one that forward
hooks watch, whose hooks a traced graph would not call. Functional ``conv2d`` and
``batch_norm`` calls become module calls (:mod:`.functional_calls`), so the patterns see them.
The BatchNorms left in the network are reported.

Before matching, the nodes that are the identity in eval mode (Dropout, StochasticDepth,
Identity) are removed, so that a conv and the add after them can fuse. A run of nodes
matches a pattern when each node after the first is the only user of the one before, reads
it as its input, and calls what the pattern's element accepts; a module called from several
nodes is left alone. Reads of a node's shape, rank, dtype or device (timm's
``_assert(x.ndim == 4)``) are not uses: they read the fused node instead, which has the same.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    >>> graph_module = trace(net)
    >>> fuse_graph(graph_module, prepack=True).fused
    {'0': 'conv+bn+relu'}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch.nn.functional as F
from torch import fx, nn

from channels_last_algo.core.argument_checks import why
from channels_last_algo.core.fuse.concatenations import fold_through_concatenations, module_calls
from channels_last_algo.core.fuse.conv import FusedConv2d
from channels_last_algo.core.fuse.functional_calls import (
    batch_norm_arguments,
    call_batchnorms_as_modules,
    call_convolutions_as_modules,
)
from channels_last_algo.core.fuse.modules import fuse_modules
from channels_last_algo.core.fuse.node_uses import value_users
from channels_last_algo.core.fuse.patterns import (
    LONGEST_PATTERN,
    Element,
    Match,
    batchnorm_paths,
    fuse_chain,
    is_eval_identity,
)
from channels_last_algo.core.fuse.postops import has_hooks
from channels_last_algo.core.fuse.summary import FusionSummary
from channels_last_algo.core.fuse.tracing import trace_wrapping_failures
from channels_last_algo.core.layers import RULES

__all__ = ['called_whole', 'fuse_graph', 'optional_inputs_used', 'trace']

log = logging.getLogger(__name__)

_REPAIRED_LAYERS = tuple(rule.replacement for rule in RULES if rule.original_name.startswith('torch.nn.'))


class _Tracer(fx.Tracer):
    """fx's tracer, keeping as leaves the repaired ``torch.nn`` layers (:mod:`channels_last_algo.core.layers`),
    as the built-in layers they replace are, the modules forward hooks watch, and every module that tracing
    into fails: the nodes of the failed attempt are removed and the module is called whole (``untraceable``:
    path -> why)."""

    def __init__(self, autowrap_functions: tuple[Callable[..., Any], ...] = ()) -> None:
        super().__init__(autowrap_functions=autowrap_functions)
        self.untraceable: dict[str, str] = {}
        self.errors: list[Exception] = []

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        leaf = qualified_name in self.untraceable or isinstance(module, _REPAIRED_LAYERS) or has_hooks(module)
        return leaf or super().is_leaf_module(module, qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        count, stack, calls = len(self.graph.nodes), self.module_stack.copy(), dict(self.num_calls)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:  # whatever the module's code raises on proxies
            for node in reversed(list(self.graph.nodes)[count:]):
                if node.op != 'get_attr':  # fx caches those for later reads; dropped by trace() when unused
                    self.graph.erase_node(node)
            self.module_stack.clear()
            self.module_stack.update(stack)
            self.num_calls = calls
            self.untraceable[path] = why(error)
            self.errors.append(error)
            return super().call_module(m, forward, args, kwargs)


def trace(model: nn.Module) -> fx.GraphModule:
    """A ``GraphModule`` of ``model`` (sharing its submodules), with the submodules fx cannot
    trace as leaves; raises what tracing ``model``'s own forward raises."""
    tracer, graph = trace_wrapping_failures(_Tracer, model)
    graph_module = fx.GraphModule(model, graph)
    call_convolutions_as_modules(graph_module, model)
    for node in [node for node in graph_module.graph.nodes if node.op == 'get_attr' and not node.users]:
        graph_module.graph.erase_node(node)
    for path, error in tracer.untraceable.items():
        log.debug('%s: %s is kept whole (fx cannot trace it: %s)', type(model).__name__, path, error)
    graph_module.recompile()
    return graph_module


def _batchnorms_left(graph_module: fx.GraphModule, owners: dict[str, str]) -> list[str]:
    """The paths of the BatchNorms the fused graph still runs: those it calls (a functional one by the
    module whose statistics it reads) and those inside the modules it calls whole."""
    modules, left = dict(graph_module.named_modules()), []
    for node in graph_module.graph.nodes:
        if node.op == 'call_module':
            prefix = owners.get(node.target, node.target)
            left += [f'{prefix}.{path}' if path else prefix for path in batchnorm_paths(modules[node.target])]
        elif (given := batch_norm_arguments(node)) is not None:
            statistics = given.get('running_mean')
            if isinstance(statistics, fx.Node):  # without: a weight's standardization (timm's StdConv2d)
                left.append(statistics.target.rpartition('.')[0] if statistics.op == 'get_attr' else node.name)
    return list(dict.fromkeys(left))


def _eval_identity_functions() -> dict[Any, int]:
    """Functions that return their input when their ``training`` argument (at this
    position) is False."""
    functions: dict[Any, int] = {F.dropout: 2, F.dropout1d: 2, F.dropout2d: 2, F.dropout3d: 2, F.alpha_dropout: 2}
    try:
        from torchvision.ops import stochastic_depth
    except ImportError:
        return functions
    functions[stochastic_depth] = 3
    return functions


def _drop_eval_identities(graph: fx.Graph, modules: dict[str, nn.Module]) -> None:
    """Remove the nodes that are the identity in eval mode."""
    functions = _eval_identity_functions()
    for node in list(graph.nodes):
        if node.op == 'call_module':
            identity = is_eval_identity(modules[node.target])
        elif node.op == 'call_function' and node.target in functions:
            position = functions[node.target]
            training = node.args[position] if len(node.args) > position else node.kwargs.get('training', True)
            identity = training is False
        else:
            identity = False
        if identity and node.args and isinstance(node.args[0], fx.Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition('.')
    setattr(root.get_submodule(parent), name, module)


class _GraphFuser:
    """One fx fusion pass: the graph, its modules (fused ones put in as they are made), how often
    each module is called, and the nodes already erased."""

    def __init__(self, graph_module: fx.GraphModule, prepack: bool) -> None:
        self.graph_module = graph_module
        self.graph = graph_module.graph
        self.modules = dict(graph_module.named_modules())
        self.calls = module_calls(self.graph)
        self.prepack = prepack
        self.erased: set[fx.Node] = set()

    def value_of(self, element: Element, node: fx.Node, previous: Optional[fx.Node]) -> Any:
        """What ``element`` accepts at ``node`` after ``previous`` (see :func:`~.patterns.match_pattern`)."""
        if node.op == 'call_module':
            if previous is None:  # the convolution: called from this node alone, on one input
                reads = self.calls[node.target] == 1 and len(node.args) == 1 and not node.kwargs
            else:
                reads = len(node.args) == 1 and node.args[0] is previous and not node.kwargs
            return element.of_module(self.modules[node.target]) if reads else None
        if previous is not None and node.op in ('call_function', 'call_method'):
            return element.of_call(node, previous)
        return None

    def fuse_at(self, start: fx.Node) -> Optional[str]:
        """Apply the patterns at ``start`` until none matches there; the fused kernel's description."""
        current = [start]  # the run's first node, replaced with each fusion

        def replace(match: Match, module: nn.Module) -> None:
            current[0] = self._replace(match, module)

        return fuse_chain(lambda: _run_from(current[0]), self.value_of, replace, self.prepack)

    def _replace(self, match: Match, module: nn.Module) -> fx.Node:
        """Put ``module`` in place of the matched nodes' first module and erase them; the node calling it."""
        first, last = match.items[0], match.items[-1]
        _set_submodule(self.graph_module, first.target, module)
        self.modules[first.target] = module
        with self.graph.inserting_after(last):
            fused = self.graph.call_module(first.target, (first.args[0], *match.operands))
        last.replace_all_uses_with(fused)
        _read_metadata_of(fused, match.items[:-1])
        for node in reversed(match.items):
            self.graph.erase_node(node)
        self.erased.update(match.items)
        return fused


def _read_metadata_of(fused: fx.Node, inner: list[fx.Node]) -> None:
    """Let the reads of ``inner`` nodes' shapes read ``fused``'s (the same) instead, and move them, and
    the nodes that depend on them, after ``fused``."""
    readers = {user for node in inner for user in node.users if user not in inner}
    if not readers:
        return
    for reader in readers:
        for node in inner:
            reader.replace_input_with(node, fused)
    moved, cursor = set(readers), fused
    for node in list(inner[0].graph.nodes):
        if node is fused:
            break
        if node in moved or any(source in moved for source in node.all_input_nodes):
            moved.add(node)
            cursor.append(node)
            cursor = node


def _run_from(first: fx.Node) -> list[fx.Node]:
    """The run of nodes from ``first``: each after it the only user of the one before (reads of its shape aside)."""
    run = [first]
    while len(run) < LONGEST_PATTERN and len(users := value_users(run[-1])) == 1:
        run.append(users[0])
    return run


def optional_inputs_used(graph_module: fx.GraphModule) -> list[str]:
    """The arguments defaulting to None that ``graph_module``'s graph computes with: a trace passes a proxy, never
    None, so ``if mask is not None`` took the branch for a tensor, and a call without one fails in the graph."""
    return [
        node.target
        for node in graph_module.graph.nodes
        if node.op == 'placeholder' and node.args == (None,) and node.users
    ]


def called_whole(graph_module: fx.GraphModule) -> list[str]:
    """The paths of the modules with children of their own that ``graph_module`` calls as leaves: those
    whose forward fx could not trace into (``if x.shape[1] != self.channels: raise``)."""
    paths = dict.fromkeys(node.target for node in graph_module.graph.nodes if node.op == 'call_module')
    return [path for path in paths if graph_module.get_submodule(path)._modules]


def fuse_graph(graph_module: fx.GraphModule, prepack: bool, inside_whole: bool = True) -> FusionSummary:
    """Fold BatchNorms and fuse convolutions in ``graph_module``, in place.

    Args:
        graph_module: a traced model.
        prepack: prepacked oneDNN weights and in-place residual adds (off for ``torch.export``).
        inside_whole: fuse inside the modules the graph calls whole (:func:`called_whole`) by the
            module route (:func:`~.modules.fuse_modules`).
    """
    owners = call_batchnorms_as_modules(graph_module)
    split = fold_through_concatenations(graph_module, prepack)
    fuser = _GraphFuser(graph_module, prepack)
    _drop_eval_identities(fuser.graph, fuser.modules)
    summary = FusionSummary(route='fx')
    for start in list(fuser.graph.nodes):
        description = None if start in fuser.erased else fuser.fuse_at(start)
        if description is not None:
            summary.fused[start.target] = description
    for path in (path for paths in split.values() for path in paths):  # each alone: the cat follows
        summary.fused[path] = 'conv+bn' + summary.fused.get(path, 'conv')[len('conv') :]
    summary.split = split
    for path in called_whole(graph_module) if inside_whole else []:
        inner = fuse_modules(graph_module.get_submodule(path), prepack)
        summary.fused.update({f'{path}.{name}': kernel for name, kernel in inner.fused.items()})
    if prepack:
        _mark_in_place_adds(fuser.graph, dict(graph_module.named_modules()))
    fuser.graph.lint()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    summary.unfused = _batchnorms_left(graph_module, owners)
    return summary


def _mark_in_place_adds(graph: fx.Graph, modules: dict[str, nn.Module]) -> None:
    """Let a fused conv + add write into its residual input instead of a new tensor where
    that is safe: the residual is a convolution's output (a fresh tensor, or one only aliasing
    tensors that are dead already) and nothing reads it after the add. On CPU this skips
    allocating (and page-faulting) one activation-sized output per residual block."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        fused = modules.get(node.target) if node.op == 'call_module' else None
        if not isinstance(fused, FusedConv2d) or not fused.add:
            continue
        other = node.args[1]
        producer = modules.get(other.target) if other.op == 'call_module' else None
        fresh = isinstance(producer, FusedConv2d) or FusedConv2d.accepts(producer)
        fused.add_in_place = (
            fresh and other is not node.args[0] and all(position[user] <= position[node] for user in other.users)
        )
