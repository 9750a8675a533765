"""The operator keep policy: which operator outputs a region with a ``keep`` keeps.

A region that keeps operator outputs (a rule's ``keep: heavy`` or ``keep: {ops: [...]}``, a
*selective* region) is checkpointed with torch's selective-checkpoint contexts: while it runs
forward, every operator is asked whether its output is kept (the recomputation then returns the
kept tensor) or recomputed. :class:`SaveOps` is that policy: it keeps the outputs of named
operators (:data:`HEAVY_OPS` by default: convolutions, matrix products, fused attention),
optionally only those that cost at least ``below`` FLOPs per output element
(:func:`flops_per_output`), never those of a random operator, and it guards what it keeps
against in-place writes. The wrapper decides *whether* a region is selective at the training
level (NOTE [ Selective regions step aside ] in ``wrapper.py``); this module decides what such a
region keeps.

>>> keep = SaveOps(HEAVY_OPS, recompute_below=200)
>>> keep.keeps(torch.ops.aten.mm.default, (torch.empty(4, 256), torch.empty(256, 8)))
True
>>> keep.keeps(torch.ops.aten.relu.default, (torch.empty(4),))
False
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from .._compat import TorchDispatchMode, tree_leaves
from ..config.schema import KeepOps
from ..errors import ConfigError
from . import _core

__all__ = ["HEAVY_OPS", "SaveOps", "bind_region", "flops_per_output"]


HEAVY_OPS: tuple[str, ...] = (
    "aten.convolution",
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)
"""The operators whose outputs ``keep: heavy`` keeps: convolutions, matrix
products and fused attention, as autograd dispatches them (what a region's dispatch mode sees)."""


def flops_per_output(op: Any, args: Sequence[Any]) -> int | None:
    """FLOPs one output element of a convolution or matrix product costs (2 x its reduction
    length), from the argument shapes; ``None`` for other operators.

    >>> flops_per_output(torch.ops.aten.mm.default, (torch.empty(4, 96), torch.empty(96, 8)))
    192
    """
    packet = getattr(op, "overloadpacket", op)
    aten = torch.ops.aten
    if packet is aten.convolution:
        weight = args[1]
        transposed = bool(args[6]) if len(args) > 6 else False
        groups = int(args[8]) if len(args) > 8 else 1
        per = weight.shape[0] // groups if transposed else weight.shape[1]
        return 2 * int(per) * math.prod(weight.shape[2:])
    if packet in (aten.mm, aten.bmm):
        return 2 * int(args[0].shape[-1])
    if packet in (aten.addmm, aten.baddbmm):
        return 2 * int(args[1].shape[-1])
    return None


class SaveOps:
    """A picklable ``context_fn`` for selective checkpointing: keep the outputs of the named ops.

    Names (``"aten.mm"``) resolve to ``torch.ops`` overload packets (or, with a third component,
    single overloads) when first needed. With ``recompute_below``, a convolution or matrix
    product that costs fewer FLOPs per output element is recomputed instead (a 1x1 expansion,
    a depthwise convolution). When the first region is recomputed, a name that no region ran in
    its forward is reported with a warning listing the operators they did run (for ``default``,
    the built-in set of heavy operators, only when none of them ran).
    """

    def __init__(
        self, names: Sequence[str], recompute_below: int | None = None, default: bool = False
    ) -> None:
        self.names = tuple(names)
        self.recompute_below = recompute_below
        self.default = default
        self._ops: frozenset[Any] | None = None
        self._met: set[Any] = set()  # operator packets the forwards of its regions ran
        self._checked = False

    @classmethod
    def for_keep(cls, keep: KeepOps) -> SaveOps:
        """The policy of a rule's ``keep`` (``heavy`` is :data:`HEAVY_OPS`).

        >>> SaveOps.for_keep(KeepOps(ops=["aten.mm"], below=40))
        save_ops['aten.mm'], recompute_below=40
        """
        heavy = keep.ops == "heavy"
        return cls(HEAVY_OPS if heavy else keep.ops, keep.below, default=heavy)

    def resolve(self) -> frozenset[Any]:
        """The ``torch.ops`` objects for the names; ConfigError naming the unknown ones."""
        if self._ops is None:
            ops, unknown = [], []
            for name in self.names:
                op = _lookup_op(name)
                if op is None:
                    unknown.append(name)
                else:
                    ops.append(op)
            if unknown:
                raise ConfigError(
                    f"keep: unknown operators {unknown}; write them as in "
                    "torch.ops, e.g. 'aten.mm', 'aten.addmm', 'aten.convolution', "
                    "'aten._scaled_dot_product_efficient_attention' (check with "
                    "hasattr(torch.ops.aten, name))."
                )
            self._ops = frozenset(ops)
        return self._ops

    def keeps(self, op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
        """Whether the output of ``op`` called on ``args`` is kept (else it is recomputed).

        >>> x = torch.empty(4, 96), torch.empty(96, 8)
        >>> SaveOps(["aten.mm"]).keeps(torch.ops.aten.mm.default, x)
        True
        >>> SaveOps(["aten.mm"], recompute_below=200).keeps(torch.ops.aten.mm.default, x)
        False
        """
        ops = self.resolve()
        if op not in ops and getattr(op, "overloadpacket", op) not in ops:
            return False
        # never a random one: NOTE [ Random operators are recomputed ]
        if _draws_random_numbers(op, args, kwargs or {}):
            return False
        if self.recompute_below is not None:
            cost = flops_per_output(op, args)
            if cost is not None and cost < self.recompute_below:
                return False
        return True

    def __call__(self, region: str = "?") -> tuple[Any, Any]:
        met = self._met
        must_save = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        recompute = torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            if not ctx.is_recompute:
                met.add(getattr(op, "overloadpacket", op))
            return must_save if self.keeps(op, args, kwargs) else recompute

        forward_ctx, recompute_ctx = torch.utils.checkpoint.create_selective_checkpoint_contexts(
            policy
        )
        if _core.compiling():
            # NOTE [ Selective regions under torch.compile ]
            # Under torch.compile the region is torch's checkpoint higher-order op, and
            # AOTAutograd calls this context_fn while it traces the op on functional and proxy
            # tensors: it needs torch's two dispatch modes themselves, which tag each traced
            # operator with the policy's decision for the partitioner. Nothing is cached by
            # reference there (functionalisation turns writes into new tensors), so the write
            # guard has nothing to protect, and reading storage pointers of traced tensors
            # would fail. The operators met are still recorded by the policy; the report of
            # unmet names happens at the first eager recomputation only.
            return forward_ctx, recompute_ctx
        # What the selective cache keeps goes through the saved-tensor hooks around the region
        # (count_saved_bytes, save_on_cpu), as autograd's saved tensors do; the core's hooks
        # follow torch's protocol for finding them (NOTE [ Nested checkpoints ] in _frame).
        # Older torch keeps them by reference only: NOTE [ Kept outputs on older torch ].
        if _compat.SELECTIVE_KEEPS_HOOKS:
            forward_ctx.respect_saved_tensors_hooks = True
        return _GuardWrites(forward_ctx), _ReportUnmet(recompute_ctx, self, region)

    def report_unmet(self, region: str) -> None:
        """Warn, once, about names no region ran during the forwards so far (called when the
        first region is recomputed, so a whole forward has run)."""
        if self._checked:
            return
        self._checked = True
        unmet = []
        for name in self.names:
            op = _lookup_op(name)
            if getattr(op, "overloadpacket", op) not in self._met:
                unmet.append(name)
        if not unmet or (self.default and len(unmet) < len(self.names)):
            return
        ran = sorted({_op_name(p) for p in self._met})
        shown = ", ".join(ran[:12]) + (f" and {len(ran) - 12} more" if len(ran) > 12 else "")
        what = "ran none of the operators" if len(unmet) == len(self.names) else "never ran"
        warnings.warn(
            f"selective checkpointing: the checkpointed regions {what} "
            f"{', '.join(unmet)} in their forward, so nothing was kept for them (first region "
            f"recomputed: {region!r}). Operators they ran: {shown or 'none'}. A region sees "
            "operators as autograd dispatches them (aten.convolution, not "
            "aten.mkldnn_convolution): name those in the rule's keep: {ops: [...]}.",
            UserWarning,
            stacklevel=2,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "recompute_below": self.recompute_below,
            "default": self.default,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["names"], state["recompute_below"], state.get("default", False))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SaveOps)
            and other.names == self.names
            and other.recompute_below == self.recompute_below
        )

    def __hash__(self) -> int:
        return hash((self.names, self.recompute_below))

    def __repr__(self) -> str:
        below = "" if self.recompute_below is None else f", recompute_below={self.recompute_below}"
        return f"save_ops{list(self.names)}{below}"


class _ReportUnmet:
    """The recomputation context of a selective region: reports unmet operators on entry."""

    def __init__(self, inner: Any, owner: SaveOps, region: str) -> None:
        self.inner, self.owner, self.region = inner, owner, region

    def __enter__(self) -> Any:
        self.owner.report_unmet(self.region)
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


class _GuardWrites:
    """The forward context of a selective region: torch's caching mode, with
    :class:`_KeepBeforeWrite` inside it (NOTE [ Kept outputs written in place ])."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        result = self.inner.__enter__()
        self.guard = _KeepBeforeWrite(self.inner)
        self.guard.__enter__()
        return result

    def __exit__(self, *exc: Any) -> Any:
        self.guard.__exit__(*exc)
        return self.inner.__exit__(*exc)


# NOTE [ Kept outputs written in place ]
#
# A selective region keeps an operator's output by reference. Code that then writes into it
# (``Linear`` followed by ``ReLU(inplace=True)`` in SwinV2's position-bias MLP, a squeeze-excite
# convolution followed by an in-place SiLU) would change what was kept, and torch refuses the
# changed tensor in backward. So while a selective region runs forward, a dispatch mode inside
# torch's caching mode sees every operator first; before one writes into a tensor whose storage
# a cache entry holds, that entry is replaced by a copy taken just then. The copy holds the
# values the operator produced, which is what the recomputation must get back: gradients stay
# exact, at the cost of one copy of each such (rare) output.


# NOTE [ Kept outputs on older torch ]
#
# Torch 2.14's selective mode packs each output it keeps through the first saved-tensor hooks
# below the region's own, as autograd packs what an operator saves: that is how
# count_saved_bytes, and with it every menu and budget priced from it, sees what a selective
# region keeps. Older releases keep those outputs by reference and never call a hook, which
# priced a selective region as lean as a full one. There, the write guard below, which sees each
# operator's outputs as soon as the cache holds them, hands every newly kept tensor to the pack
# hook of those same hooks (found as on 2.14, through the checkpoint hooks' ``_user_hooks``)
# when it is one of vision_ckpt's counting hooks (``counts_kept_outputs``), and drops what it
# returns: the cache still holds the tensor itself, so the count is taken at the moment 2.14
# would take it, and gradients are unchanged. Other hooks are never called with a tensor whose
# packed form would be thrown away (an offloading hook would copy it for nothing), so hooks
# that would move a kept tensor (save_on_cpu) do not see it before 2.14.


class _KeepBeforeWrite(TorchDispatchMode):
    def __init__(self, caching_mode: Any) -> None:
        super().__init__()
        self.caching_mode = caching_mode
        # kept wrappers by the identity of their storage, built up as the cache grows: a scan
        # of the whole cache at every in-place operator made a region's forward quadratic in
        # its operators (a BatchNorm's running-statistics update is one such operator)
        self._by_storage: dict[int, list[Any]] = {}
        self._indexed: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for argument, value in zip(func._schema.arguments, args, strict=False):
                alias = argument.alias_info
                if alias is not None and alias.is_write and isinstance(value, torch.Tensor):
                    self._copy_kept(value)
        out = func(*args, **kwargs)
        if not _compat.SELECTIVE_KEEPS_HOOKS:  # NOTE [ Kept outputs on older torch ]
            added = self._index_new_entries()
            hooks = _compat.user_saved_tensors_hooks() if added else None
            if hooks is not None and getattr(hooks[0], "counts_kept_outputs", False):
                for kept in added:
                    hooks[0](kept)
        return out

    def __exit__(self, *exc: Any) -> Any:
        # the index must not hold kept outputs past the forward: the recomputation frees each
        # one as it hands it back
        self._by_storage.clear()
        self._indexed.clear()
        return super().__exit__(*exc)

    def _index_new_entries(self) -> list[torch.Tensor]:
        # Each operator's entries are filled in call order (a list, or a dict by call index
        # 0, 1, ...), so those past the count already indexed are the new ones. Returns the
        # tensors they hold.
        added = []
        for key, entries in self.caching_mode.storage.items():
            start, end = self._indexed.get(key, 0), len(entries)
            if end == start:
                continue
            if isinstance(entries, dict):
                new = [entries.get(index) for index in range(start, end)]
            else:
                new = list(entries[start:end])
            self._indexed[key] = end
            for wrapper in tree_leaves(new):
                value = getattr(wrapper, "val", None)
                if isinstance(value, torch.Tensor):
                    # The storage object's identity, not its data pointer: FakeTensors (a
                    # meta-device forward, FakeTensorMode) have no data, and empty storages
                    # share pointer 0.
                    storage = value.untyped_storage()._cdata
                    self._by_storage.setdefault(storage, []).append(wrapper)
                    added.append(value)
        return added

    def _copy_kept(self, target: torch.Tensor) -> None:
        self._index_new_entries()
        for wrapper in self._by_storage.pop(target.untyped_storage()._cdata, ()):
            wrapper.val = wrapper.val.clone()
            wrapper.version = wrapper.val._version


# NOTE [ Random operators are recomputed ]
#
# An operator tagged ``nondeterministic_seeded`` draws from a generator (native_dropout,
# bernoulli, the fused attention kernels with dropout_p > 0 on CUDA). If a selective region kept
# its output, the recomputation would return the cached tensor without running the kernel: the
# generator would not advance, and every random operator after it in the region (dropout,
# drop-path) would draw another mask than the forward did -- silently wrong gradients. So such
# an operator is always recomputed, whatever save_ops names, and the recomputation, which starts
# from the forward's RNG state (NOTE [ RNG state ] in _call_state), draws exactly what it drew.
# SDPA kernels are only seeded when called with dropout_p > 0: one without dropout is kept.


def _draws_random_numbers(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``op`` draws from a generator (NOTE [ Random operators are
    recomputed ]): it is tagged ``nondeterministic_seeded``, and if it has a ``dropout_p``
    argument (the fused attention kernels), that is not zero.

    >>> aten = torch.ops.aten
    >>> _draws_random_numbers(aten.native_dropout.default, (torch.empty(2), 0.1, True), {})
    True
    >>> _draws_random_numbers(aten.mm.default, (torch.empty(2, 2), torch.empty(2, 2)), {})
    False
    """
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    schema = getattr(op, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "dropout_p":
            value = args[index] if index < len(args) else kwargs.get("dropout_p", 0.0)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def _op_name(packet: Any) -> str:
    qualified = getattr(packet, "_qualified_op_name", None)
    return qualified.replace("::", ".") if isinstance(qualified, str) else str(packet)


def bind_region(context_fn: Any, label: str) -> Any:
    """A :class:`SaveOps` told which region it serves (for its warning); others unchanged.

    Under torch.compile the result is a partial of a module-level function over constants
    (the policy's names, its threshold and the label): that is the only ``context_fn`` every
    supported release's dynamo can hand to the checkpoint operator (2.6 refuses a partial
    over an object)."""
    if isinstance(context_fn, SaveOps):
        if _core.compiling():
            return functools.partial(
                _traced_context,
                context_fn.names,
                context_fn.recompute_below,
                context_fn.default,
                label,
            )
        return functools.partial(context_fn, label)
    return context_fn


def _traced_context(
    names: tuple[str, ...], recompute_below: int | None, default: bool, label: str
) -> tuple[Any, Any]:
    return SaveOps(names, recompute_below, default)(label)


def _lookup_op(name: str) -> Any | None:
    parts = name.split(".")
    if len(parts) not in (2, 3):
        return None
    namespace, op_name = parts[0], parts[1]
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        return None
    if len(parts) == 2:
        return packet
    return getattr(packet, parts[2], None)
