"""The first level of MAGIS Algorithm 3 (lines 10-11): the states the search starts from.

The step made separable along its samples gets its F-Tree (Algorithm 1); the first
level holds each F-Tree root at every fission number, the points of a recompute greedy
(each with its roots fissioned too) and every other F-Tree node at its smallest fission
number (the Mutate rule raises it later, reaching what :mod:`magis.search.single_fission`
enumerates), so a feasible plan comes early however large the graph. Its states keep the
order carried over from their parent (a region runs where its nodes ran): a feasible plan
comes fast, and their children are rescheduled.

The recompute greedy (the *dive*) walks the separable step's peak/latency front
(:func:`magis.search.rule_front.recompute_front`); where swapping is registered, the swap
greedy walks on from points of that front (:func:`magis.search.rule_front.swap_front`).
Where a root's fission moves the peak (the separable step's peak was in the region), the
recompute greedy also walks from that fission (the *refinement*): what it recomputes is
what waits at the new peak, not at the old one. Algorithm 3 reaches such plans too, one
rewrite at a time, but each of its expansions simulates every candidate of every rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from magis.analysis.ftree import next_divisor, update_ftree
from magis.cost.host_link import host_bytes_per_second
from magis.cost.memory import simulate_memory
from magis.ir.graph import Graph
from magis.rules.canonical import canonical_rewrites
from magis.rules.compact import bit_mask_proposals, packed_masks
from magis.rules.early_update import early_updates
from magis.rules.fission import FissionRegion
from magis.rules.output_backward import backward_from_outputs, batch_norms_from_outputs
from magis.rules.rewrite import Rewrite, Timeline
from magis.rules.tied_gradient import tied_gradient_rewrites
from magis.schedule import incremental_schedule
from magis.search.ledger import INCREMENTAL_S, Ledger
from magis.search.rule_front import FrontPoint, RuleFront, pareto, recompute_front, swap_front
from magis.search.single_fission import fission_numbers, separable_step
from magis.search.state import MState, Mutation, Step, changed_nodes, fission_changes

#: share of the time budget the recompute greedy of the first level may spend
DIVE_SHARE = 0.4
#: share of the time left when the first level starts after which the roots' fissions stop, so
#: that the greedies still run. ResNet-50's full step at small size (1,890 nodes, BN between every
#: two convolutions) has dozens of roots at two to five ``n`` each, a second or two apiece on a CPU,
#: and with a 3-minute budget they took all of it while the recompute greedy alone reaches 0.70 of
#: the peak at 1.10x. Of the time left, not of the budget: on Echo's NMT at paper size (13,526
#: nodes) the first schedule takes 16 s of a 60 s budget, and 0.3 of the budget left the roots no
#: time at all, so no plan split the vocabulary head that holds half the peak.
ROOTS_SHARE = 0.3
#: a root fission that peaks at most this share of the separable step's peak has moved the
#: peak; where tensors outside its region hold most of the new peak, the recompute greedy
#: walks from it too (:meth:`FirstLevel._refine`), in half of the dive's time. At paper size
#: (h200) the best root fission within the limit peaks at 0.30 of the separable step on Echo's
#: NMT (1.05x), 64% of it outside the region; at 0.32 on BERT, 0.16 on U-Net, 0.36 on VGG-16
#: (1.10x), 13-23% outside (their region is nearly the whole step); at 0.998 on ResNet-50 and
#: 0.9999 on GoogLeNet, whose plans recompute in place, and half of the dive's time lost cost
#: them 0.386 -> 0.409 and 0.319 -> 0.344 of eager's peak.
MOVED_PEAK = 0.9
#: points of that greedy's front made states (each then fissioned along its roots)
DIVE_STATES = 6
#: more points of the recompute front made states with their masks packed (:meth:`FirstLevel._packed_points`)
PACKED_POINTS = 2
#: points of the recompute dive the swap greedy walks on from (:meth:`FirstLevel._swap_dive`):
#: on ResNet-50 at paper size (h200, 1.10x) 3 starts gave 0.409 of eager's peak, 6 gave 0.386
#: (a start with fewer recomputations hides a third swap within the limit)
SWAP_STARTS = 6

#: states of the separable step with one F-Tree root enabled, by the root's label and ``n``
Roots = dict[tuple[str, int], MState]


@dataclass
class FirstLevel:
    """The first level of one search: the states it makes go to ``ledger`` (considered and queued)."""

    ledger: Ledger
    rules: frozenset[str]  # names of the M-Rules taking part
    levels: int  # F-Tree levels (Algorithm 1)
    #: states made of the dive's points before the first level reaches them (a swap
    #: start's plan within the memory limit: :meth:`_swap_dive`), by the point's id
    early: dict[int, MState] = field(default_factory=dict)
    #: the recompute greedy's whole front (:meth:`_dive`)
    front: list[FrontPoint] = field(default_factory=list)

    def run(self, graph: Graph, initial: MState) -> None:
        """The separable step with its F-Tree and its roots fissioned (:meth:`_fissions`),
        the points of the recompute and swap greedies (:meth:`_dive`), best first, each
        with its roots fissioned where the limit points (:meth:`_dive_fissions`), then
        every other F-Tree node of the separable step at its smallest ``n``, then the
        points' roots at every other ``n``: the likeliest plans first, so that a feasible
        one comes soonest."""
        ledger = self.ledger
        step = separable_step(graph, initial.order, self.levels)
        root = Mutation(
            step.graph, step.order, step.tree, step.graph, step.order, (Step("separable", "make separable"),)
        )
        separable = ledger.evaluate(initial, root, reschedule=False)
        if separable is None:  # nothing to rewrite: the captured step is separable as it is
            separable = replace(initial, tree=step.tree)
        ledger.consider(separable, push=True)
        if "backward-from-output" in self.rules:  # the same values from fewer saved tensors
            separable = self._as_base(separable, "backward-from-output", backward_from_outputs(separable.base))
        if "batch-norm-from-output" in self.rules:  # saves the output alone, recomputing the activation
            rewrites = batch_norms_from_outputs(separable.base, separable.base_order)
            separable = self._as_base(separable, "batch-norm-from-output", rewrites)
        if "tied-gradient" in self.rules:  # exact; where the sum is the peak nothing else lowers it
            rewrites = tied_gradient_rewrites(separable.base, separable.base_order)
            separable = self._as_base(separable, "tied-gradient", rewrites)
        if "canonical" in self.rules and graph.signature.inference:
            self._canonical(separable)
        if "compact" in self.rules:
            self._packed_masks(separable)
        if "early-update" in self.rules:
            separable = self._early_updates(separable)
        now = time.perf_counter()
        roots = self._fissions(separable, roots=True, until=now + ROOTS_SHARE * (ledger.deadline - now))
        fissioned = self._fissioned_start(separable, roots)
        share = DIVE_SHARE if fissioned is None else DIVE_SHARE / 2
        points = self._dive(separable, share)
        if fissioned is not None:
            self._refine(fissioned, share)
        dived = self._dived(points, separable, roots)
        if dived is None:
            return
        self.early.clear()  # those the spread along the front left out stay states, unfissioned
        self._fissions(separable, roots=False)
        for state in dived:  # where time is left (small graphs): every n the estimate passed over
            self._fissions(state, roots=True)

    def _dived(self, points: list[FrontPoint], separable: MState, roots: Roots) -> list[MState] | None:
        """The greedies' ``points``, best first by the estimate, each made a state and fissioned
        where the limit lies (:meth:`_dive_fissions`), and again with its masks packed; once the
        first is packed, the points packing suits best too (:meth:`_packed_points`). None where
        the budget ran out."""
        dived: list[MState] = []
        ranked_more = False
        for point in sorted(points, key=lambda p: self._with_fission(p, separable, roots)[1]):
            if self.ledger.out_of_budget():
                return None
            state = self.early.pop(id(point), None) or self._dive_state(separable, point)
            if state is None:
                continue
            self._dive_fissions(state, separable, roots)
            dived.append(state)
            packed = self._packed_fissioned(state, separable, roots) if "compact" in self.rules else None
            if packed is not None:
                dived.append(packed)
                if not ranked_more:  # at the first packed point: on large steps the budget ends before the last
                    ranked_more = True
                    dived += self._packed_points(state, packed, separable, roots, {id(p) for p in points})
        return dived

    def _packed_fissioned(self, state: MState, separable: MState, roots: Roots) -> MState | None:
        """``state`` with its masks packed (:meth:`_packed_masks`), fissioned where the limit lies
        (:meth:`_dive_fissions`); None where no mask packs."""
        packed = self._packed_masks(state)
        if packed is not None:
            self._dive_fissions(packed, separable, roots)
        return packed

    def _as_base(self, separable: MState, rule: str, rewrites: Iterable[Rewrite]) -> MState:
        """The first of ``rule``'s ``rewrites`` of the separable step whose peak is no higher, as a
        state of its own and the base of the rest of the first level (the main loop, which would
        find it too, may never be reached on a large step); ``separable`` where none is."""
        for rewrite in rewrites:
            order = rewrite.order or tuple(n for n in separable.base_order if n in rewrite.graph.index)
            touched = rewrite.touched or changed_nodes(separable.base, rewrite.graph)
            state = self._rewritten(separable, rewrite.graph, order, touched, rule, rewrite.description)
            if state is not None and state.peak_bytes <= separable.peak_bytes:
                return state
        return separable

    def _canonical(self, separable: MState) -> None:
        """An inference's free rewrites at once (:mod:`magis.rules.canonical`) as a state of its
        own. The main loop reaches it only from a state it expands, and on Serenity's networks
        the dive's recomputations, lower at first, are expanded before it (SwiftNet at paper size:
        30 s of search never took it, 1.43x below PyTorch's order instead of 1.67x). Not the
        base of the first level: its partitioned convolutions cost time a latency limit may
        not leave."""
        for rewrite in canonical_rewrites(separable.base):
            touched = changed_nodes(separable.base, rewrite.graph)
            order = incremental_schedule(separable.base, separable.base_order, rewrite.graph, touched, INCREMENTAL_S)
            self._rewritten(separable, rewrite.graph, tuple(order), touched, "canonical", rewrite.description)

    def _packed_masks(self, parent: MState) -> MState | None:
        """``parent`` (the separable step or a point of the recompute greedy) with every saved
        bool mask packed into bits where it is made (:mod:`magis.rules.compact`, Echo §IV-B), a
        state of its own whose F-Tree regions unpack each part's slice inside the region
        (:func:`~magis.analysis.ftree.with_expanding_producers`); None where no mask packs.
        Not the base of the first level: on BERT at paper size (h200) the packed base lowered
        the plan at a 0.3 memory limit (0.293 @ 1.099 against 0.298 @ 1.117) but raised the
        lowest peak within 10% (0.344 against 0.312): packing costs the time recomputation
        needed. Each point of the greedy packed and then fissioned along its roots is what
        the main loop would reach in two steps, the first far above the best, and on BERT at
        paper size the first level takes the whole budget."""
        timeline = Timeline.of(parent.base, parent.base_order)
        rewrite = packed_masks(parent.base, timeline, bit_mask_proposals(parent.base, timeline, at_source=True))
        if rewrite is None:
            return None
        return self._rewritten(parent, rewrite.graph, rewrite.order, rewrite.touched, "compact", rewrite.description)

    def _packed_points(
        self, state: MState, packed: MState, separable: MState, roots: Roots, made: set[int]
    ) -> list[MState]:
        """The :data:`PACKED_POINTS` points of the recompute front (not among ``made``) that the
        first level's estimate (:meth:`_with_fission`) ranks best once packed as ``state`` was
        (``packed``: the time packing added, the bytes it saved) and fissioned, each made a
        state, packed, and fissioned. Packing costs time the limit may not leave after the
        point the estimate ranks best unpacked; a point with fewer recomputations leaves it (on
        BERT at paper size, h200, 1.10: packing adds 4.9 ms to a 345 ms plan, and the lowest
        peak within the limit goes from 0.310 to 0.294 of eager's)."""
        added, saved = packed.latency_s - state.latency_s, state.peak_bytes - packed.peak_bytes
        shifted = [
            (p, replace(p, peak_bytes=p.peak_bytes - saved, latency_s=p.latency_s + added))
            for p in self.front
            if id(p) not in made
        ]
        shifted.sort(key=lambda pair: self._with_fission(pair[1], separable, roots)[1])
        states = []
        for point, _ in shifted[:PACKED_POINTS]:
            made_state = self._dive_state(separable, point) if not self.ledger.out_of_budget() else None
            packed_point = self._packed_fissioned(made_state, separable, roots) if made_state is not None else None
            if packed_point is not None:
                states.append(packed_point)
        return states

    def _rewritten(
        self, parent: MState, graph: Graph, order: tuple[str, ...], touched: frozenset[str], rule: str, what: str
    ) -> MState | None:
        """``parent`` rewritten by ``rule`` into ``graph`` in ``order`` as a state of its own
        (evaluated and pushed), or None where its F-Tree is not consistent or the ledger refuses it."""
        profile = simulate_memory(graph, order)
        tree = update_ftree(parent.tree, graph, profile, touched, self.levels)
        if not tree.consistent():
            return None
        state = self.ledger.evaluate(parent, Mutation(graph, order, tree, graph, order, (Step(rule, what),)))
        if state is not None:
            self.ledger.consider(state, push=True)
        return state

    def _early_updates(self, separable: MState) -> MState:
        """The separable step with its optimizer's updates split early (:mod:`magis.rules.early_update`)
        as the base of the rest of the first level: where the activations make the peak, freeing
        gradients early lowers nothing yet, but once fission or recomputation has cut the
        activations the gradients held to the end of the backward are the peak. The base is the
        candidate that splits the most parameters without a higher peak or a latency above the
        limit; every candidate is a state of its own. Without an update to split, ``separable``."""
        best, limit = separable, self.ledger.objective.latency_s
        for rewrite in early_updates(separable.base, separable.base_order):
            state = self._rewritten(
                separable, rewrite.graph, rewrite.order, rewrite.touched, "early-update", rewrite.description
            )
            fits = state is not None and (limit is None or state.latency_s <= limit)
            if fits and state.peak_bytes <= separable.peak_bytes:
                best = state  # the rule lists its candidates by more parameters split
        return best

    # ------------------------------------------------------------------ fission
    def _fissions(self, parent: MState, roots: bool, until: float | None = None) -> Roots:
        """States of ``parent`` with one F-Tree node enabled: each root at every ``n``
        (``roots``), or each other node at its smallest ``n`` (the Mutate rule raises it
        later). A root spans the most of the step (the whole step along its samples is
        gradient accumulation), so the plans that trade parts for memory are there at
        once, not after many Mutate steps. The order carried over is kept. Stops at the
        budget's end or at ``until`` (a ``time.perf_counter()`` instant). Returns the
        states made, by the node's label and ``n``."""
        tree = parent.tree
        if roots:
            chosen = [
                (i, n) for i, c in enumerate(tree.candidates) if c.parent is None for n in fission_numbers(c.length)
            ]
        else:
            chosen = [(i, next_divisor(c.length, 1)) for i, c in enumerate(tree.candidates) if c.parent is not None]
        made = {}
        for i, parts in chosen:
            if self.ledger.out_of_budget() or (until is not None and time.perf_counter() > until):
                break
            child = self._enabled(parent, i, parts)
            if child is not None:
                made[(tree.candidates[i].label, parts)] = child
        return made

    def _enabled(self, parent: MState, i: int, parts: int) -> MState | None:
        """``parent`` with F-Tree node ``i`` enabled at ``parts``, in the order carried over
        and considered (None where it does not apply or was seen)."""
        ledger, tree = self.ledger, parent.tree
        enabled = tree.with_parts({i: parts})
        step = Step("enable", fission_changes(tree, enabled))
        mutation = ledger.applied(parent.base, parent.base_order, enabled, step)
        child = ledger.evaluate(parent, mutation, reschedule=False) if mutation is not None else None
        if child is not None:
            ledger.consider(child, push=True)
        return child

    def _dive_fissions(self, state: MState, separable: MState, roots: Roots) -> None:
        """Each root of a point of the recompute greedy fissioned at the ``n`` where the
        limit lies. Fission and recomputation add their time and save their memory
        nearly independently: the separable step's root fissions (``roots``) tell, with
        what the greedy added and saved, which ``n`` just meets the limit (latency mode:
        the largest within it; memory mode: the smallest within it). From that guess the
        search walks ``n`` up or down until whether the limit is met changes: two or three
        states per root instead of one per fission number, on graphs where each costs seconds."""
        objective = self.ledger.objective
        likely, _ = self._with_fission(state, separable, roots)
        for i, candidate in enumerate(state.tree.candidates):
            if candidate.parent is not None:
                continue
            numbers = fission_numbers(candidate.length)
            guess = likely.get(candidate.label)
            k = numbers.index(guess) if guess in numbers else 0
            direction = 0
            while 0 <= k < len(numbers) and not self.ledger.out_of_budget():
                child = self._enabled(state, i, numbers[k])
                if child is None:
                    break
                # a state within the limit: in latency mode more parts may save more; in
                # memory mode fewer parts may cost less time (and the other way round)
                within = objective.met_by(child)
                step = 1 if within == (objective.mode == "latency") else -1
                if direction and step != direction:
                    break
                direction, k = step, k + step

    def _with_fission(
        self, point: FrontPoint | MState, separable: MState, roots: Roots
    ) -> tuple[dict[str, int], tuple]:
        """The fission number of each root where the limit lies for a plan that recomputes
        what ``point`` does (see :meth:`_dive_fissions`), and the objective's rank of that
        plan, estimated: fission and recomputation add their time nearly independently,
        and recomputation saves ``1/n`` of its bytes in each of ``n`` parts. The estimate
        is read off the separable step's fissions of each root (``roots``)."""
        objective = self.ledger.objective
        added = point.latency_s - separable.latency_s
        saved = separable.peak_bytes - point.peak_bytes
        numbers: dict[str, list[int]] = {}
        for label, n in roots:
            numbers.setdefault(label, []).append(n)
        parts: dict[str, int] = {}
        ranks = [objective.rank(point.peak_bytes, point.latency_s)]  # no fission at all
        for label, ns in numbers.items():
            estimates = {n: (roots[(label, n)].peak_bytes - saved / n, roots[(label, n)].latency_s + added) for n in ns}
            if objective.mode == "latency":
                assert objective.latency_s is not None
                within = [n for n, (_, latency) in estimates.items() if latency <= objective.latency_s]
                parts[label] = max(within, default=min(ns))
            else:
                assert objective.memory_bytes is not None
                within = [n for n, (peak, _) in estimates.items() if peak <= objective.memory_bytes]
                parts[label] = min(within, default=max(ns))
            ranks.append(objective.rank(*estimates[parts[label]]))
        return parts, min(ranks)

    # ------------------------------------------------------------------ the greedies' dives
    def _fissioned_start(self, separable: MState, roots: Roots) -> MState | None:
        """The root fission the objective ranks best among those that meet the latency limit
        (if any) and move the peak (:data:`MOVED_PEAK`), if tensors outside its region hold
        most of its peak (:func:`outside_regions`; the greedy cannot recompute inside a
        region): the start of :meth:`_refine`; None where there is no such fission."""
        objective = self.ledger.objective
        lower = [
            state
            for state in roots.values()
            if state.peak_bytes <= MOVED_PEAK * separable.peak_bytes
            and (objective.latency_s is None or state.latency_s <= objective.latency_s)
        ]
        best = min(lower, key=lambda s: objective.rank(s.peak_bytes, s.latency_s), default=None)
        return best if best is not None and 2 * outside_regions(best) >= best.peak_bytes else None

    def _refine(self, fissioned: MState, share: float) -> None:
        """The recompute greedy from a root fission (``fissioned``), within ``share`` of the
        budget: the separable step's dive recomputes for its own peak, which a fission may
        move elsewhere. On Echo's NMT at paper size (h200, 1.05x) the separable step peaks
        at the attention's score maps, which no recomputation lowers much (2,642 to 2,425 MiB
        in the dive's 24 s) and the fission of the attention into 8 parts cuts to 800 MiB,
        where the LSTM cells' outputs wait for the backward: recomputed from the fissioned
        step, one output of each saves 13 MiB at +0.03%, 48 of them 36 MiB within 5%.
        Each point, spread along the front, becomes a state whose base holds the region
        (:attr:`~magis.search.state.MState.frozen`)."""
        ledger = self.ledger
        deadline = min(time.perf_counter() + share * ledger.time_budget, ledger.deadline)
        if "remat" not in self.rules or deadline <= time.perf_counter():
            return
        front = self._recompute_front(fissioned.graph, fissioned.order, deadline)
        for point in self._spread([p for p in front.points if p.graph is not fissioned.graph]):
            self._dive_state(fissioned, point)

    def _recompute_front(self, graph: Graph, order: Sequence[str], deadline: float, **options: Any) -> RuleFront:
        """The recompute greedy's front from ``graph`` in ``order`` until ``deadline``, within the
        objective's limits (``options``: the greedy's own)."""
        objective = self.ledger.objective
        return recompute_front(
            graph,
            self.ledger.cost_model,
            order,
            time_budget=deadline - time.perf_counter(),
            latency_limit_s=objective.latency_s,
            peak_limit_bytes=objective.memory_bytes,
            **options,
        )

    def _dive(self, separable: MState, share: float) -> list[FrontPoint]:
        """The greedy of the recompute rule walks from the separable step down its
        peak/latency front (:func:`magis.search.rule_front.recompute_front`), never past
        the latency limit, no further down than the memory limit; where swapping is
        registered (a device with memory of its own), the greedy of the swap rule walks on
        from points of that front (:meth:`_swap_dive`), and in memory mode the recompute
        greedy stops where the best it can do frees memory more slowly than the host link
        moves it (what it leaves, a swap may move, and the limit is met sooner). Both share
        ``share`` of the budget. Of each dive, up to :data:`DIVE_STATES` points
        spread along its front and the one the objective ranks best are returned, to be
        made states (:meth:`_dive_state`) and fissioned."""
        ledger, objective = self.ledger, self.ledger.objective
        swapping, memory_mode = "swap" in self.rules, objective.mode == "memory"
        rate_floor = host_bytes_per_second(ledger.cost_model) if swapping and memory_mode else None
        deadline = min(time.perf_counter() + share * ledger.time_budget, ledger.deadline)
        start = FrontPoint(
            separable.peak_bytes, separable.latency_s, separable.base, separable.base_order, peak_steps=0
        )
        recomputed: list[FrontPoint] = []
        if "remat" in self.rules and deadline > time.perf_counter():
            front = self._recompute_front(
                separable.base,
                separable.base_order,
                deadline,
                at_limits=memory_mode,  # a latency limit's points get fissioned
                min_saving_rate=rate_floor,
            )
            recomputed = [p for p in front.points if p.graph is not separable.base]  # the start is no dive
            self.front = recomputed
        fits = memory_mode and any(objective.met_by(p) for p in recomputed)
        if not swapping or fits:  # in memory mode: nothing left to swap for
            return self._spread(recomputed)
        if rate_floor is None:  # spread along the front within the limit: which start is best depends on it
            # (a swap hidden behind the recomputations adds no time, so the lowest point within the
            # latency limit is a start: on ResNet-50 at paper size, h200, two swaps took its 0.481 of
            # eager's peak to 0.409 at the same 1.092x; the front's last point, past the limit, was the
            # start instead, and no swap could follow it)
            within = [p for p in recomputed if objective.latency_s is None or p.latency_s <= objective.latency_s]
            starts = [within[k] for k in sorted(_evenly_spaced(len(within), SWAP_STARTS))] or [start]
        else:  # each point freed memory faster than a swap would: the most recomputed ones
            starts = recomputed[-SWAP_STARTS:] or [start]
        swapped = self._swap_dive(separable, starts, deadline)
        return [*self._spread(recomputed), *self._spread(list(pareto(swapped)))]

    def _swap_dive(self, separable: MState, starts: list[FrontPoint], deadline: float) -> list[FrontPoint]:
        """The swap greedy (:func:`~magis.search.rule_front.swap_front`) from each of
        ``starts``, the most recomputed first, each given an equal share of the time left
        and stopping at the limits: swapping moves tensors recomputation cannot reach (a
        convolution's output before a batch norm), and which start is best depends on
        the limit. The first start's plan within a memory limit is made a state at once
        (:attr:`early`): a feasible plan as soon as there is one, not after every start.
        On ResNet-50 at paper size (h200) under 0.4 of eager's peak that plan comes two
        swaps after the recompute front's lowest point; the later starts give faster ones."""
        ledger, objective = self.ledger, self.ledger.objective
        points: list[FrontPoint] = []
        starts = sorted(starts, key=lambda p: p.peak_bytes)
        for k, start in enumerate(starts):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            front = swap_front(
                start.graph,
                ledger.cost_model,
                start.order,
                time_budget=left / (len(starts) - k),
                latency_limit_s=objective.latency_s,
                peak_limit_bytes=objective.memory_bytes,
            )
            walked = [
                replace(p, recomputed=start.recomputed, merged=start.merged)
                for p in front.points
                if p.graph is not start.graph
            ]
            within = [p for p in walked if objective.met_by(p)]
            if within and not objective.met_by(ledger.best):
                first = min(within, key=lambda p: objective.rank(p.peak_bytes, p.latency_s))
                state = self._dive_state(separable, first)
                if state is not None:
                    self.early[id(first)] = state
            points += walked
        return points

    def _spread(self, points: list[FrontPoint]) -> list[FrontPoint]:
        """Up to :data:`DIVE_STATES` points spread along a front, and the best by the objective."""
        if not points:
            return []
        rank = self.ledger.objective.rank
        best = min(range(len(points)), key=lambda k: rank(points[k].peak_bytes, points[k].latency_s))
        return [points[k] for k in sorted(_evenly_spaced(len(points), DIVE_STATES) | {best})]

    def _dive_state(self, start: MState, point: FrontPoint) -> MState | None:
        """A point of a greedy from ``start`` (:meth:`_dive`, :meth:`_refine`) as a state, its
        F-Tree re-analysed (``Analyze``) so that fission can be laid over it; the regions
        ``start`` fissioned are the new base's own (:attr:`~magis.search.state.MState.frozen`)."""
        profile = simulate_memory(point.graph, point.order)
        touched = changed_nodes(start.base, point.graph)
        tree = update_ftree(start.tree, point.graph, profile, touched, self.levels)
        steps = (Step("de-remat", f"merge {len(point.merged)} duplicate operator(s) (greedy)"),) if point.merged else ()
        steps += tuple(Step("remat", f"recompute {target} (greedy)") for target in point.recomputed)
        steps += tuple(Step("swap", f"swap {target} (greedy)") for target in point.swapped)
        frozen = tuple(start.regions()[len(start.frozen) :])
        mutation = Mutation(
            point.graph, point.order, tree, point.graph, point.order, steps, scheduled=True, frozen=frozen
        )
        state = self.ledger.evaluate(start, mutation)
        if state is not None:
            self.ledger.consider(state, push=True)
        return state


def outside_regions(state: MState) -> int:
    """Bytes live at ``state``'s peak that no fissioned region holds (its outputs and the
    part it runs are the region's)."""
    graph = state.graph
    return sum(
        graph.storage_bytes[key] for key in state.memory.hotspots if not isinstance(graph[key[0]].target, FissionRegion)
    )


def _evenly_spaced(length: int, count: int) -> set[int]:
    """Up to ``count`` evenly spaced indices into a sequence of ``length``, the first and last included."""
    return {round(k * (length - 1) / max(count - 1, 1)) for k in range(count)} if length else set()
