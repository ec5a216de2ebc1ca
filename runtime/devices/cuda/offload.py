"""Activation offload on CUDA: checkpointed layers' kept values wait in pinned host memory.

The compiler maps the graph's Offload / Fetch units (graphs/ops/offload.py) to two functions a
slot (a layer), registered here when the artifact loads (compiler/units/offload.py):

    lorac.offload.<slot>(x1..xn, y.., token)  each x -> its place in the slot's pinned host
                                         buffer on a side stream, straight from where the plan
                                         keeps it (the y.. are the two slots before, held alive
                                         by the call; the call that lets a slot go waits for its
                                         copy); the top three slots, which no later call holds,
                                         through a device staging buffer instead (copies on TVM's
                                         stream, then one copy to the host on the side stream).
                                         The PCIe copies overlap the forward
    lorac.fetch.<slot>(token, x1..xn, y1..ym)  x: this slot's tensors, filled from its host buffer
                                         on the side stream by the call before (issued one fetch
                                         ahead: the copy overlaps the layer above's backward);
                                         the call waits for that copy and issues the next slot's
                                         into y, that slot's tensors, output here. The top slot's
                                         call (no x) and the lowest one's also output the slot's
                                         values, copied from staging / from x on TVM's stream.
                                         (Older artifacts: the host buffer -> staging one fetch
                                         ahead, then each place -> its output on TVM's stream.)

Staging is two device buffers; the i-th slot of the step (ascending) uses buffer i % 2 for its
copy back and, if it is one of the top three, for its copy out before that: the side stream runs
every copy out before any copy back, and each copy out waits for the forward's writes into its buffer, so a fetch's copy
into a buffer follows the last copy out of it. An event per buffer and direction orders its
reuse after the copy that reads it. The top slot never leaves the device: nothing writes its
buffer between its offload (the forward's last) and its fetch (the backward's first), so its
values wait there, and the backward starts without waiting for a copy back. Every decision
(which buffer, whether to wait) depends only on a slot's place in the step's order, so a CUDA
graph captured on the first step replays it exactly; the side stream forks from TVM's stream
with an event and joins it again at each fetch, as capture requires. Pinned buffers, staging
and events are made when the artifact loads, before any capture.
"""
from __future__ import annotations

import ctypes

from lorac.core.constants import OFFLOAD_KEEP_ALIVE as KEEP_ALIVE

from ...errors import LoracError
from .cudart import runtime, stream_getter

OFFLOAD, FETCH = "lorac.offload", "lorac.fetch"
_D2D, _D2H, _H2D = 3, 2, 1  # cudaMemcpyKind
_NO_TIMING = 2  # cudaEventDisableTiming

_rt = None
_get_stream = None
_state: dict = {}  # slot -> {"host": ptr, "bytes": n}; "order": ascending slots; "side": stream; ...


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LoracError(f"activation offload: {what} failed (CUDA error {status})")


def _init() -> None:
    global _rt, _get_stream
    if _rt is None:
        _rt, _get_stream = runtime(), stream_getter()


def _event():
    e = ctypes.c_void_p()
    _check(_rt.cudaEventCreateWithFlags(ctypes.byref(e), _NO_TIMING), "cudaEventCreate")
    return e


def _alloc(nbytes: int, host: bool) -> int:
    ptr = ctypes.c_void_p()
    if host:  # pinned, so the copies run asynchronously at full PCIe speed
        _check(_rt.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0), f"cudaHostAlloc of {nbytes / 1e9:.2f} GB")
    else:
        _check(_rt.cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc of {nbytes / 1e9:.2f} GB")
    return ptr.value


ALIGN = 256  # each value's place in a slot's buffers (cudaMalloc's alignment)
# the top KEEP_ALIVE + 1 slots go through staging: no later offload call holds their values, and
# the top one's never leave it; the others are copied out straight from where the plan keeps them
DIRECT_BEFORE_TOP = KEEP_ALIVE + 1
ITEMSIZE = {"bfloat16": 2, "float32": 4}


def slot_layout(call: dict) -> tuple[list[tuple[int, int]], int]:
    """([(offset, bytes)] of each value of a manifest `unit_calls` offload entry, total bytes); an
    entry lists its values under "tensors" (older artifacts: one value, "shape" and "dtype")."""
    tensors = call.get("tensors") or [{"shape": call["shape"], "dtype": call["dtype"]}]
    places, at = [], 0
    for t in tensors:
        nbytes = ITEMSIZE[t["dtype"]] * int(_prod(t["shape"]))
        places.append((at, nbytes))
        at += -(-nbytes // ALIGN) * ALIGN
    return places, at


def prepare(manifest) -> None:
    """Pinned host buffers per slot, staging, events, the side stream; the functions registered."""
    import tvm_ffi

    calls = [c for c in manifest.unit_calls if c.get("function") == OFFLOAD]
    if not calls:
        return
    _init()
    need = {int(c["slot"]): slot_layout(c) for c in calls}
    top = max(need)  # stays in staging (module doc): no host buffer
    check_host_memory(sum(n for slot, (_, n) in need.items()
                          if slot != top and _state.get(slot, {}).get("bytes", 0) < n))
    biggest = max(total for _, total in need.values())
    if _state.get("staging_bytes", 0) < biggest:
        side = ctypes.c_void_p()
        _check(_rt.cudaStreamCreateWithFlags(ctypes.byref(side), 1), "cudaStreamCreate")  # non-blocking
        _state.update(side=side, staging_bytes=biggest,
                      staging=[_alloc(biggest, False) for _ in range(2)],
                      out_done=[_event() for _ in range(2)], out_ready=[_event() for _ in range(2)],
                      back_done=[_event() for _ in range(2)], back_ready=[_event() for _ in range(2)])
    for slot, (places, nbytes) in need.items():
        old = _state.get(slot)
        if old is None or old["bytes"] < nbytes:
            _state[slot] = {"host": None if slot == top else _alloc(nbytes, True), "bytes": nbytes}
        elif slot == top:
            _state[slot]["bytes"] = nbytes
        _state[slot]["places"] = places
        tvm_ffi.register_global_func(f"{OFFLOAD}.{slot}", _offloader(slot), override=True)
        tvm_ffi.register_global_func(f"{FETCH}.{slot}", _fetcher(slot), override=True)
    _state["order"] = sorted(need)
    # artifacts whose offload calls hold the two slots before them (compiler/units/offload.py)
    _state["direct"] = all(int(c.get("keep_alive", 0)) == KEEP_ALIVE for c in calls)
    # and whose fetch calls take their slot's tensors from the call before and output the next's
    _state["ahead"] = all(c.get("fetch_ahead") for c in calls)


HOST_SHARE = 0.9  # of the host's available memory the pinned buffers may take (pinned pages never swap)


def pinnable() -> int | None:
    """Host bytes the pinned buffers may take: HOST_SHARE of the host's available memory (None: unknown)."""
    from ..cpu import memory_free
    free = memory_free()
    return None if free is None else int(HOST_SHARE * free)


def check_host_memory(nbytes: int) -> None:
    """A clear error, before any pinning, where the offloaded values would not fit host memory."""
    room = pinnable()
    if room is not None and nbytes > room:
        raise LoracError(
            f"activation offload needs {nbytes / 1e9:.1f} GB of pinned host memory for the recomputed layers' "
            f"values, and this machine allows {room / 1e9:.1f} GB ({HOST_SHARE:.0%} of its available memory): keep "
            f"more layers on the GPU (a larger --memory-budget or --keep-layers), --offload-state off, or a shorter "
            f"--seq or --batch")


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _copy(dst: int, src: int, nbytes: int, kind: int, stream) -> None:
    _check(_rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def _offloader(slot: int):
    def offload(*args) -> None:
        s, order = _state, _state["order"]
        places = s[slot]["places"]
        xs = args[:len(places)]  # then the two slots before it (kept alive, unread) and the token
        pos, nbytes = order.index(slot), s[slot]["bytes"]
        main, side, k = _get_stream(2, xs[0].device.index), s["side"], pos % 2
        if pos >= 2:  # the D2H of two slots ago must be done: its values' storage (a direct slot's,
            # let go by this call) or its staging buffer (k) is reused after this call
            _check(_rt.cudaStreamWaitEvent(main, s["out_done"][k], 0), "cudaStreamWaitEvent")
        if s["direct"] and pos < len(order) - DIRECT_BEFORE_TOP:  # straight from the values to the host
            _check(_rt.cudaEventRecord(s["out_ready"][k], main), "cudaEventRecord")
            _check(_rt.cudaStreamWaitEvent(side, s["out_ready"][k], 0), "cudaStreamWaitEvent")
            for x, (at, n) in zip(xs, places):
                _copy(s[slot]["host"] + at, x.data_ptr(), n, _D2H, side)
            _check(_rt.cudaEventRecord(s["out_done"][k], side), "cudaEventRecord")
            return
        for x, (at, n) in zip(xs, places):
            _copy(s["staging"][k] + at, x.data_ptr(), n, _D2D, main)
        if pos == len(order) - 1:  # the top slot: its values wait in staging for the backward
            return
        _check(_rt.cudaEventRecord(s["out_ready"][k], main), "cudaEventRecord")
        _check(_rt.cudaStreamWaitEvent(side, s["out_ready"][k], 0), "cudaStreamWaitEvent")
        _copy(s[slot]["host"], s["staging"][k], nbytes, _D2H, side)
        _check(_rt.cudaEventRecord(s["out_done"][k], side), "cudaEventRecord")
    return offload


def _start_fetch(slot: int, k: int, main) -> None:
    """Host -> staging `k` for `slot` on the side stream, after staging k's last reader."""
    s = _state
    _check(_rt.cudaEventRecord(s["back_done"][k], main), "cudaEventRecord")
    _check(_rt.cudaStreamWaitEvent(s["side"], s["back_done"][k], 0), "cudaStreamWaitEvent")
    _copy(s["staging"][k], s[slot]["host"], s[slot]["bytes"], _H2D, s["side"])
    _check(_rt.cudaEventRecord(s["back_ready"][k], s["side"]), "cudaEventRecord")


def _fetch_ahead(slot: int, args: tuple) -> None:
    """A fetch call of an artifact that fetches one call ahead (compiler/units/offload.py): `args`
    are this slot's tensors, filled by the copy the call before issued (none for the top slot,
    whose values wait in staging), its own outputs (the top and the lowest slot only), then the
    next slot's tensors, which the host's copy fills straight from its pinned buffer on the side
    stream while this slot is recomputed."""
    s, order = _state, _state["order"]
    i = order.index(slot)
    top, n = i == len(order) - 1, len(s[slot]["places"])
    held = () if top else args[:n]
    args = args[len(held):]
    own = args[:n] if top or i == 0 else ()
    dests = args[len(own):]
    main = _get_stream(2, args[0].device.index)
    if held:  # its copy from the host, issued one call ago, must be done
        _check(_rt.cudaStreamWaitEvent(main, s["back_ready"][i % 2], 0), "cudaStreamWaitEvent")
    for out, x, (at, nbytes) in zip(own, held or [None] * n, s[slot]["places"]):
        src = x.data_ptr() if x is not None else s["staging"][i % 2] + at
        _copy(out.data_ptr(), src, nbytes, _D2D, main)
    if i > 0:  # the next slot straight into its tensors, after every earlier use of their memory
        k, nxt = (i - 1) % 2, order[i - 1]
        _check(_rt.cudaEventRecord(s["back_done"][k], main), "cudaEventRecord")
        _check(_rt.cudaStreamWaitEvent(s["side"], s["back_done"][k], 0), "cudaStreamWaitEvent")
        for out, (at, nbytes) in zip(dests, s[nxt]["places"]):
            _copy(out.data_ptr(), s[nxt]["host"] + at, nbytes, _H2D, s["side"])
        _check(_rt.cudaEventRecord(s["back_ready"][k], s["side"]), "cudaEventRecord")


def _fetcher(slot: int):
    def fetch(token, *outs) -> None:
        if _state["ahead"]:
            return _fetch_ahead(slot, outs)
        s, order = _state, _state["order"]
        i = order.index(slot)  # the backward fetches from the top slot (i = n - 1) down
        main = _get_stream(2, outs[0].device.index)
        if i > 0:  # the next slot's copy back runs while this one is recomputed
            _start_fetch(order[i - 1], (i - 1) % 2, main)
        k = i % 2
        if i < len(order) - 1:  # the top slot's values never left its buffer
            _check(_rt.cudaStreamWaitEvent(main, s["back_ready"][k], 0), "cudaStreamWaitEvent")
        for out, (at, n) in zip(outs, s[slot]["places"]):
            _copy(out.data_ptr(), s["staging"][k] + at, n, _D2D, main)
    return fetch
