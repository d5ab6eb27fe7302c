"""Timers, peak-memory probes and the copy-bandwidth yardstick, per device type.

CPU: ``torch.utils.benchmark`` (blocked autorange, all intra-op threads) for time;
peak extra memory is the rise of the process's peak resident set (``VmHWM``) over its
resident set just before the call, with the peak reset through ``/proc/self/clear_refs``
and freed heap memory handed back to the OS first (``malloc_trim``), so every byte the
call touches must come in as new resident pages.  torch's CPU allocator does not cache,
so this counts the call's own tensors (inputs excluded, outputs and temporaries included).

CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs) or, for calls
under a millisecond (forward and backward alike), ``do_bench_cudagraph`` (launch overhead removed);
peak extra memory is ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CPU_MEMORY_METHOD = (
    "peak RSS rise over the call (VmHWM reset via /proc/self/clear_refs, malloc_trim before, glibc's mmap "
    "threshold fixed at 128 KiB; torch's CPU allocator does not cache), inputs excluded"
)
CUDA_MEMORY_METHOD = "torch.cuda.max_memory_allocated minus memory_allocated before the call, inputs excluded"


@dataclass
class Timing:
    median_ms: float
    q25_ms: float
    q75_ms: float
    runs: int
    timer: str


def time_cpu(fn: Callable[[], object], min_run_time: float, min_runs: int = 3) -> Timing:
    """Blocked autorange over at least ``min_run_time`` seconds and ``min_runs`` calls (so slow calls get a spread)."""
    from torch.utils import benchmark

    start = time.perf_counter()
    fn()
    one_call = time.perf_counter() - start
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=max(min_run_time, min_runs * one_call))
    times = torch.tensor(measurement.times, dtype=torch.float64) * 1e3
    q25, median, q75 = torch.quantile(times, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return Timing(median, q25, q75, len(measurement.times) * measurement.number_per_run, "torch.utils.benchmark")


def time_cuda(fn: Callable[[], object], use_graph: bool, rep_ms: int) -> tuple[Timing, str | None]:
    """Median and quartiles in ms; with ``use_graph`` a CUDA graph replay, else plain launches.

    Returns a note when a graph was asked for but the call cannot be captured (it syncs
    with the host, say): the plain timing is then reported and labelled as such.
    """
    from triton.testing import do_bench, do_bench_cudagraph

    quantiles = [0.5, 0.25, 0.75]
    note = None
    if use_graph:
        try:
            median, q25, q75 = do_bench_cudagraph(fn, rep=rep_ms, quantiles=quantiles)
            return Timing(median, q25, q75, 0, "do_bench_cudagraph"), None
        except Exception as err:  # not capturable: time it without a graph, and say so
            torch.cuda.synchronize()
            note = f"CUDA graph capture failed ({type(err).__name__}); timed without a graph"
    median, q25, q75 = do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, quantiles=quantiles)
    return Timing(median, q25, q75, 0, "do_bench"), note


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
