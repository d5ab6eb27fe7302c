"""Timers, peak-memory probes and the copy-bandwidth yardstick, per device type.

Time, one rule for every implementation of a row (ours and the baselines alike):

* eager wall time per call, every device: what a user's loop pays, host overhead included.
  The call is warmed up (``WARMUP_CALLS`` calls, and at least ``WARMUP_S``), then timed in
  blocks of calls (a block lasts about ``BLOCK_S``; on CUDA each block ends with a
  synchronisation, so the device work is paid too), at least ``MIN_SAMPLES`` blocks and
  ``min_run_time`` seconds; the median and quartiles are over the blocks.
* device time, CUDA only: the call captured once in a CUDA graph and replayed, one replay per
  sample between CUDA events, with L2 flushed before each replay (a write of
  ``L2_FLUSH_BYTES``, outside the events), so that neither the host's launch overhead nor inputs
  left in L2 by the previous call count; at least ``MIN_SAMPLES`` replays.  A call that cannot be
  captured (it syncs with the host) has no device time, said in the row, never another timer.

A timing of fewer than ``MIN_SAMPLES`` samples is refused (``TimingError``): it has no spread
and one cold call can make it (a first call's allocations, lazy imports).

CPU memory: peak extra memory is the rise of the process's peak resident set (``VmHWM``) over its
resident set just before the call, with the peak reset through ``/proc/self/clear_refs``
and freed heap memory handed back to the OS first (``malloc_trim``), so every byte the
call touches must come in as new resident pages.  torch's CPU allocator does not cache,
so this counts the call's own tensors (inputs excluded, outputs and temporaries included).
CUDA memory: ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CPU_MEMORY_METHOD = (
    "peak RSS rise over the call (VmHWM reset via /proc/self/clear_refs, malloc_trim before, glibc's mmap "
    "threshold fixed at 128 KiB; torch's CPU allocator does not cache), inputs excluded"
)
CUDA_MEMORY_METHOD = "torch.cuda.max_memory_allocated minus memory_allocated before the call, inputs excluded"

MIN_SAMPLES = 10  # fewer: no spread, refused
WARMUP_CALLS = 3
WARMUP_S = 0.02
BLOCK_S = 2e-3  # a block of calls lasts about this long (clock resolution and per-block cost vanish)
L2_FLUSH_BYTES = 256 << 20  # over every current GPU's L2 (H100 50 MB, H200 60 MB, B200 126 MB)
EAGER_TIMER = "eager wall time per call: warmed, blocks of calls (synchronised on CUDA), median and IQR over blocks"
DEVICE_TIMER = "device time: CUDA graph replay between CUDA events, L2 flushed before each replay"


class TimingError(RuntimeError):
    """A timing that cannot be reported honestly (too few samples)."""


@dataclass
class Timing:
    median_ms: float
    q25_ms: float
    q75_ms: float
    runs: int  # calls timed
    samples: int  # blocks (eager) or replays (device): the spread is over these
    timer: str

    def __post_init__(self):
        if self.samples < MIN_SAMPLES:
            raise TimingError(f"{self.samples} samples (at least {MIN_SAMPLES} are needed for a spread)")


def _quartiles(samples_ms: list[float]) -> tuple[float, float, float]:
    if len(samples_ms) < 2:
        return (samples_ms[0],) * 3 if samples_ms else (math.nan,) * 3
    q25, median, q75 = statistics.quantiles(samples_ms, n=4, method="inclusive")
    return median, q25, q75


def _warm_per_call_s(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Warm ``fn`` up and return its warm time per call (the fastest warm-up call)."""
    best, spent, calls = math.inf, 0.0, 0
    while calls < WARMUP_CALLS or spent < WARMUP_S:
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def time_eager(
    fn: Callable[[], object], min_run_time: float, device_type: str = "cpu", min_samples: int = MIN_SAMPLES
) -> Timing:
    """Eager wall time per call (see the module's docstring): warmed, at least ``min_samples``
    blocks and ``min_run_time`` seconds."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    per_call = _warm_per_call_s(fn, sync)
    number = max(1, int(BLOCK_S / max(per_call, 1e-9)))
    blocks: list[float] = []
    start_all = time.perf_counter()
    while len(blocks) < min_samples or time.perf_counter() - start_all < min_run_time:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        blocks.append((time.perf_counter() - start) / number * 1e3)
    median, q25, q75 = _quartiles(blocks)
    return Timing(median, q25, q75, len(blocks) * number, len(blocks), EAGER_TIMER)


def time_cpu(fn: Callable[[], object], min_run_time: float, min_runs: int = MIN_SAMPLES) -> Timing:
    """Eager wall time per call on CPU (``time_eager``), at least ``min_runs`` samples."""
    return time_eager(fn, min_run_time, "cpu", max(min_runs, MIN_SAMPLES))


def time_device(fn: Callable[[], object], rep_ms: int, min_samples: int = MIN_SAMPLES) -> tuple[Timing | None, str]:
    """Device time per call (see the module's docstring), or None and why not (not capturable)."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_CALLS):  # warm-up on a side stream, as capture requires
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # a call that syncs with the host cannot be captured
        torch.cuda.synchronize()
        return None, f"no device time: CUDA graph capture failed ({type(err).__name__})"
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    graph.replay()
    torch.cuda.synchronize()
    events = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(events) < min_samples or time.perf_counter() < deadline:
        flush.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        events.append((begin, end))
        if len(events) % 50 == 0:
            torch.cuda.synchronize()  # the deadline counts device time, not only enqueueing
    torch.cuda.synchronize()
    samples = [begin.elapsed_time(end) for begin, end in events]
    del graph, flush
    median, q25, q75 = _quartiles(samples)
    return Timing(median, q25, q75, len(samples), len(samples), DEVICE_TIMER), ""


def time_cuda(fn: Callable[[], object], use_graph: bool, rep_ms: int) -> tuple[Timing, None]:
    """Device time (``use_graph``; ``TimingError`` where the call cannot be captured) or eager wall time."""
    if not use_graph:
        return time_eager(fn, rep_ms / 1e3, "cuda"), None
    timing, why = time_device(fn, rep_ms)
    if timing is None:
        raise TimingError(why)
    return timing, None


# --------------------------------------------------------------------------- memory

MMAP_THRESHOLD = 128 * 1024  # glibc's initial one, kept (fix_mmap_threshold)


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


_LIBC = _libc()


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def cpu_memory_supported() -> tuple[bool, str]:
    """Whether this process can reset and read its peak resident set (Linux with glibc)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        _proc_status_kib("VmHWM:")
    except OSError as err:
        return False, f"peak RSS cannot be reset here ({err})"
    if _LIBC is None or not hasattr(_LIBC, "malloc_trim"):
        return False, "no glibc malloc_trim: freed heap memory would hide new allocations"
    return True, ""


def memory_method(device_type: str) -> str:
    """How ``peak_extra_bytes`` measures on ``device_type``."""
    return CUDA_MEMORY_METHOD if device_type == "cuda" else CPU_MEMORY_METHOD


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Keep glibc's mmap threshold at ``nbytes``: by default glibc raises it (up to 32 MiB) after
    an mmapped block is freed, and then tensors of up to that size come from the heap, whose freed
    memory stays resident below a live small block: the peak RSS then counts memory no tensor
    holds (seen with PEFT's many small LoRA tensors).  Call before allocating; False where it
    cannot be set."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    M_MMAP_THRESHOLD = -3
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, nbytes))


def peak_extra_bytes(fn: Callable[[], object], device_type: str) -> int:
    """Bytes the call needs on top of what is allocated before it (temporaries and outputs)."""
    gc.collect()
    if device_type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
        return peak
    fix_mmap_threshold()  # else the peak counts freed heap memory (see there); idempotent
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak resident set restarts from the current one
    before = _proc_status_kib("VmRSS:")
    result = fn()
    peak = _proc_status_kib("VmHWM:") - before
    del result
    return max(peak, 0) * 1024


# --------------------------------------------------------------------------- bandwidth


def cuda_copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second, GB/s): the roof for memory-bound ops."""
    from triton.testing import do_bench

    buffers = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()]
    buffers.append(torch.empty_like(buffers[0]))
    ms = do_bench(lambda: buffers[1].copy_(buffers[0]), warmup=25, rep=200, return_mode="median")
    buffers.clear()  # the 2 GiB go back before the next measurement
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9
