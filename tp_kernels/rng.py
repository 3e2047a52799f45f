"""Random numbers under tensor parallelism: dropout that is the same where the ranks hold the
same activations, independent where they hold different ones, and replayed exactly by
activation checkpointing.

A tensor-parallel model has two kinds of regions. Between a row-parallel layer and the next
column-parallel one, every rank of the group holds the same activations, so its dropout must
draw the same mask on every rank, or the replicas drift apart and the next layer computes with
inputs no rank agrees on. Between a column-parallel layer and its row-parallel partner (the
attention heads, the MLP's hidden units), or on a sequence-parallel block, each rank holds its
own part, so each must draw its own mask, or the parts of the model on different ranks are
dropped alike. Megatron-LM keeps two random streams for this, and so does tp_kernels:

* the default stream (``torch``'s default generators), seeded alike on every rank of the group:
  the replicated regions, and the layers' initialization (each layer draws its full matrix, as
  the dense layer does, and keeps its block);
* the *model-parallel* stream, :data:`MODEL_PARALLEL_RNG`, seeded ``seed + 2718 + rank``: the
  parallel regions, inside ``with get_rng_tracker().fork():``.

:func:`model_parallel_manual_seed` seeds both, after checking that the group's ranks got the same
seed. A fork swaps the tracker's state into the default generators of the CPU and of the current
CUDA device (when CUDA is initialized), so any op drawing from them (``F.dropout``,
``torch.rand``) draws from the tracker's stream, and swaps it back out at the end.

:func:`checkpoint` is ``torch.utils.checkpoint.checkpoint`` (non-reentrant) that also restores
the tracker's streams when it recomputes the forward. torch's own checkpoint restores only the
default stream: a fork inside a region it recomputes would continue the tracker's stream instead
of drawing the forward's masks again, and the gradients would be those of other masks, silently.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint

from . import _collectives as coll
from ._agreement import agree

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "checkpoint", "get_rng_tracker", "model_parallel_manual_seed",
           "rank_fork"]

#: The name of the model-parallel stream, the default of :meth:`RNGStatesTracker.fork`.
MODEL_PARALLEL_RNG = "model-parallel-rng"
#: What :func:`model_parallel_manual_seed` adds to the seed, before the rank (Megatron-LM's offset).
SEED_OFFSET = 2718
#: Seeds are integers in ``[0, SEED_LIMIT)``.
SEED_LIMIT = 2**63

#: A tracker's states: stream name -> {"cpu" or "cuda:<index>": the generator's state}.
States = Dict[str, Dict[str, torch.Tensor]]


def _check_seed(name: str, seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name}: expected an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name}: expected an int in [0, 2**63), got {seed}")
    return seed


def _default_generators() -> List[Tuple[str, torch.Generator]]:
    """The generators a fork swaps: the CPU's, and the current CUDA device's once CUDA is
    initialized (a fork never initializes CUDA)."""
    generators = [("cpu", torch.default_generator)]
    if torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        generators.append((f"cuda:{index}", torch.cuda.default_generators[index]))
    return generators


def capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream (CUDA left uninitialized
    where it is): where a fork is refused (:func:`_refuse_capture`), and passed over by
    :func:`tp_kernels.parallelize`'s dropout hooks."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _refuse_capture(what: str) -> None:
    """A ``RuntimeError`` (naming ``what``) inside a CUDA graph capture, which does not record a
    generator's state being swapped."""
    if capturing():
        raise RuntimeError(f"{what}: a CUDA graph is being captured, and a fork swaps the CUDA generator's "
                           "state, which a capture does not record; fork outside the captured region")


@contextlib.contextmanager
def _swapped():
    """The default generators (:func:`_default_generators`), for the block to give other states,
    put back as they were afterwards."""
    generators = _default_generators()
    saved = [generator.get_state() for _, generator in generators]
    try:
        yield generators
    finally:
        for (_, generator), state in zip(generators, saved):
            generator.set_state(state)


def _copy(states: States) -> States:
    return {name: {device: state.clone() for device, state in per_device.items()} for name, per_device in states.items()}


class RNGStatesTracker:
    """Named random streams, each swapped into the default generators by :meth:`fork`.

    A stream's state on a device starts from its seed the first time a fork uses that device;
    after a fork, the stream goes on where that fork left it. The default stream is untouched by
    a fork: what it draws after the fork is what it would have drawn without it.
    """

    def __init__(self) -> None:
        self._seeds: Dict[str, int] = {}
        self._states: States = {}
        self._open: set = set()

    def reset(self) -> None:
        """Forget every stream."""
        self._seeds, self._states, self._open = {}, {}, set()

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed`` (an int in ``[0, 2**63)``, no other stream's)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        _check_seed("seed", seed)
        if name in self._seeds:
            raise ValueError(f"name: the stream {name!r} exists already (seed {self._seeds[name]}); reset() first")
        if seed in self._seeds.values():
            other = next(n for n, s in self._seeds.items() if s == seed)
            raise ValueError(f"seed: {seed} already seeds the stream {other!r}; two streams of one seed draw alike")
        self._seeds[name] = seed
        self._states[name] = {}

    def seeds(self) -> Dict[str, int]:
        """Each stream's seed."""
        return dict(self._seeds)

    def get_states(self) -> States:
        """A copy of every stream's state, for :meth:`set_states` (a checkpoint's or a resume's)."""
        return _copy(self._states)

    def set_states(self, states: States) -> None:
        """Put back states :meth:`get_states` returned; the streams must exist."""
        unknown = sorted(set(states) - set(self._seeds))
        if unknown:
            raise ValueError(f"states: no stream named {', '.join(map(repr, unknown))} was added")
        self._states.update(_copy(states))

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Within the block, the default generators draw from stream ``name``."""
        if name not in self._seeds:
            hint = (" (tp_kernels.model_parallel_manual_seed adds it)" if name == MODEL_PARALLEL_RNG
                    else f" (streams: {', '.join(map(repr, self._seeds)) or 'none'})")
            raise ValueError(f"name: no random stream {name!r} was added{hint}")
        if name in self._open:
            raise RuntimeError(f"fork: the stream {name!r} is already forked in an enclosing block")
        _refuse_capture("fork")
        states = self._states[name]
        with _swapped() as generators:
            for device, generator in generators:
                if device not in states:
                    states[device] = torch.Generator(device).manual_seed(self._seeds[name]).get_state()
                generator.set_state(states[device])
            self._open.add(name)
            try:
                yield
            finally:
                self._open.discard(name)
                for device, generator in generators:  # (the stream goes on where the block left it)
                    states[device] = generator.get_state()


class _Replay:
    """Checkpoint's recompute context: the tracker's streams as they were when the forward began,
    then as they were before the recompute (reusable: a retained graph recomputes again)."""

    def __init__(self, tracker: RNGStatesTracker, states: States, inner=None) -> None:
        self._tracker, self._states, self._inner = tracker, states, inner or contextlib.nullcontext()
        self._saved: List[States] = []

    def __enter__(self):
        self._saved.append(self._tracker._states)
        self._tracker._states = _copy(self._states)
        try:
            return self._inner.__enter__()
        except BaseException:
            self._tracker._states = self._saved.pop()
            raise

    def __exit__(self, *exc):
        try:
            return self._inner.__exit__(*exc)
        finally:
            self._tracker._states = self._saved.pop()


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """This process's tracker (one per process, as the default generators are)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, group=None) -> None:
    """Seed the default stream with ``seed`` (``torch.manual_seed``: the CPU and every CUDA
    device) and the model-parallel stream with ``seed + 2718 + rank`` (this rank in ``group``,
    the tensor-parallel group by default), after checking that every rank of the group got the
    same ``seed``: ranks seeded otherwise would drop their replicated activations differently,
    silently. Call it on every rank of the group (a bounded exchange); give each pipeline stage
    or data-parallel replica its own seed as Megatron-LM does, if it should draw otherwise.
    """
    group = coll.resolve_group(group)
    p = coll.group_size(group)

    def check() -> int:
        _check_seed("seed", seed)
        if seed + SEED_OFFSET + p - 1 >= SEED_LIMIT:
            raise ValueError(f"seed: {seed} + {SEED_OFFSET} + the rank (up to {p - 1}) leaves [0, 2**63)")
        return seed

    agree("model_parallel_manual_seed", group, check, lambda s: f"seed {s}", always=True)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + SEED_OFFSET + coll.group_rank(group))


#: splitmix64's odd constant: a rank's multiple of it, mixed into a seed, gives each rank another seed
_MIX = 0x9E3779B97F4A7C15


@contextlib.contextmanager
def rank_fork(group=None):
    """Within the block, the default generators (the CPU's, and the current CUDA device's once CUDA
    is initialized) draw from a stream of this rank's own, seeded by one number drawn from the
    stream they draw from (the default CPU stream, or the fork around it) mixed with this rank in
    ``group`` (the tensor-parallel group by default); afterwards they draw on as if the block had
    drawn that one number alone. Ranks whose default streams are alike (seeded alike,
    :func:`model_parallel_manual_seed`) thus draw different masks in the block, a new pair of masks
    at every block, and a checkpoint that restores the default stream before it recomputes
    (``torch.utils.checkpoint``'s own, reentrant or not: a transformers model's gradient
    checkpointing) draws the forward's masks again, where the block lies inside what it recomputes:
    what :func:`tp_kernels.parallelize` runs the dropout of what each rank holds of its own in. Needs
    no seed of its own, and no :func:`checkpoint`; a fork inside a CUDA graph capture is refused, as
    :meth:`RNGStatesTracker.fork` is."""
    rank = coll.group_rank(coll.resolve_group(group))
    _refuse_capture("rank_fork")  # (before the draw)
    drawn = int(torch.randint(SEED_LIMIT - 1, (), generator=torch.default_generator))
    seed = (drawn ^ ((rank + 1) * _MIX)) % SEED_LIMIT
    with _swapped() as generators:
        for _, generator in generators:
            generator.manual_seed(seed)
        yield


def checkpoint(function: Callable, *args, use_reentrant: bool = False, context_fn: Optional[Callable] = None,
               **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` whose
    recomputation also draws the tracker's streams (:func:`get_rng_tracker`) from where the
    forward drew them, so dropout in a fork gets the forward's masks again. ``context_fn`` (a
    selective-checkpointing policy's, say) is kept: its contexts run inside this one's. Only the
    non-reentrant checkpoint takes contexts: ``use_reentrant=True`` is refused."""
    if use_reentrant:
        raise ValueError("use_reentrant: tp_kernels.rng.checkpoint is the non-reentrant checkpoint (the one torch "
                         "recommends); the reentrant one cannot restore the tracker's streams")
    if context_fn is not None and not callable(context_fn):
        raise ValueError(f"context_fn: expected a callable returning two context managers, got {context_fn!r}")

    def contexts():
        forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(), None)
        return forward, _Replay(_TRACKER, _TRACKER.get_states(), recompute)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)
