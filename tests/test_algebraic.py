"""The algebraic matmul rewrites (magis.rules.algebraic) and the Weisfeiler-Lehman graph
hash the search skips seen graphs with (magis.search.graph_hash)."""

from __future__ import annotations

import heapq
from dataclasses import replace

import pytest
import torch
from test_fission import assert_runs_like_eager, captured, in_float64
from torch import nn

from magis.analysis.ftree import update_ftree
from magis.cost.memory import simulate_memory
from magis.frontend.capture import capture
from magis.ir.graph import Graph, Ref, map_refs
from magis.models import WORKLOADS
from magis.rules.algebraic import (
    find_shared_matmuls,
    find_stacked_matmuls,
    merge_rewrites,
    split_rewrites,
)
from magis.rules.ftree_mutation import apply_ftree
from magis.rules.in_place import in_place, in_place_candidates
from magis.search.graph_hash import wl_hash
from magis.search.state import changed_nodes

aten = torch.ops.aten


@pytest.fixture(scope="module")
def bert():
    return captured(in_float64(WORKLOADS["bert-base"].build("tiny", seed=0)))


def matmuls(graph: Graph) -> int:
    return sum(n.target is aten.mm.default for n in graph.nodes)


def test_qkv_weight_gradients_merge_exactly(bert):
    groups = find_shared_matmuls(bert.graph)
    assert len(groups) == 2 and all(len(g.matmuls) == 3 for g in groups)  # Q/K/V of each layer
    merged = bert.graph
    for _ in groups:
        merged = merge_rewrites(merged)[0].graph
    assert matmuls(merged) == matmuls(bert.graph) - 4
    assert not find_shared_matmuls(merged)
    assert_runs_like_eager(bert, merged, tuple(n.name for n in merged.nodes))


def test_split_is_the_inverse_of_merge(bert):
    rewrite = merge_rewrites(bert.graph)[0]
    assert rewrite.description.startswith("merge 3 matmuls")
    assert len(find_stacked_matmuls(rewrite.graph)) == 1 and not find_stacked_matmuls(bert.graph)
    split = split_rewrites(rewrite.graph)[0].graph
    assert matmuls(split) == matmuls(bert.graph)
    assert not any(n.target is aten.cat.default and "stack" in n.name for n in split.nodes)
    assert_runs_like_eager(bert, split, tuple(n.name for n in split.nodes))


def relabelled(graph: Graph) -> Graph:
    """``graph`` with every node renamed and the node list in another topological order."""
    new = {n.name: f"x{i}_{n.name[::-1]}" for i, n in enumerate(reversed(graph.nodes))}

    def ren(ref: Ref) -> Ref:
        return Ref(new[ref.name])

    nodes = {
        new[n.name]: replace(n, name=new[n.name], args=map_refs(n.args, ren), kwargs=map_refs(n.kwargs, ren))
        for n in graph.nodes
    }
    indeg = {name: len(n.inputs) for name, n in nodes.items()}
    readers: dict[str, list[str]] = {name: [] for name in nodes}
    for name, n in nodes.items():
        for p in n.inputs:
            readers[p].append(name)
    heap = [(-i, name) for i, name in enumerate(nodes) if indeg[name] == 0]  # latest ready first
    heapq.heapify(heap)
    order = []
    while heap:
        _, name = heapq.heappop(heap)
        order.append(nodes[name])
        for r in readers[name]:
            indeg[r] -= 1
            if indeg[r] == 0:
                heapq.heappush(heap, (-len(order), r))
    sig = graph.signature
    signature = replace(
        sig,
        parameters={new[k]: v for k, v in sig.parameters.items()},
        buffers={new[k]: v for k, v in sig.buffers.items()},
        user_inputs=tuple(new[k] for k in sig.user_inputs),
        loss=new[sig.loss],
        gradients={k: new[v] for k, v in sig.gradients.items()},
        buffer_updates={k: new[v] for k, v in sig.buffer_updates.items()},
    )
    edges = tuple((new[a], new[b]) for a, b in graph.order_edges)
    return Graph(tuple(order), tuple(new[o] for o in graph.outputs), signature, edges)


def test_wl_hash_sees_through_names_and_node_order(bert):
    other = relabelled(bert.graph)
    assert [n.name for n in other.nodes] != [n.name for n in bert.graph.nodes]
    assert [n.op_name for n in other.nodes] != [n.op_name for n in bert.graph.nodes]
    assert wl_hash(other) == wl_hash(bert.graph)


def test_wl_hash_tells_different_graphs_apart(bert):
    graph = bert.graph
    base = wl_hash(graph)
    assert wl_hash(merge_rewrites(graph)[0].graph) != base
    assert wl_hash(merge_rewrites(graph)[1].graph) != wl_hash(merge_rewrites(graph)[0].graph)
    # one constant changed: the first float argument of some node, doubled
    scaled = next(n for n in graph.nodes if any(isinstance(a, float) for a in n.args))
    args = tuple(a * 2 if isinstance(a, float) else a for a in scaled.args)
    changed = Graph(
        tuple(replace(n, args=args) if n.name == scaled.name else n for n in graph.nodes),
        graph.outputs,
        graph.signature,
        graph.order_edges,
    )
    assert wl_hash(changed) != base
    # the two operands of a matmul swapped (the hash knows argument order)
    sub = next(n for n in graph.nodes if n.target is aten.mm.default)
    swapped = Graph(
        tuple(replace(n, args=(n.args[1], n.args[0], *n.args[2:])) if n.name == sub.name else n for n in graph.nodes),
        graph.outputs,
        graph.signature,
        graph.order_edges,
    )
    assert wl_hash(swapped) != base


class Chain(nn.Module):
    """Forty ReLUs, one of them a tanh: where it sits is all that tells two chains apart
    (further from either end than a few rounds of refinement reach)."""

    def __init__(self, odd: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))
        self.odd = odd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        for i in range(40):
            y = torch.tanh(y) if i == self.odd else torch.relu(y)
        return y.sum()


def test_wl_hash_tells_where_a_block_sits_in_a_long_chain():
    x = torch.randn(4, 8)
    hashes = {odd: wl_hash(capture(Chain(odd), (x,))) for odd in (12, 20, 28)}
    assert len(set(hashes.values())) == 3
    assert wl_hash(capture(Chain(20), (x,))) == hashes[20]


def test_ftree_is_reanalysed_only_where_a_rewrite_touched_it(bert):
    graph, tree = bert.graph, bert.tree
    rewrite = merge_rewrites(graph)[0]
    touched = changed_nodes(graph, rewrite.graph)
    i = next(i for i, c in enumerate(tree.candidates) if c.nodes.isdisjoint(touched) and c.length % 2 == 0)
    enabled = tree.with_parts({i: 2})
    order = tuple(n.name for n in rewrite.graph.nodes)
    updated = update_ftree(enabled, rewrite.graph, simulate_memory(rewrite.graph, order), touched)
    kept = [j for j, c in enumerate(updated.candidates) if c.axes == tree.candidates[i].axes]
    assert len(kept) == 1 and updated.parts[kept[0]] == 2 and sum(updated.parts) == len(updated) + 1
    for j, c in enumerate(updated.candidates):
        assert c.nodes <= set(rewrite.graph.index)
        if c.parent is not None:
            assert c.nodes < updated.candidates[c.parent].nodes
        for other in updated.candidates[:j]:
            assert c.nodes.isdisjoint(other.nodes) or c.nodes < other.nodes or other.nodes < c.nodes
    untouched = {c.axes for c in tree.candidates if c.nodes.isdisjoint(touched)}
    assert untouched <= {c.axes for c in updated.candidates}
    # the merged matmul is in a component Algorithm 1 ran on again: new candidates may hold new nodes
    assert apply_ftree(rewrite.graph, updated, order).graph is not rewrite.graph


class SharedLayer(nn.Module):
    """One layer applied to two inputs: two independent matmuls reading one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8, bias=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(a)) + self.layer(b)


def test_a_matmul_written_in_place_is_never_merged():
    """Merged, two matmuls' results share one storage: a ReLU written into one of them would be
    ordered after every reader of the other (a cycle where those read what the ReLU makes)."""
    graph = capture(
        SharedLayer().double(), tuple(torch.randn(4, 8, dtype=torch.float64) for _ in range(2)), lambda out: out.sum()
    )
    assert find_shared_matmuls(graph), "the two inputs' matmuls read the same weight"
    written = in_place(graph, in_place_candidates(graph))
    assert written.writers, "a ReLU runs in place on a matmul's result"
    writes_into = {key[0] for key in written.writers}
    left = {m for shared in find_shared_matmuls(written) for m in shared.matmuls}
    assert not left & writes_into
    for rewrite in merge_rewrites(written):
        order = [n.name for n in rewrite.graph.nodes]
        assert len(order) == len(set(order)) == len(rewrite.graph.index)
