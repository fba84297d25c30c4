"""Operator ordering: the DP is optimal, its accounting is the simulator's, every order is valid and runs exactly."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import magis
from magis.api import measure_against_eager
from magis.backend.runtime import run_step
from magis.cost.memory import peak_memory, simulate_memory
from magis.ir.graph import Graph, Node, Ref, Role, TensorMeta, map_refs
from magis.models import WORKLOADS, Built, get_workload
from magis.models.random_graphs import random_nasnet_graph, random_randwire_graph
from magis.rules.identity import (
    apply_concat_conv,
    apply_concat_depthwise,
    find_concat_conv,
    find_concat_depthwise,
)
from magis.schedule import (
    ScheduleTimeout,
    dp_schedule,
    greedy_schedule,
    incremental_schedule,
    narrow_waist,
    schedule,
)
from magis.schedule.incremental import MAX_EXTEND
from magis.schedule.problem import memory_facts, segment_problem

OP = torch.ops.aten.add.Tensor


def _meta(nbytes: int) -> TensorMeta:
    return TensorMeta((nbytes,), torch.uint8, nbytes)


def random_graph(n: int, seed: int, fan_in: int = 3) -> Graph:
    """A random DAG of ``n`` nodes: persistent and plain inputs, ops with 1-3 inputs and random
    sizes and workspaces, views (of a value or of one element of a tuple), tuple outputs,
    and several graph outputs."""
    rng = random.Random(seed)
    nodes: list[Node] = []
    tuples: set[str] = set()
    for i in range(n):
        name = f"n{i}"
        if i == 0 or rng.random() < 0.1:
            role = rng.choice([Role.PARAMETER, Role.INPUT, Role.ACTIVATION])
            nodes.append(Node(name, None, outputs=(_meta(rng.randint(1, 50)),), aliases=(None,), role=role))
            continue
        window = rng.choice([i, 4])  # long or short range edges
        preds = rng.sample(range(max(0, i - window), i), rng.randint(1, min(fan_in, i, window)))
        kind = rng.random()
        single = nodes[preds[0]].name
        if kind < 0.2 and len(preds) == 1:  # a view of its input (or of one element of a tuple)
            element = rng.randrange(2) if single in tuples else 0
            outputs, aliases = (_meta(1),), ((0, element),)
        elif kind < 0.3:  # a tuple of two fresh tensors
            outputs, aliases = (_meta(rng.randint(1, 60)), _meta(rng.randint(1, 60))), (None, None)
            tuples.add(name)
        else:
            outputs, aliases = (_meta(rng.randint(1, 100)),), (None,)
        args = tuple(Ref(nodes[j].name) for j in preds)
        workspace = rng.choice([0, 0, 0, rng.randint(1, 30)])
        nodes.append(Node(name, OP, args, outputs=outputs, aliases=aliases, workspace=workspace))
    read = {p for node in nodes for p in node.inputs}
    sinks = [node.name for node in nodes if node.name not in read]
    extra = [node.name for node in nodes if rng.random() < 0.1]
    return Graph(tuple(nodes), tuple(dict.fromkeys(sinks[: rng.randint(1, len(sinks))] + extra)))


def topological_orders(graph: Graph) -> Iterator[list[str]]:
    """Every topological order of ``graph`` (exhaustive)."""
    names = [n.name for n in graph.nodes]
    preds = graph.predecessors
    order: list[str] = []
    done: set[str] = set()

    def extend() -> Iterator[list[str]]:
        if len(order) == len(names):
            yield list(order)
        for name in names:
            if name not in done and all(p in done for p in preds[name]):
                order.append(name)
                done.add(name)
                yield from extend()
                done.remove(name)
                order.pop()

    yield from extend()


def count_orders(graph: Graph) -> int:
    """The number of topological orders, by counting over sets of scheduled nodes."""
    index = graph.index
    preds = [sum(1 << index[p] for p in graph.predecessors[n.name]) for n in graph.nodes]
    ways = {0: 1}
    for _ in graph.nodes:
        nxt: dict[int, int] = {}
        for done, count in ways.items():
            for v, mask in enumerate(preds):
                if not done >> v & 1 and mask & done == mask:
                    nxt[done | 1 << v] = nxt.get(done | 1 << v, 0) + count
        ways = nxt
    return sum(ways.values())


graphs = st.builds(random_graph, st.integers(1, 12), st.integers(0, 2**32))


# ---------------------------------------------------------------------- exactness


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(graphs)
def test_dp_peak_equals_brute_force(graph):
    assume(count_orders(graph) <= 2000)
    best = min(peak_memory(graph, order) for order in topological_orders(graph))
    order = dp_schedule(graph)
    assert graph.is_schedule(order)
    assert peak_memory(graph, order) == best
    assert best <= schedule(graph, 2.0).peak <= peak_memory(graph, [n.name for n in graph.nodes])


@settings(max_examples=60, deadline=None)
@given(graphs, st.randoms(use_true_random=False))
def test_incremental_accounting_agrees_with_the_simulator(graph, rng):
    """The DP's running (peak, live bytes) of any order of any segment is the simulator's, up to a constant."""
    order = greedy_schedule(graph)
    lo = rng.randrange(len(order))
    hi = rng.randrange(lo + 1, len(order) + 1)
    problem = segment_problem(graph, order, lo, hi)
    offsets = set()
    for _ in range(5):
        units = _random_order(problem, rng)
        full = order[:lo] + problem.nodes(units) + order[hi:]
        assert graph.is_schedule(full)
        timeline = simulate_memory(graph, full).timeline
        if units:
            offsets.add(max(timeline[lo:hi]) - problem.run(units).peak)
        if (lo, hi) == (0, len(order)) and units:
            assert problem.run(units).peak + memory_facts(graph).persistent_bytes == max(timeline)
    assert len(offsets) <= 1
    assert problem.lower_bound <= min(problem.run(_random_order(problem, rng)).peak for _ in range(3))


def _random_order(problem, rng) -> list[int]:
    state, units = problem.start(), []
    while state.ready:
        ready = [u for u in range(len(problem)) if state.ready >> u & 1]
        u = rng.choice(ready)
        units.append(u)
        state = problem.advance(state, u)
    return units


def _chain_with_side_branch() -> Graph:
    """a0 -> a1 -> a2 -> a3 and a0 -> b."""
    nodes = [Node("a0", None, outputs=(_meta(4),), aliases=(None,), role=Role.PARAMETER)]
    for i in range(1, 4):
        nodes.append(Node(f"a{i}", OP, (Ref(f"a{i - 1}"),), outputs=(_meta(4),), aliases=(None,)))
    nodes.append(Node("b", OP, (Ref("a0"),), outputs=(_meta(4),), aliases=(None,)))
    return Graph(tuple(nodes), ("a3", "b"))


def test_narrow_waist_counts_the_nodes_free_to_move():
    assert narrow_waist(_chain_with_side_branch()) == {"a0": 0, "a1": 1, "a2": 1, "a3": 1, "b": 3}


def test_dp_timeout_and_budget_are_reported():
    source = Node("p", None, outputs=(_meta(8),), aliases=(None,), role=Role.PARAMETER)
    wide = [Node(f"w{i}", OP, (Ref("p"),), outputs=(_meta(10 + i),), aliases=(None,)) for i in range(24)]
    graph = Graph((source, *wide), tuple(n.name for n in wide))  # 2^24 signatures
    with pytest.raises(ScheduleTimeout):
        dp_schedule(graph, time_limit_s=0.0)
    with pytest.raises(ValueError, match="budget"):
        dp_schedule(_chain_with_side_branch(), budget=4)


# ---------------------------------------------------------------------- validity at scale


@pytest.mark.parametrize(
    "graph",
    [random_graph(5000, 7), random_nasnet_graph(277, 1), random_randwire_graph(5000, 2)],
    ids=["random-dag", "nasnet", "randwire"],
)
def test_every_scheduler_returns_a_valid_order_at_5000_nodes(graph):
    assert len(graph) > 4900
    result = schedule(graph, time_limit_s=1.0)
    assert graph.is_schedule(result.order)
    assert result.peak == peak_memory(graph, result.order) <= peak_memory(graph, [n.name for n in graph.nodes])
    assert result.seconds < 5
    assert graph.is_schedule(greedy_schedule(graph))
    new, touched = _remat(graph, random.Random(0))
    assert new.is_schedule(incremental_schedule(graph, list(result.order), new, touched, time_limit_s=0.5))


def _remat(graph: Graph, rng: random.Random) -> tuple[Graph, set[str]]:
    """Give one consumer of a multi-consumer node a recomputed copy of it."""
    name = rng.choice([n.name for n in graph.nodes if len(graph.consumers[n.name]) > 1 and not n.is_input])
    consumer = rng.choice(graph.consumers[name])
    copy = dataclasses.replace(graph[name], name=graph.fresh_name(f"{name}_re"))
    node = graph[consumer]
    moved = dataclasses.replace(node, args=map_refs(node.args, lambda r: Ref(copy.name) if r.name == name else r))
    return graph.replace(remove=[consumer], add=[copy, moved]), {copy.name, consumer}


def _resize(graph: Graph, rng: random.Random) -> tuple[Graph, set[str]]:
    """Double one node's output."""
    node = graph[rng.choice([n.name for n in graph.nodes if n.outputs and n.aliases[0] is None])]
    outputs = tuple(TensorMeta(m.shape, m.dtype, 2 * m.nbytes) if m else m for m in node.outputs)
    return graph.replace(remove=[node.name], add=[dataclasses.replace(node, outputs=outputs)]), {node.name}


@settings(max_examples=30, deadline=None)
@given(st.integers(8, 80), st.integers(0, 2**32), st.integers(1, 5), st.randoms(use_true_random=False))
def test_incremental_schedule_returns_valid_orders(n, seed, steps, rng):
    graph = random_graph(n, seed)
    order = greedy_schedule(graph)
    for _ in range(steps):
        if not any(len(graph.consumers[v.name]) > 1 and not v.is_input for v in graph.nodes):
            break
        new, touched = rng.choice([_remat, _resize])(graph, rng)
        order = incremental_schedule(graph, order, new, touched, time_limit_s=0.3)
        assert new.is_schedule(order)
        graph = new


def test_incremental_keeps_the_order_outside_the_interval():
    graph = random_nasnet_graph(12, 4)
    order = list(schedule(graph, 5.0).order)
    new, touched = _resize(graph, random.Random(1))
    result = incremental_schedule(graph, order, new, touched)
    assert new.is_schedule(result)
    changed = [i for i, (a, b) in enumerate(zip(order, result)) if a != b]
    assert not changed or changed[-1] - changed[0] <= 2 * MAX_EXTEND  # only an interval around the mutation moved
    assert incremental_schedule(graph, order, graph, set()) == order  # nothing touched, nothing moves


# ---------------------------------------------------------------------- runs for real


class Branchy(nn.Module):
    """Parallel branches whose order matters for memory, a dropout, and views."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(16, 64) for _ in range(4))
        self.out = nn.Linear(64, 1)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = sum(self.drop(torch.tanh(b(x))).t().t() for b in self.branches)
        return self.out(h).square().mean()


def _assert_runs_exactly(graph, model, inputs, loss_fn, order):
    assert graph.is_schedule(order)
    report = measure_against_eager(graph, order, model, inputs, loss_fn, seed=11)
    assert report["max_grad_error"] < 1e-5
    simulated = peak_memory(graph, order)
    assert abs(report["measured_peak_bytes"] - simulated) <= 0.02 * simulated


@pytest.mark.parametrize("fixture", ["convnet", "mlp", "branchy"])
def test_optimized_order_runs_with_eager_gradients(fixture, request):
    if fixture == "branchy":
        torch.manual_seed(0)
        model, inputs, loss_fn = Branchy(), (torch.randn(8, 16),), None
    else:
        model, inputs, loss_fn = request.getfixturevalue(fixture)
    model.train()
    graph = magis.capture(model, inputs, loss_fn)
    result = schedule(graph, 5.0)
    assert result.peak <= result.stats["captured_peak"]
    _assert_runs_exactly(graph, model, inputs, loss_fn, list(result.order))


@functools.cache
def tiny(name: str) -> tuple[Built, Graph]:
    """A tiny workload and its captured training step (captured once per test session)."""
    built = get_workload(name).build("tiny")
    return built, magis.capture(built.model, built.example_inputs, built.loss_fn)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_tiny_workloads_run_optimized_orders_exactly(name):
    built, graph = tiny(name)
    result = schedule(graph, 1.0)
    assert result.peak <= result.stats["captured_peak"]
    _assert_runs_exactly(graph, built.model, built.example_inputs, built.loss_fn, list(result.order))


# ---------------------------------------------------------------------- identity rewrites


class ConcatConv(nn.Module):
    """Branches concatenated into a frozen convolution (no backward reads the concatenation)."""

    def __init__(self, depthwise: bool) -> None:
        super().__init__()
        self.fuse = nn.Conv2d(9, 18, 3, padding=1, groups=9) if depthwise else nn.Conv2d(9, 5, 3, padding=1)
        self.fuse.requires_grad_(False)
        self.head = nn.Conv2d(self.fuse.out_channels, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fuse(torch.cat([x.relu(), x.sigmoid(), x * 2], 1))
        return self.head(y).square().mean()


@pytest.mark.parametrize("depthwise", [False, True], ids=["conv", "depthwise"])
def test_identity_rewrites_keep_the_values(depthwise):
    find, apply = (
        (find_concat_depthwise, apply_concat_depthwise) if depthwise else (find_concat_conv, apply_concat_conv)
    )
    torch.manual_seed(0)
    model, x = ConcatConv(depthwise), torch.randn(2, 3, 8, 8)
    graph = magis.capture(model, (x,))
    matches = find(graph)
    assert len(matches) == 1 and matches[0].channels == (3, 3, 3)
    rewritten = apply(graph, matches[0])
    assert not any(n.op_name == "aten.cat.default" and n.name == matches[0].concat for n in rewritten.nodes)
    before, after = run_step(graph, model, (x,)), run_step(rewritten, model, (x,))
    torch.testing.assert_close(after.loss, before.loss)
    for name, grad in before.gradients.items():
        torch.testing.assert_close(after.gradients[name], grad, rtol=1e-5, atol=1e-6)
    order = list(schedule(rewritten, 2.0).order)
    _assert_runs_exactly(rewritten, model, (x,), None, order)


def test_identity_rewrites_leave_a_trained_convolution_alone():
    """In a training step the conv's backward reads the concatenation: nothing to rewrite."""
    _, graph = tiny("unet")
    assert any(n.op_name == "aten.cat.default" for n in graph.nodes)
    assert find_concat_conv(graph) == [] and find_concat_depthwise(graph) == []
