"""Choosing one strategy per block so a step fits a memory budget in the least time.

Pure arithmetic over measured figures (no torch, no model): :func:`choose` solves the problem
stated in NOTE [ One strategy per block ]; ``vision_ckpt._planner`` measures the figures and
checks the answer on the model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Option", "Block", "Choice", "choose", "predict", "choose_exhaustively"]


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
class Choice:
    """The answer of :func:`choose`: an option per block, with the model's prediction."""

    options: tuple[Option, ...]
    """One per block, in the blocks' order."""
    peak: int
    """Predicted step peak (``base`` included)."""
    time: float
    """Predicted extra seconds per step."""


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


def choose(
    blocks: Sequence[Block], base: int, budget: int, resolution: int = 4096
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
    """
    room = budget - base
    if room < 0 or not blocks:
        return None
    unit = max(1, math.ceil(room / resolution))
    size = room // unit + 1
    inf = math.inf
    best = np.full(size, inf)
    best[0] = 0.0
    picks: list[np.ndarray] = []  # per block: the option index that reached each prefix
    for block in blocks:
        nxt = np.full(size, inf)
        pick = np.full(size, -1, dtype=np.int64)
        for k, option in enumerate(block.options):
            step = math.ceil(option.kept / unit)
            extra = math.ceil(option.transient / unit)
            # from prefix p: new prefix p + step, needs p + step + extra <= size - 1
            last = size - 1 - step - extra
            if last < 0:
                continue
            cand = best[: last + 1] + option.time
            target = nxt[step : step + last + 1]
            better = cand < target
            target[better] = cand[better]
            pick[step : step + last + 1][better] = k
        picks.append(pick)
        best = nxt
    if not np.isfinite(best).any():
        return None
    p = int(np.argmin(best))
    chosen: list[Option] = []
    for block, pick in zip(reversed(blocks), reversed(picks), strict=True):
        k = int(pick[p])
        option = block.options[k]
        chosen.append(option)
        p -= math.ceil(option.kept / unit)
    chosen.reverse()
    peak, time = predict(blocks, chosen, base)
    return Choice(tuple(chosen), peak, time)


def choose_exhaustively(blocks: Sequence[Block], base: int, budget: int) -> Choice | None:
    """The same problem by trying every combination (for checking :func:`choose`; small chains).

    >>> keep, full = Option("keep", 10, 0, 0.0), Option("full", 2, 8, 1.0)
    >>> choose_exhaustively([Block("a", (keep, full))] * 2, base=0, budget=12).time
    1.0
    """
    best: Choice | None = None
    for combo in itertools.product(*(b.options for b in blocks)):
        peak, time = predict(blocks, combo, base)
        if peak <= budget and (best is None or time < best.time):
            best = Choice(tuple(combo), peak, time)
    return best
