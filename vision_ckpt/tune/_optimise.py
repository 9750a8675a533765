"""Choosing one strategy per block so a step fits a memory budget in the least time.

Pure arithmetic over measured figures (no torch, no model): :func:`choose` solves the problem
stated in NOTE [ One strategy per block ]; ``vision_ckpt.tune._menus`` measures the figures and
``vision_ckpt.tune._planner`` checks the answer on the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Option", "Block", "StageOption", "Choice", "choose", "predict", "choose_exhaustively"]


@dataclass(frozen=True)
class Option:
    """One way of running a block, priced at the target batch."""

    strategy: str
    """``keep`` (no checkpoint), ``selective``, ``full``, or ``nested`` (full, with the block's
    inner regions checkpointed again while it is recomputed)."""
    kept: int
    """Bytes the block holds for backward from its forward until its own backward."""
    transient: int
    """Bytes its recomputation brings back, alive while its backward runs (0 for ``keep``)."""
    time: float
    """Seconds of extra work per step (the recomputation; 0 for ``keep``)."""


@dataclass(frozen=True)
class Block:
    """A block of the chain, in forward order, with its menu of options."""

    name: str
    options: tuple[Option, ...]


@dataclass(frozen=True)
class StageOption:
    """An option for a run of consecutive blocks as one region (a stage run selective)."""

    name: str
    """The module that holds the run."""
    first: int
    """Index of its first block in the chain."""
    last: int
    """Index of its last block (inclusive)."""
    option: Option
    """Its price, for the whole run (the figures are the run's, not one block's)."""

    def members(self) -> list[Option]:
        """The options the span puts on its blocks when chosen (see :class:`Choice`)."""
        rest = Option(self.option.strategy, 0, 0, 0.0)
        return [self.option] + [rest] * (self.last - self.first)


@dataclass(frozen=True)
class Choice:
    """The answer of :func:`choose`: an option per block, with the model's prediction."""

    options: tuple[Option, ...]
    """One per block, in the blocks' order. A block inside a chosen span has the span's option
    on its first block and, on the others, the same strategy at no bytes and no time."""
    peak: int
    """Predicted step peak (``base`` included)."""
    time: float
    """Predicted extra seconds per step."""
    spans: tuple[StageOption, ...] = ()
    """The chosen spans."""


# NOTE [ One strategy per block ]
#
# The model is a chain of blocks B1..Bn run in that order (the candidate blocks of a plan, which
# do not overlap), plus everything outside them. Each block runs with one option o from its menu:
# o keeps kept(o) bytes from its forward until its backward, brings transient(o) bytes back while
# its own backward runs (what recomputation rebuilds), and costs time(o) extra seconds.
#
# Peak. Backward visits the blocks in reverse, and a block's kept bytes are freed by its
# backward; so when Bi's backward runs, B1..Bi still hold their kept bytes. With P(i) the sum of
# kept bytes of B1..Bi:
#
#     peak = base + max( P(n), max_i ( P(i) + transient(Bi) ) )
#
# where base is what the step holds besides the blocks' kept bytes (weights, gradients,
# optimizer state, the stem's and head's activations, the backward's own buffers), found by
# subtracting the blocks' kept bytes from a measured plain step.
#
# Problem. Minimise the sum of time(o) subject to peak <= budget.
#
# Algorithm. The constraints only involve prefix sums, so a dynamic program over the blocks in
# forward order, with state P(i) (bytes rounded *up* to a grid of `resolution` steps between 0
# and budget - base), is exact for this model up to the rounding: best[i][p] = least time for
# B1..Bi with prefix p, and option o of B(i+1) is allowed from p when p + kept(o) +
# transient(o) fits. Rounding up keeps every answer feasible; it can miss plans within one grid
# step of the budget per block. Cost O(n * options * resolution), vectorised.
#
# Spans. A run of consecutive blocks Bi..Bj may also be offered as one unit (a stage run as one
# selective region, which keeps less than its blocks run selective one by one: their boundaries
# are recomputed too). It is priced like a block, and the program moves from block i straight
# to block j + 1 with it; spans may overlap one another as alternatives, never a chosen one.
#
# Assumptions, checked by measuring the answer (the planner corrects the budget and solves again
# when the measured peak is over): kept bytes of neighbouring blocks add up (a tensor two blocks
# both save is counted once, for the first); the forward peak is below the backward one; time
# adds up per block and does not depend on the neighbours' options.


def predict(blocks: Sequence[Block], options: Sequence[Option], base: int) -> tuple[int, float]:
    """Peak and extra time of one option per block, per NOTE [ One strategy per block ].

    >>> keep, full = Option("keep", 10, 0, 0.0), Option("full", 2, 8, 1.0)
    >>> predict([Block("a", (keep, full))] * 2, [full, keep], base=5)
    (17, 1.0)
    """
    prefix, worst, total = 0, 0, 0.0
    for option in options:
        prefix += option.kept
        worst = max(worst, prefix + option.transient)
        total += option.time
    return base + max(prefix, worst), total


def _check_spans(blocks: Sequence[Block], spans: Sequence[StageOption]) -> None:
    for span in spans:
        if not 0 <= span.first < span.last < len(blocks):
            raise ValueError(
                f"span {span.name!r} covers blocks {span.first}..{span.last}; a span covers two "
                f"or more of the {len(blocks)} blocks"
            )


def choose(
    blocks: Sequence[Block],
    base: int,
    budget: int,
    resolution: int = 4096,
    spans: Sequence[StageOption] = (),
) -> Choice | None:
    """The fastest option per block whose predicted peak fits ``budget``; ``None`` if none fits.

    See NOTE [ One strategy per block ] for the model and why the program is exact for it.

    >>> keep, sel = Option("keep", 10, 0, 0.0), Option("sel", 6, 4, 0.1)
    >>> blocks = [Block(str(i), (keep, sel, Option("full", 2, 8, 1.0))) for i in range(3)]
    >>> [o.strategy for o in choose(blocks, base=0, budget=30).options]
    ['keep', 'keep', 'keep']
    >>> c = choose(blocks, base=0, budget=22)
    >>> [o.strategy for o in c.options], c.peak
    (['sel', 'sel', 'keep'], 22)
    >>> choose(blocks, base=0, budget=5) is None
    True
    >>> stage = StageOption("stage", 0, 1, Option("stage", 8, 6, 0.15))
    >>> c = choose(blocks, base=0, budget=22, spans=[stage])
    >>> [o.strategy for o in c.options], c.peak, [s.name for s in c.spans]
    (['stage', 'stage', 'keep'], 18, ['stage'])
    """
    _check_spans(blocks, spans)
    room = budget - base
    if room < 0 or not blocks:
        return None
    unit = max(1, math.ceil(room / resolution))
    size = room // unit + 1
    n = len(blocks)
    unset = np.iinfo(np.int64).min
    best = [np.full(size, math.inf) for _ in range(n + 1)]
    best[0][0] = 0.0
    # picks[j][p]: how prefix p after j blocks was reached: k >= 0 is option k of block j - 1,
    # -(s + 1) is spans[s]
    picks = [np.full(size, unset, dtype=np.int64) for _ in range(n + 1)]
    starting: dict[int, list[int]] = {}
    for s, span in enumerate(spans):
        starting.setdefault(span.first, []).append(s)

    def relax(i: int, j: int, option: Option, code: int) -> None:
        step = math.ceil(option.kept / unit)
        extra = math.ceil(option.transient / unit)
        last = size - 1 - step - extra  # from prefix p: p + step + extra <= size - 1
        if last < 0:
            return
        cand = best[i][: last + 1] + option.time
        target = best[j][step : step + last + 1]
        better = cand < target
        target[better] = cand[better]
        picks[j][step : step + last + 1][better] = code

    for i, block in enumerate(blocks):
        if not np.isfinite(best[i]).any():
            continue
        for k, option in enumerate(block.options):
            relax(i, i + 1, option, k)
        for s in starting.get(i, ()):
            relax(i, spans[s].last + 1, spans[s].option, -(s + 1))
    if not np.isfinite(best[n]).any():
        return None
    chosen, taken = _trace_back(blocks, spans, picks, int(np.argmin(best[n])), unit)
    peak, time = predict(blocks, chosen, base)
    return Choice(tuple(chosen), peak, time, taken)


def _trace_back(
    blocks: Sequence[Block],
    spans: Sequence[StageOption],
    picks: list[np.ndarray],
    p: int,
    unit: int,
) -> tuple[list[Option], tuple[StageOption, ...]]:
    """Walk :func:`choose`'s ``picks`` back from prefix ``p`` after the last block: the option
    of every block, and the spans taken, first block first."""
    j = len(blocks)
    chosen: list[Option] = [blocks[0].options[0]] * j
    taken: list[StageOption] = []
    while j > 0:
        code = int(picks[j][p])
        if code >= 0:
            option = blocks[j - 1].options[code]
            chosen[j - 1] = option
            j -= 1
        else:
            span = spans[-code - 1]
            option = span.option
            chosen[span.first : span.last + 1] = span.members()
            taken.append(span)
            j = span.first
        p -= math.ceil(option.kept / unit)
    return chosen, tuple(reversed(taken))


def choose_exhaustively(
    blocks: Sequence[Block], base: int, budget: int, spans: Sequence[StageOption] = ()
) -> Choice | None:
    """The same problem by trying every combination (for checking :func:`choose`; small chains).

    >>> keep, full = Option("keep", 10, 0, 0.0), Option("full", 2, 8, 1.0)
    >>> choose_exhaustively([Block("a", (keep, full))] * 2, base=0, budget=12).time
    1.0
    """
    _check_spans(blocks, spans)

    def ways(i: int) -> list[tuple[list[Option], list[StageOption]]]:
        if i == len(blocks):
            return [([], [])]
        out = []
        for option in blocks[i].options:
            out += [([option, *rest], taken) for rest, taken in ways(i + 1)]
        for span in spans:
            if span.first == i:
                out += [
                    (span.members() + rest, [span, *taken]) for rest, taken in ways(span.last + 1)
                ]
        return out

    best: Choice | None = None
    for combo, taken in ways(0):
        peak, time = predict(blocks, combo, base)
        if peak <= budget and (best is None or time < best.time):
            best = Choice(tuple(combo), peak, time, tuple(taken))
    return best
