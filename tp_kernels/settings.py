"""Every run-time switch of tp_kernels: defined, defaulted, validated and documented here.

=====================================  ==========================  ===========================================
environment variable                   setter (wins over it)       meaning, default
=====================================  ==========================  ===========================================
``TP_KERNELS_TIMEOUT_S``               :func:`set_timeout`         bound on every collective wait, seconds
                                                                   (finite, > 0); default 300
``TP_KERNELS_COMM_STREAM_PRIORITY``    :func:`set_comm_stream_     CUDA priority of the native pipelined
                                       priority`                   path's communication stream (lower is
                                                                   higher, clamped); default the highest
``TP_KERNELS_AUTO_CANDIDATES``         :func:`set_auto_            the backends ``"auto"`` may choose, e.g.
                                       candidates`                 ``fused,pipelined,reference``; default:
                                                                   the reference plus the fast paths switched
                                                                   on below
``TP_KERNELS_AUTO_NATIVE``             (0/1)                       the native pipelined path is a default
                                                                   candidate of ``"auto"``; default 0
``TP_KERNELS_AUTO_FUSED``              (0/1)                       the fused path is a default candidate of
                                                                   ``"auto"``; default 0
``TP_KERNELS_AUTOTUNE``                :func:`set_autotune`        ``"auto"`` measures its candidates (1) or
                                                                   takes the first (0); default 1
``TP_KERNELS_FUSED_ALL_REDUCE``        (a name)                    force the fused all-reduce algorithm
                                                                   (``one_shot``, ``two_shot``,
                                                                   ``scatter_gather``); default: chosen
``TP_KERNELS_FINGERPRINTS``            :func:`set_fingerprints`    every call agrees across the group on
                                                                   what it does before any payload moves
                                                                   (1) or not (0); default 0 (its cost:
                                                                   docs/api.md, "When ranks disagree")
``TP_KERNELS_CHECK_IDS``               :func:`set_ids_checked`     an eager call checks its embedding ids and
                                                                   cross-entropy targets against the
                                                                   vocabulary (1: on CUDA a host sync, the
                                                                   GPU's work so far waited for) or not (0:
                                                                   an id or target out of range then fails
                                                                   the lookup on every rank, as
                                                                   ``nn.Embedding``'s and
                                                                   ``F.cross_entropy``'s do: an
                                                                   ``IndexError`` on the CPU, a device-side
                                                                   assert on CUDA); default 1
``TP_KERNELS_NCCL_BLOCKING``           :func:`set_nccl_blocking`   the native path's NCCL communicators in
                                                                   NCCL's blocking mode (1: no thread of
                                                                   NCCL's a call; an enqueue blocked past the
                                                                   timeout revoked by the watchdog; NCCL
                                                                   2.28.9 and later) or nonblocking (0);
                                                                   read when a group's communicator is made;
                                                                   default: 1 where the NCCL loaded has
                                                                   ncclCommRevoke, else 0
``TP_KERNELS_GEMM_STREAMS``            :func:`set_gemm_streams`    the streams the native pipelined path's
                                                                   chunk GEMMs run on: 1 (the caller's) or 2
                                                                   (alternating with a second stream of the
                                                                   group's communicator, so that one GEMM's
                                                                   last wave of tiles may run beside the
                                                                   next one's first); default 1 (an
                                                                   experiment, to be measured:
                                                                   docs/benchmarks.md)
``TP_KERNELS_GEMM_TUNING``             :func:`set_gemm_tuning`     how many of cuBLASLt's proposals the
                                                                   native GEMM times for a problem on its
                                                                   first call, keeping the fastest: 0 (off:
                                                                   the heuristic's first) or 2..32; default
                                                                   0 (to be measured: docs/benchmarks.md)
=====================================  ==========================  ===========================================

Environment values are read when used, so a change takes effect at the next call; a malformed
one raises ``ValueError`` naming the variable. :func:`overriding` sets any of the setters' values
for a block of code, and gives back exactly what was set before (a setter's value, or none).
Build switches (``TP_KERNELS_SKIP_CUDA_BUILD``, ``TP_KERNELS_CUDA_ARCHS``,
``TP_KERNELS_BUILD_TYPE``, ``MAX_JOBS``) are read by ``setup.py`` at build time, and
``TP_KERNELS_COMMIT`` names the commit in the benchmarks' records.

This module also holds the names a caller may pass as ``backend=``, which the switches above are
checked against. It imports nothing of tp_kernels.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Dict, Optional, Sequence, Tuple

__all__ = [
    "AUTO_CHOICES",
    "AUTO_FUSED_DEFAULT",
    "AUTO_NATIVE_DEFAULT",
    "AutoState",
    "BACKENDS",
    "BACKEND_NAMES",
    "DEFAULT_TIMEOUT_S",
    "GEMM_STREAMS_DEFAULT",
    "GEMM_TUNING_DEFAULT",
    "NCCL_BLOCKING_DEFAULT",
    "auto_fused",
    "auto_native",
    "auto_state",
    "autotune_enabled",
    "deciding",
    "fingerprints_enabled",
    "ids_checked",
    "forced_all_reduce_algorithm",
    "gemm_streams",
    "gemm_tuning",
    "nccl_blocking",
    "get_auto_candidates",
    "get_comm_stream_priority",
    "get_timeout",
    "overriding",
    "set_auto_candidates",
    "set_autotune",
    "set_comm_stream_priority",
    "set_fingerprints",
    "set_gemm_streams",
    "set_gemm_tuning",
    "set_ids_checked",
    "set_nccl_blocking",
    "set_timeout",
]

#: The backends a caller names with ``backend=``, besides ``"auto"``.
BACKENDS = ("reference", "pipelined", "fused")
BACKEND_NAMES = ("auto",) + BACKENDS
#: The backends ``"auto"`` may be allowed to choose, in the order it takes them without measuring
#: (the fastest by design first).
AUTO_CHOICES = tuple(reversed(BACKENDS))

DEFAULT_TIMEOUT_S = 300.0
#: The longest timeout accepted: a day (a longer one is a mistake, and overflows some backends'
#: deadline arithmetic).
MAX_TIMEOUT_S = 86400.0
#: The default priority asks for the device's highest (the native side clamps it).
HIGHEST_PRIORITY = -(2**31)
#: Whether ``"auto"`` may pick the native pipelined path / the fused path without being asked.
#: Both stay off until the GPU suite (``bench/gpu_suite.sh``) has measured them faster than the
#: reference on several ranks (docs/benchmarks.md, Measured: GPU): ``"auto"`` must never be wrong
#: or slower.
AUTO_NATIVE_DEFAULT = False
AUTO_FUSED_DEFAULT = False

_timeout_s: Optional[float] = None
_priority: Optional[int] = None
_candidates: Optional[Tuple[str, ...]] = None
_autotune: Optional[bool] = None
_fingerprints: Optional[bool] = None
_ids_checked: Optional[bool] = None
_nccl_blocking: Optional[bool] = None
_gemm_streams: Optional[int] = None
_gemm_tuning: Optional[int] = None


class _Variable:
    """One environment variable: read at every use, so that a change takes effect at the next
    call, and parsed once per value it takes (a malformed value raises at every read).

    The read goes to ``os.environ``'s own store of encoded names and values (CPython's
    ``os._Environ._data``, which ``os.environ[...] = ...`` and ``del`` keep up to date) without
    the mapping's encoding and decoding of each name and value: ``os.environ.get`` costs about
    0.7 µs, and a call of an op reads several settings. Where that store is missing, through
    ``environ.get``."""

    __slots__ = ("name", "_parse", "default", "_environ", "_store", "_key", "_raw", "_value")

    def __init__(self, name: str, parse: Callable[[str], object], default, environ=os.environ):
        self.name, self._parse, self.default, self._environ = name, parse, default, environ
        store, encode = getattr(environ, "_data", None), getattr(environ, "encodekey", None)
        usable = isinstance(store, dict) and encode is not None and hasattr(environ, "decodevalue")
        self._store, self._key = (store, encode(name)) if usable else (None, name)
        self._raw = self._value = None  # the last value parsed, and what it parsed to

    def get(self, override=None):
        """``override`` when it is not None, else the variable's value parsed, else the default
        (also for an empty value)."""
        if override is not None:
            return override
        store = self._store
        raw = self._environ.get(self.name) if store is None else store.get(self._key)
        if not raw:
            return self.default
        if raw != self._raw:
            text = raw if store is None else self._environ.decodevalue(raw)
            value = self._parse(text)  # raises ValueError naming the variable if malformed
            self._raw, self._value = raw, value
        return self._value


def _switch_value(enabled: Optional[bool]) -> Optional[bool]:
    """``enabled``, a switch's setter's argument (a bool, or None: back to its environment variable
    or default), else a ``ValueError`` naming it."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool or None, got {enabled!r}")
    return enabled


def _switch(name: str, default: bool) -> _Variable:
    """A 0/1 environment variable."""
    def parse(value: str) -> bool:
        if value not in ("0", "1"):
            raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
        return value == "1"

    return _Variable(name, parse, default)


def _check_timeout(what: str, seconds) -> float:
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
            or not 0 < seconds <= MAX_TIMEOUT_S):
        raise ValueError(f"{what}: expected a positive number of seconds, at most {MAX_TIMEOUT_S:g}, "
                         f"got {seconds!r}")
    return float(seconds)


def _parse_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    return _check_timeout("TP_KERNELS_TIMEOUT_S", seconds)


_TIMEOUT = _Variable("TP_KERNELS_TIMEOUT_S", _parse_timeout, DEFAULT_TIMEOUT_S)


def set_timeout(seconds: float) -> None:
    """Set how long any tp_kernels collective may take before it raises (seconds, > 0).

    The default is 300 s, or ``TP_KERNELS_TIMEOUT_S`` from the environment.
    """
    global _timeout_s
    _timeout_s = _check_timeout("seconds", seconds)


def get_timeout() -> float:
    """The current collective timeout in seconds (see :func:`set_timeout`)."""
    return _TIMEOUT.get(_timeout_s)


def set_comm_stream_priority(priority: int) -> None:
    """Priority of the communication stream of native communicators created from now on.

    CUDA's convention: a lower number is a higher priority; values beyond the device's range are
    clamped to it. The default is the highest priority, so that NCCL kernels are scheduled
    promptly between GEMM blocks (``TP_KERNELS_COMM_STREAM_PRIORITY`` overrides it).
    """
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: expected an int, got {priority!r}")
    global _priority
    _priority = priority


def _parse_priority(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"TP_KERNELS_COMM_STREAM_PRIORITY: expected an int, got {value!r}") from None


_PRIORITY = _Variable("TP_KERNELS_COMM_STREAM_PRIORITY", _parse_priority, HIGHEST_PRIORITY)


def get_comm_stream_priority() -> int:
    """The priority new communication streams ask for (see :func:`set_comm_stream_priority`)."""
    return _PRIORITY.get(_priority)


def _check_candidates(names, what: str) -> Tuple[str, ...]:
    names = None if isinstance(names, str) else tuple(names)
    if not names or any(n not in AUTO_CHOICES for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{what}: expected distinct names among {AUTO_CHOICES}, got {names!r}")
    return names


def set_auto_candidates(names: Optional[Sequence[str]]) -> None:
    """The backends ``"auto"`` chooses among (any of :data:`AUTO_CHOICES`), measured when several
    can run a call; None returns to ``TP_KERNELS_AUTO_CANDIDATES`` or the default. Decisions
    already made are kept: :func:`tp_kernels.autotune.forget` drops them."""
    global _candidates
    _candidates = None if names is None else _check_candidates(names, "names")


def get_auto_candidates() -> Optional[Tuple[str, ...]]:
    """The backends named for ``"auto"``, or None for the default."""
    return _CANDIDATES.get(_candidates)


_CANDIDATES = _Variable("TP_KERNELS_AUTO_CANDIDATES", lambda value: _check_candidates(
    [n.strip() for n in value.split(",")], "TP_KERNELS_AUTO_CANDIDATES"), None)


def set_autotune(enabled: Optional[bool]) -> None:
    """Whether ``"auto"`` measures its candidates (default: ``TP_KERNELS_AUTOTUNE``, else yes);
    without measuring it takes the first of them in the order of :data:`AUTO_CHOICES`."""
    global _autotune
    _autotune = _switch_value(enabled)


def autotune_enabled() -> bool:
    return _AUTOTUNE.get(_autotune)


_AUTOTUNE = _switch("TP_KERNELS_AUTOTUNE", True)


#: Whether calls exchange their fingerprints by default. Off: the exchange is one more small
#: collective per call, a round trip that cost a median 30 % of a call at the CPU benchmark's
#: shapes on 2 gloo ranks (``python -m tp_kernels.bench.fingerprints``; the bar for "on"
#: is 3 %). On NCCL groups the exchange goes over a gloo twin (parallel_state.host_group), not
#: yet measured on a GPU.
FINGERPRINTS_DEFAULT = False


def set_fingerprints(enabled: Optional[bool]) -> None:
    """Whether every call agrees across its group on what it does before any payload moves (see
    docs/api.md, "When ranks disagree"); None returns to ``TP_KERNELS_FINGERPRINTS`` or the
    default (:data:`FINGERPRINTS_DEFAULT`). Every rank of a group must use the same setting."""
    global _fingerprints
    _fingerprints = _switch_value(enabled)


def fingerprints_enabled() -> bool:
    """Whether calls exchange fingerprints (:func:`set_fingerprints`)."""
    return _FINGERPRINTS.get(_fingerprints)


_FINGERPRINTS = _switch("TP_KERNELS_FINGERPRINTS", FINGERPRINTS_DEFAULT)


def set_ids_checked(enabled: Optional[bool]) -> None:
    """Whether an eager call checks its embedding ids and cross-entropy targets against the
    vocabulary on the host (on CUDA a host sync a call); unchecked, an id or target out of range
    fails the lookup on every rank instead (see the table above). None returns to
    ``TP_KERNELS_CHECK_IDS`` or the default (on)."""
    global _ids_checked
    _ids_checked = _switch_value(enabled)


def ids_checked() -> bool:
    """Whether an eager call checks its embedding ids and cross-entropy targets against the
    vocabulary (:func:`set_ids_checked`)."""
    return _CHECK_IDS.get(_ids_checked)


_CHECK_IDS = _switch("TP_KERNELS_CHECK_IDS", True)


#: Whether the native path's NCCL communicators are in NCCL's blocking mode by default: None, which
#: :func:`tp_kernels.backends.pipelined_native.blocking_mode` reads as blocking where the NCCL loaded
#: has ``ncclCommRevoke`` (2.28.9 and later: what bounds a blocked call) and nonblocking elsewhere.
#: Measured with peers (docs/benchmarks.md): NCCL starts a thread for every call of a nonblocking
#: communicator, and the pipelined ``matmul_all_reduce`` added 323 µs more host time a call in
#: nonblocking mode than in blocking mode.
NCCL_BLOCKING_DEFAULT = None


def set_nccl_blocking(enabled: Optional[bool]) -> None:
    """Whether a group's NCCL communicator of the native path, when it is made (its first native
    call), runs the ops in NCCL's blocking mode: a collective launched on the calling thread,
    where in nonblocking mode NCCL starts a thread for each call and the caller polls it. The
    ranks join in nonblocking mode either way (bounded by the timeout); in blocking mode an
    enqueue that has not returned within the timeout has its communicator revoked by the watchdog
    (``ncclCommRevoke``: NCCL 2.28.9 and later; with an older NCCL the communicator's making
    raises). None returns to ``TP_KERNELS_NCCL_BLOCKING`` or the default
    (:data:`NCCL_BLOCKING_DEFAULT`: blocking where the NCCL loaded has ``ncclCommRevoke``). Every
    rank of a group must use the same setting: ranks set apart fail at the communicator's making,
    within the timeout."""
    global _nccl_blocking
    _nccl_blocking = _switch_value(enabled)


def nccl_blocking() -> Optional[bool]:
    """Whether a native communicator made now is in NCCL's blocking mode, as set
    (:func:`set_nccl_blocking`, ``TP_KERNELS_NCCL_BLOCKING``); None where neither says: the default,
    which :func:`tp_kernels.backends.pipelined_native.blocking_mode` decides."""
    return _NCCL_BLOCKING.get(_nccl_blocking)


_NCCL_BLOCKING = _switch("TP_KERNELS_NCCL_BLOCKING", NCCL_BLOCKING_DEFAULT)


#: The streams the native pipelined path's chunk GEMMs run on by default: one, until two are measured
#: faster (docs/benchmarks.md: split into chunks, a GEMM's last wave of tiles leaves SMs idle).
GEMM_STREAMS_DEFAULT = 1
#: the counts :func:`set_gemm_streams` takes
GEMM_STREAM_COUNTS = (1, 2)


def _check_gemm_streams(what: str, count) -> int:
    if not isinstance(count, int) or isinstance(count, bool) or count not in GEMM_STREAM_COUNTS:
        raise ValueError(f"{what}: expected one of {GEMM_STREAM_COUNTS}, got {count!r}")
    return count


def _parse_gemm_streams(value: str) -> int:
    if value.strip() not in [str(count) for count in GEMM_STREAM_COUNTS]:
        raise ValueError(f"TP_KERNELS_GEMM_STREAMS: expected one of {GEMM_STREAM_COUNTS}, got {value!r}")
    return int(value)


def set_gemm_streams(count: Optional[int]) -> None:
    """The streams the native pipelined path's GEMMs of a call run on when it has several (its
    chunks, the all-gather's shards): 1, all on the caller's stream, one after another; 2,
    alternating between it and a second stream of the group's communicator (with a cuBLASLt
    workspace of its own), so that a GEMM's last, partly filled wave of tiles may run beside the
    next GEMM's first; each collective still waits for its own GEMM only. None returns to
    ``TP_KERNELS_GEMM_STREAMS`` or the default (:data:`GEMM_STREAMS_DEFAULT`). Ranks may differ:
    what moves between them is the same."""
    global _gemm_streams
    _gemm_streams = None if count is None else _check_gemm_streams("count", count)


def gemm_streams() -> int:
    """The streams the native pipelined path's GEMMs of a call run on (:func:`set_gemm_streams`)."""
    return _GEMM_STREAMS.get(_gemm_streams)


_GEMM_STREAMS = _Variable("TP_KERNELS_GEMM_STREAMS", _parse_gemm_streams, GEMM_STREAMS_DEFAULT)

#: How many of cuBLASLt's proposals the native GEMM times for a problem by default: none (its
#: heuristic's first runs; at 4640cd4 on an H200 a 70B TP8 column chunk's fastest proposal ran 1.15x
#: faster than the first: docs/benchmarks.md)
GEMM_TUNING_DEFAULT = 0
#: the most proposals :func:`set_gemm_tuning` takes
GEMM_TUNING_MAX = 32
#: how many times a tuned problem's proposals each run, after one, between two CUDA events
GEMM_TUNING_ITERS = 5


def _check_gemm_tuning(what: str, candidates) -> int:
    if (not isinstance(candidates, int) or isinstance(candidates, bool)
            or not (candidates == 0 or 2 <= candidates <= GEMM_TUNING_MAX)):
        raise ValueError(f"{what}: expected 0 (off) or 2..{GEMM_TUNING_MAX} proposals, got {candidates!r}")
    return candidates


def _parse_gemm_tuning(value: str) -> int:
    try:
        return _check_gemm_tuning("TP_KERNELS_GEMM_TUNING", int(value.strip()))
    except ValueError:
        raise ValueError(f"TP_KERNELS_GEMM_TUNING: expected 0 (off) or 2..{GEMM_TUNING_MAX} proposals, "
                         f"got {value!r}") from None


def set_gemm_tuning(candidates: Optional[int]) -> None:
    """How many of cuBLASLt's proposals for a GEMM problem the native GEMMs time on the problem's
    first call, keeping the fastest where it runs more than 2 % faster than the heuristic's first:
    0, off (the heuristic's first, :data:`GEMM_TUNING_DEFAULT`), or 2..32. The timing runs each
    proposal :data:`GEMM_TUNING_ITERS` times on a stream of its own, into an output and a
    cuBLASLt workspace of its own, without waiting for the work queued before the call; it waits
    (within :func:`get_timeout`) for those GEMMs alone, once per problem and process, and never in
    a CUDA graph capture (a plan first made there keeps the heuristic's first). Plans made before
    the setting changed stay as they are. Which proposal wins can differ between runs and ranks,
    and with it the rounding of a product. None returns to ``TP_KERNELS_GEMM_TUNING`` or the
    default."""
    global _gemm_tuning
    _gemm_tuning = None if candidates is None else _check_gemm_tuning("candidates", candidates)


def gemm_tuning() -> int:
    """How many of cuBLASLt's proposals a new GEMM plan times (:func:`set_gemm_tuning`; 0: off)."""
    return _GEMM_TUNING.get(_gemm_tuning)


_GEMM_TUNING = _Variable("TP_KERNELS_GEMM_TUNING", _parse_gemm_tuning, GEMM_TUNING_DEFAULT)


#: Why the native pipelined path is no default candidate of ``"auto"`` (while it is not).
AUTO_NATIVE_OFF = ("the native path is not yet chosen automatically (no GPU figure shows it faster than the "
                   "reference yet: docs/benchmarks.md); use backend='pipelined', or set TP_KERNELS_AUTO_NATIVE=1")
AUTO_FUSED_OFF = "not switched on for 'auto' (TP_KERNELS_AUTO_FUSED=1 or set_auto_candidates)"


def auto_native() -> bool:
    """Whether ``"auto"`` may run the native pipelined path unasked (:data:`AUTO_NATIVE_DEFAULT`)."""
    return _AUTO_NATIVE.get()


def auto_fused() -> bool:
    """Whether ``"auto"`` may run the fused path unasked (:data:`AUTO_FUSED_DEFAULT`)."""
    return _AUTO_FUSED.get()


_AUTO_NATIVE = _switch("TP_KERNELS_AUTO_NATIVE", AUTO_NATIVE_DEFAULT)
_AUTO_FUSED = _switch("TP_KERNELS_AUTO_FUSED", AUTO_FUSED_DEFAULT)


def forced_all_reduce_algorithm(known: Sequence[str]) -> Optional[str]:
    """The fused all-reduce algorithm ``TP_KERNELS_FUSED_ALL_REDUCE`` forces, one of ``known``
    (the native module's ``ALL_REDUCE_ALGORITHMS``), or None when it is unset."""
    value = _FUSED_ALL_REDUCE.get()
    if value is not None and value not in known:
        raise ValueError(f"TP_KERNELS_FUSED_ALL_REDUCE: expected one of {tuple(known)}, got {value!r}")
    return value


_FUSED_ALL_REDUCE = _Variable("TP_KERNELS_FUSED_ALL_REDUCE", str, None)


#: what :func:`overriding` takes: a setting's name -> its setter, and the module variable it writes
_SETTERS = {"timeout": (set_timeout, "_timeout_s"), "comm_stream_priority": (set_comm_stream_priority, "_priority"),
            "auto_candidates": (set_auto_candidates, "_candidates"), "autotune": (set_autotune, "_autotune"),
            "fingerprints": (set_fingerprints, "_fingerprints"), "ids_checked": (set_ids_checked, "_ids_checked"),
            "nccl_blocking": (set_nccl_blocking, "_nccl_blocking"),
            "gemm_streams": (set_gemm_streams, "_gemm_streams"), "gemm_tuning": (set_gemm_tuning, "_gemm_tuning")}


@contextlib.contextmanager
def overriding(**values):
    """The settings named (``timeout``, ``comm_stream_priority``, ``auto_candidates``,
    ``autotune``, ``fingerprints``, ``ids_checked``, ``nccl_blocking``, ``gemm_streams``,
    ``gemm_tuning``) set
    inside the block, each checked as its setter checks it; after it, what was set before, exactly
    (a value a setter set, or none: the environment variable or the default again)::

        with tp_kernels.settings.overriding(timeout=5, fingerprints=True):
            ...
    """
    unknown = sorted(set(values) - set(_SETTERS))
    if unknown:
        raise ValueError(f"overriding: expected settings among {', '.join(_SETTERS)}, got {', '.join(unknown)}")
    before = {name: globals()[_SETTERS[name][1]] for name in values}
    try:
        for name, value in values.items():
            _SETTERS[name][0](value)
        yield
    finally:
        for name, value in before.items():
            globals()[_SETTERS[name][1]] = value


class AutoState:
    """What ``"auto"``'s choice of an implementation depends on among these settings, each as its
    own getter reads it, and what follows from them. One object per combination of values
    (:func:`auto_state`), so that two states are the same object exactly when they are equal."""

    __slots__ = ("candidates", "native", "fused", "measures", "fused_all_reduce", "allowed", "fused_on", "native_on",
                 "fast_path_on")

    def __init__(self, candidates: Optional[Tuple[str, ...]], native: bool, fused: bool, measures: Optional[bool],
                 fused_all_reduce: Optional[str]):
        self.candidates = candidates  # named (get_auto_candidates), or None
        self.native, self.fused = native, fused  # auto_native(), auto_fused()
        self.measures = measures  # autotune_enabled() (None: not read, no fast path on)
        self.fused_all_reduce = fused_all_reduce  # TP_KERNELS_FUSED_ALL_REDUCE as set (checked where used)
        #: the backends "auto" may choose: those named, else AUTO_CHOICES
        self.allowed = candidates if candidates is not None else AUTO_CHOICES
        #: whether the fused / the native pipelined path is a candidate: named, or allowed and switched on
        self.fused_on = "fused" in self.allowed and (candidates is not None or fused)
        self.native_on = "pipelined" in self.allowed and (candidates is not None or native)
        #: whether "auto" may choose anything but the reference
        self.fast_path_on = self.fused_on or self.native_on

    def __repr__(self) -> str:
        return (f"AutoState(candidates={self.candidates!r}, native={self.native}, fused={self.fused}, "
                f"measures={self.measures}, fused_all_reduce={self.fused_all_reduce!r})")


def deciding(backend: str) -> str:
    """What of these settings, beyond its arguments, decides the implementation a call of
    ``backend`` runs, as its fingerprint shows it (:mod:`tp_kernels._agreement`): ``"auto"``'s
    state (:func:`auto_state`), the fused all-reduce algorithm ``TP_KERNELS_FUSED_ALL_REDUCE``
    forces for ``"fused"``; nothing for the others. Ranks set apart there would run different
    collectives, which no check of the arguments sees."""
    if backend == "auto":
        return f", {auto_state()!r}"
    if backend == "fused":
        return f", TP_KERNELS_FUSED_ALL_REDUCE={_FUSED_ALL_REDUCE.get()!r}"
    return ""


#: the values of :class:`AutoState` -> its one object
_AUTO_STATES: Dict[tuple, AutoState] = {}


def auto_state() -> AutoState:
    """The settings ``"auto"``'s choice depends on, read now: whether it measures and the fused
    all-reduce algorithm forced only where a fast path may be a candidate (else they change
    nothing, and stand as None)."""
    named, native, fused = _CANDIDATES.get(_candidates), _AUTO_NATIVE.get(), _AUTO_FUSED.get()
    if named is None and not native and not fused:
        values = (None, False, False, None, None)
    else:
        values = (named, native, fused, _AUTOTUNE.get(_autotune), _FUSED_ALL_REDUCE.get())
    state = _AUTO_STATES.get(values)
    if state is None:
        state = _AUTO_STATES[values] = AutoState(*values)
    return state
