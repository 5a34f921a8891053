"""The clipping-bias term in parameter space (SORL-SPEC, ``clip_norm_reference = gradient``).

With ``l`` the micro-batch loss as verl aggregates it and ``l_u`` the same aggregation of the
unclipped surrogate ``-A r``, ``delta[t] = dl_u/dd[t] - dl/dd[t]`` (no gradient; 0 on unclipped
tokens; :attr:`~sorl_verl.algorithms.surrogate.Surrogate.removed`) and::

    C(theta) = sum_t delta[t] * grad_theta log pi(y_t)      (one vector-Jacobian product)
    g_u      = sum_t dl_u/dd[t] * grad_theta log pi(y_t)    (= grad of l_u; only for the relative form)

The product runs through the graph that produced ``log_prob`` (``torch.autograd.grad`` with
``retain_graph``, before verl's own backward) with respect to its leaves: the tensors autograd
would accumulate ``.grad`` into, i.e. the actor's parameters as the forward used them (FSDP2's
unsharded parameters). ``.grad`` is not touched, and no set of gradients is materialised: a hook on
each leaf reduces its gradient to a float64 squared norm as autograd produces it and hands back a
stride-0 zero. Norms (float64)::

    scope = micro_batch: q = ||C_r||                      (this rank's micro-batch)
    scope = global:      q = ||mean over the data-parallel group of C_r||   (the ranks' C averaged as
                         FSDP averages their gradients; equals one rank holding all the data)

Memory. The product keeps nothing alive that verl's backward would not hold anyway (``retain_graph``
keeps the forward's saved activations ``A``, which verl's backward reads next), but it runs while all
of ``A`` is alive, where verl's backward frees ``A`` as it goes. With ``b`` bytes per gradient element
(4 in float32) and ``P_max`` the largest leaf's size, its extra peak over the step without it is::

    extra <= W + 3 b P_max  (+ b P_max for scope global)

``W`` the largest set of activation gradients alive at once in a backward (at the head: the gradients
of the logits and log-softmax, a few ``B T V`` floats; in a block a few ``B T H``), independent of ``P``;
``3 b P_max``: one leaf's gradient and its float64 copy for the norm; the all-reduce buffer of one
leaf's gradient. Not a multiple of ``P``: no set of parameter gradients, and no float32 copy of one.
On the CPU the process's resident set would grow by more: the pass frees each gradient between live
activations, and glibc's heap does not reuse such holes for torch's aligned allocations, so without
:func:`release_freed_heap` (called as each leaf's gradient arrives and after the pass) the resident
set grew by the sum of everything the pass freed: 6.7 ``4P``-byte buffers for a 95.2M-parameter Qwen2
at 4 x 2048 tokens (``scripts/bench/clip_bias_grad_memory.py``; docs/algorithms.md has the numbers).

FSDP2's backward hooks fire during the product as in any backward: parameters are gathered again
where they were resharded, and on the micro-batch that synchronizes gradients the accumulated
gradient of the earlier micro-batches is reduce-scattered there rather than in the real backward
(the same sum, taken in two parts). Those are collectives, so every rank of the data-parallel group
takes the product on the same micro-batches: the skip when nothing is clipped anywhere is decided
with one all-reduce. Gradient checkpointing must be non-reentrant, and flash-attn's cross-entropy
with ``inplace_backward`` (it overwrites what a second backward reads; verl uses it on GPUs unless it
computes the entropy) cannot be differentiated twice: the gradient reference then fails with the fix,
the diagnostic is left out with one warning. The same holds, by strategy, for torch FSDP1 (seen in the
graph: its leaves are ``FlatParameter``s) and Megatron (seen in the actor config): see
:mod:`sorl_verl.algorithms.strategies`.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from sorl_verl.algorithms.parallel import data_parallel_group
from sorl_verl.algorithms.strategies import (
    FSDP1,
    config_unsafe_strategy,
    diagnostic_off_reason,
    gradient_reference_refusal,
)

__all__ = [
    "DIAGNOSTIC",
    "GradientNorms",
    "SecondBackwardUnsafe",
    "clip_bias_gradient_norms",
    "graph_leaves",
    "is_fsdp1_graph",
]


class SecondBackwardUnsafe(RuntimeError):
    """The graph of ``log_prob`` cannot be differentiated a second time with respect to the actor's
    parameters (the message names the fix, or that none were found)."""


def graph_leaves(output: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (parameters) whose ``.grad`` a backward from ``output`` would accumulate.

    Raises with the fix where a second backward through the graph would be wrong or blind.
    """
    if output.grad_fn is None:
        return [output] if output.requires_grad else []
    leaves: dict[int, torch.Tensor] = {}
    # id -> node, holding every node visited: torch may hand out a fresh Python wrapper for a node on
    # each access and free it when dropped, and a freed wrapper's id is reused by the next one, so a
    # set of bare ids skips unvisited nodes (torch 2.11 lost every parameter of a Qwen2 that way)
    seen: dict[int, Any] = {}
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None and type(node).__name__ == "AccumulateGrad":
            leaves.setdefault(id(variable), variable)
            continue
        name = type(node).__name__
        if getattr(node, "inplace_backward", False):
            raise SecondBackwardUnsafe(
                f"sorl_verl: C(theta) needs a second backward through log_prob, but {name} computes its "
                "gradient in place of its saved input (flash-attn's cross-entropy with inplace_backward): set "
                "VERL_DISABLE_FLASH_ATTN_CE=1 in the workers' environment or "
                "actor_rollout_ref.actor.calculate_entropy=True"
            )
        if name == "CheckpointFunctionBackward":
            raise SecondBackwardUnsafe(
                "sorl_verl: C(theta) cannot see the parameters inside reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True): use use_reentrant=False"
            )
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def _all_ranks_any(flag: bool, device: torch.device) -> bool:
    """``flag`` or-ed over the data-parallel group (one all-reduce when it has several ranks)."""
    group = _reduction_group("global")
    if group is None:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def _reduction_group(scope: str) -> Any:
    """The data-parallel group for ``scope == "global"`` when it has several ranks, else None."""
    if scope != "global" or not (dist.is_available() and dist.is_initialized()):
        return None
    group = data_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _local_tensor(g: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient as a full tensor (the parameters of verl's FSDP2 graph are plain)."""
    full = getattr(g, "full_tensor", None)
    return full() if callable(full) else g


def is_fsdp1_graph(leaves: list[torch.Tensor]) -> bool:
    """Whether the graph's leaves are FSDP1 ``FlatParameter``s (``FullyShardedDataParallel``, either
    ``use_orig_params``): torch marks them ``_is_flat_param``, which is what its own isinstance check reads."""
    return any(getattr(leaf, "_is_flat_param", False) for leaf in leaves)


def _malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim`` (glibc), or None where it has none (musl, macOS, Windows)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release_freed_heap(device: torch.device) -> None:
    """Give the pages of freed CPU tensors back to the system (glibc ``malloc_trim(0)``, microseconds).

    The product runs while the forward's activations are alive, so the tensors it frees (each leaf's
    gradient, the activation gradients) are holes between live blocks of glibc's heap (tensors below
    its dynamic mmap threshold, up to 32 MiB, live there); torch allocates CPU tensors with
    ``posix_memalign``, which glibc 2.36 serves from a hole only if the hole exceeds the request by the
    alignment, so a same-sized hole is not reused and the heap grows by the freed tensors (in a fresh
    process, 40 freed 6.75 MiB tensors each followed by a small live one grew RSS by 264 MiB, by 1 MiB
    with ``MALLOC_MMAP_THRESHOLD_=65536``; how much depends on the heap's layout). Trimming returns those
    pages: the tensors are the same, the resident set stops growing. Device tensors (CUDA's caching
    allocator) are not glibc's: nothing to do off the CPU.
    """
    if _MALLOC_TRIM is not None and device.type == "cpu":
        _MALLOC_TRIM(0)


class _SquaredNorms:
    """Leaf hooks that reduce each gradient to its float64 squared norm as autograd produces it.

    Each hook hands autograd back a stride-0 zero in place of the gradient, so the product holds one
    leaf's gradient at a time, never the set. With a ``group`` (scope global) each leaf's gradient is
    first summed over the group by one all-reduce (float32 or wider), its leaf index riding along in
    the same buffer: every rank must reduce the same leaves in the same order (the same graph gives
    the same backward order), which :meth:`total` checks.
    """

    def __init__(self, leaves: list[torch.Tensor], group: Any) -> None:
        self.group = group
        self.squares: list[torch.Tensor] = []
        self.order: list[int] = []  # this rank's leaf indices, in the order it reduced them
        self.index_sums: list[torch.Tensor] = []  # the group's sums of those indices
        self.handles = [leaf.register_hook(self._hook(i)) for i, leaf in enumerate(leaves)]

    def _hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(grad: torch.Tensor) -> torch.Tensor:
            release_freed_heap(grad.device)  # the earlier leaves' gradients, freed since (the module docstring)
            g = _local_tensor(grad)
            if self.group is not None:
                buffer = torch.empty(g.numel() + 1, dtype=torch.promote_types(g.dtype, torch.float32), device=g.device)
                buffer[0] = index
                buffer[1:] = g.reshape(-1)
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
                self.order.append(index)
                self.index_sums.append(buffer[0].detach().clone())
                g = buffer[1:]
            self.squares.append(torch.linalg.vector_norm(g, dtype=torch.float64).square())
            if type(grad) is torch.Tensor:
                return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
            return grad  # a tensor subclass (DTensor) keeps its own gradient

        return reduce

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def total(self, device: torch.device) -> torch.Tensor:
        """``sqrt(sum of the squares)``, divided by the group's size when summed over it (the mean's norm)."""
        if not self.squares:
            return torch.zeros((), dtype=torch.float64, device=device)
        norm = torch.stack(self.squares).sum().sqrt()
        if self.group is None:
            return norm
        size = dist.get_world_size(self.group)
        got = torch.stack(self.index_sums).double().cpu()
        if not torch.equal(got, torch.tensor(self.order, dtype=torch.float64) * size):
            raise RuntimeError(
                "sorl_verl: the ranks of the data-parallel group reduced C(theta)'s parameters in different "
                f"orders (this rank {self.order}, index sums {got.tolist()}); their autograd graphs differ"
            )
        return norm / size


def _vjp_norm(log_prob: torch.Tensor, cotangent: torch.Tensor, leaves: list[torch.Tensor], scope: str) -> torch.Tensor:
    """``||sum_t cotangent[t] grad log_prob[t]||`` by one backward that keeps the graph (``.grad`` untouched),
    each leaf's gradient reduced to its squared norm as it is produced (:class:`_SquaredNorms`)."""
    norms = _SquaredNorms(leaves, _reduction_group(scope))
    try:
        # verl calls the loss inside autocast; its own backward runs outside it, and so does this one
        with torch.autocast(device_type=log_prob.device.type, enabled=False):
            torch.autograd.grad(
                log_prob, leaves, grad_outputs=cotangent.to(log_prob.dtype), retain_graph=True, allow_unused=True
            )
    finally:
        norms.remove()
        release_freed_heap(log_prob.device)
    return norms.total(log_prob.device)


@dataclass(frozen=True)
class GradientNorms:
    """``norm = ||C(theta)||``; ``rel = ||C(theta)|| / ||grad l_u||`` (None unless asked; 0 when ``grad l_u = 0``);
    ``computed``: False when nothing was clipped on any rank (then both are 0 and no product ran)."""

    norm: torch.Tensor
    rel: torch.Tensor | None
    computed: bool


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _unsafe_strategy(leaves: list[torch.Tensor], strategy: Any) -> str | None:
    """The strategy under which this graph's C(theta) cannot be taken: FSDP1 is seen in the graph (its
    flat parameters), the others of :data:`~sorl_verl.algorithms.strategies.UNSAFE_STRATEGIES` in the
    actor config (:func:`~sorl_verl.algorithms.strategies.config_unsafe_strategy`); None where it can."""
    return FSDP1 if is_fsdp1_graph(leaves) else config_unsafe_strategy(strategy)


def clip_bias_gradient_norms(
    log_prob: torch.Tensor,
    removed: torch.Tensor,
    unclipped: Callable[[], torch.Tensor] | None,
    scope: str,
    strict: bool = True,
    strategy: Any = None,
    reference: str = "gradient",
) -> GradientNorms | None:
    """``||C(theta)||`` (and the relative form when ``unclipped`` gives ``dl_u/dd``) for cotangent ``removed = delta``.

    ``log_prob`` must carry the actor's graph; ``strategy`` is the actor's (``config.strategy``).
    Every rank of the data-parallel group must call this on the same micro-batches (module
    docstring). Costs one backward (two for the relative form), none when ``delta = 0`` on every
    rank. A graph that cannot be differentiated twice, or a strategy that cannot take the product
    (:mod:`~sorl_verl.algorithms.strategies`: FSDP1, Megatron), raises :class:`SecondBackwardUnsafe`
    naming the fix if ``strict`` (``clip_norm_reference``), else gives None with one warning per
    process (the diagnostic).
    """
    zero = torch.zeros((), dtype=torch.float64, device=log_prob.device)
    try:
        leaves = graph_leaves(log_prob)
        if not leaves:  # log_prob requires grad, so its graph has leaves: none found is a walk gone wrong
            raise SecondBackwardUnsafe(
                f"sorl_verl: found no parameter in the autograd graph of log_prob (torch {torch.__version__}), "
                "so C(theta) cannot be taken; please report it with your torch version"
            )
        unsafe = _unsafe_strategy(leaves, strategy)
        if unsafe is not None:
            if strict:
                raise SecondBackwardUnsafe(gradient_reference_refusal(unsafe, reference))
            _warn_once(diagnostic_off_reason(unsafe))
            return None
    except SecondBackwardUnsafe as exc:
        if strict:
            raise
        _warn_once(f"{exc}; sorl/clip_bias_grad_norm is not logged")
        return None
    local_any = bool(torch.count_nonzero(removed) > 0)
    if not _all_ranks_any(local_any, log_prob.device):
        return GradientNorms(zero, zero if unclipped is not None else None, False)
    norm = _vjp_norm(log_prob, removed, leaves, scope)
    rel = None
    if unclipped is not None:
        norm_u = _vjp_norm(log_prob, unclipped(), leaves, scope)
        rel = torch.where(norm_u > 0, norm / torch.where(norm_u > 0, norm_u, 1.0), zero)
    return GradientNorms(norm, rel, True)


class OncePerStep:
    """True for the first claim after each optimizer step of this process (and the first ever).

    Any torch optimizer's ``step`` re-arms it (a global step post-hook), so a diagnostic taken on
    the first micro-batch of each mini-batch needs no help from verl. A step verl skips for a
    non-finite gradient does not re-arm it.
    """

    def __init__(self) -> None:
        self.due = True
        self._handle: Any = None

    def install(self) -> None:
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.due = True

    def claim(self) -> bool:
        due, self.due = self.due, False
        return due


#: the schedule of the always-on diagnostic ``sorl/clip_bias_grad_norm``
DIAGNOSTIC = OncePerStep()
DIAGNOSTIC.install()
