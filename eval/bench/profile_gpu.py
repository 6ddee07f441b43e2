"""Host vs device time of single requests (``blendkv bench gpu --profile DIR``).

For each request given (blend, reuse, full prefill of the same tokens) it runs the request once
to warm up, then once under ``torch.profiler`` (CPU and, on CUDA, the device) and once under
cProfile, and writes one text report per shape: the wall time, the device's kernel time, the
number of kernel launches and host syncs, the ops by self host time, and the Python functions
by cumulative time. On a GPU a request whose wall time is far above its kernel time is
host-bound: the report says where that host time goes.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch

# Runtime calls that make the host wait for the device (or copy device -> host).
_SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _summary(prof, wall_s: float) -> dict:
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # kernels and copies only (an aten op's own device time would count its kernel twice)
    device_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type == DeviceType.CUDA and not e.key.startswith("aten::")
    )
    launches = sum(e.count for e in events if e.key in _LAUNCH_NAMES)
    syncs = sum(e.count for e in events if e.key in _SYNC_NAMES)
    copies = sum(e.count for e in events if e.key.startswith("cudaMemcpy"))
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    return {
        "wall_ms": round(wall_s * 1e3, 2),
        "device_kernel_ms": round(device_us / 1e3, 2),
        "kernel_launches": launches,
        "host_syncs": syncs,
        "memcpy_calls": copies,
        "aten_ops": aten,
    }


def _profiled(run: Callable[[], object]):
    """(profiler, wall seconds) of one run of ``run`` under ``torch.profiler`` (CPU, and the
    device on CUDA), the device idle before it and waited for after it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


def profile_once(run: Callable[[], object]) -> dict:
    """One warm run of ``run`` (a whole request) under ``torch.profiler``: its summary (wall,
    kernel time, launches, syncs) and ``host_busy_ms``, the wall time less the host's waits in
    syncs and blocking copies (the host's own time issuing the request, profiler overhead
    included)."""
    prof, wall = _profiled(run)
    summary = _summary(prof, wall)
    waits = ("cudaMemcpy",) + _SYNC_NAMES  # cudaMemcpy (not Async) blocks the host
    waited_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in waits)
    summary["host_busy_ms"] = round(max(0.0, wall * 1e3 - waited_us / 1e3), 2)
    return summary


def profile_requests(runs: dict[str, Callable[[], object]], path: str, title: str) -> dict:
    """Profile each ``runs[name]()`` (a whole request) and write the report to ``path``.
    Returns {name: summary}."""
    cuda = torch.cuda.is_available()
    summaries, parts = {}, [f"# {title}\n"]
    for name, run in runs.items():
        run()  # warm-up
        prof, wall = _profiled(run)
        summary = _summary(prof, wall)
        summaries[name] = summary
        sort = "self_cpu_time_total"
        parts.append(f"\n## {name}: {summary}\n")
        parts.append(
            prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=60)
        )
        if cuda:
            parts.append(f"\n### {name}: device kernels\n")
            parts.append(
                prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=25, max_name_column_width=60
                )
            )
        pr = cProfile.Profile()
        pr.enable()
        run()
        if cuda:
            torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(70)
        parts.append(f"\n### {name}: cProfile (cumulative)\n{buf.getvalue()}")
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
        parts.append(f"\n### {name}: cProfile (own time)\n{buf.getvalue()}")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return summaries
