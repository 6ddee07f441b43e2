"""Writing a step's loaded chunk K/V into the KV pool, layer by layer, behind the forward.

The loader (:mod:`blendkv.blend.loader`) finds every chunk's K/V (store, memory tier, writer,
or computed now) before the forward; what remains, rotating K to the fused positions and
writing K/V into the request's blocks, is done here, one layer at a time:

- **pipelined** on the CPU: a background thread writes layer ``l`` of every chunk and then
  marks layer ``l`` ready; the forward waits for a layer (``wait(l)``) only when it gets there,
  so the writes of later layers run while earlier layers compute;
- **pipelined** on CUDA: the same writes (and host-to-device copies of pinned sources) are
  queued on a side stream in stages of 1, 2, 4, ... layers (:func:`load_stages`), one event per
  stage; ``wait(l)`` makes the compute stream wait for its stage's event (no host block);
- **serial** (``pipelined=False``): everything is written before the forward, one backend call
  per chunk covering all its layers.

``pipelined=None`` (``EngineConfig.pipeline_kv_load``'s default) picks: pipelined on CUDA, and
on the CPU only when the forward's threads leave a core free (:func:`spare_cpu_core`): with
every core computing, the loading thread only takes time from them (measured 1-3 % slower on
2 cores, ``eval_results/bench/amd/rope_write_ab.log``).

The written bits are the same in every mode (RoPE is elementwise; a test checks the blocks and
the logits). Timing: ``busy`` is the seconds the writes took, ``waited`` the seconds the forward
blocked in :meth:`wait`; the difference was hidden behind compute. On CUDA both are device time
(CUDA events: the side stream's span, the compute stream's stalls on each stage).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch


def spare_cpu_core() -> bool:
    """Whether this process may run on more cores than torch's intra-op threads use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


def resolve_pipelined(setting: bool | None, device: torch.device, backend) -> bool:
    """Whether a step's writes run behind the forward: ``setting``
    (``EngineConfig.pipeline_kv_load``; None picks: CUDA, or a spare CPU core), and on the CPU
    only with a backend that allows a second thread."""
    if device.type == "cuda":
        return setting is not False
    if setting is None:
        setting = spare_cpu_core()
    return setting and backend.thread_safe


def load_stages(num_layers: int) -> list[tuple[int, int]]:
    """Layer ranges loaded together on CUDA: 1, 2, 4, 8, ... layers. Each stage's copy is about
    as long as the compute of all the layers before it, so loading stays ahead of the forward,
    while a request costs ~log2(layers) launches per chunk, not one per layer (a GPU measured
    the per-layer launches' host time at several times the copies they hid)."""
    stages, lo, size = [], 0, 1
    while lo < num_layers:
        stages.append((lo, min(lo + size, num_layers)))
        lo, size = lo + size, 2 * size
    return stages


def _timing_event(stream):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


@dataclass
class ChunkWrite:
    """One chunk's K/V to write: ``kv`` [L', 2, T, kv_heads, head_dim] holds layers
    ``first_layer ..`` (K before RoPE), on the device or (CUDA) in host memory."""

    kv: torch.Tensor
    first_layer: int
    positions: torch.Tensor  # [T] int64 on the device
    slots: torch.Tensor  # [T] int64 on the device
    owner: object = None  # (the request's stats, the tier it came from), for accounting
    fetch_seconds: float = 0.0  # time spent finding it (store read) before the forward
    seconds: float = 0.0  # time spent writing it (CPU modes)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class LayerwiseLoad:
    def __init__(
        self,
        backend,
        kv_caches: list[torch.Tensor],
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        writes: list[ChunkWrite],
        pipelined: bool | None,
        stream=None,
    ) -> None:
        """``stream``: the side CUDA stream to load on; pass the same one every step (the caching
        allocator keeps memory per stream: on a new stream each step, the copies' device
        buffers would be allocated afresh every time)."""
        self.backend = backend
        self.kv_caches = kv_caches
        self.cos, self.sin = rotary_tables
        self.writes = writes
        self.device = kv_caches[0].device
        self.pipelined = resolve_pipelined(pipelined, self.device, backend) and bool(writes)
        self.num_layers = len(kv_caches)
        self.busy = 0.0
        self.waited = 0.0
        self._ready = [threading.Event() for _ in range(self.num_layers)]
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._side_stream = stream
        self._stream = None
        self._events: list = []
        # CUDA timing (device time, read in finish()): the writes' span, and each stall of the
        # compute stream on a stage's event.
        self._span: tuple | None = None
        self._stalls: list[tuple] = []
        self._last_waited = None

    # ---- the three modes ----------------------------------------------------------------
    def start(self) -> None:
        if not self.pipelined and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            first = _timing_event(stream)
            for w in self.writes:
                self._write(w, w.first_layer, len(w.kv))
            self._span = (first, _timing_event(stream))
            return
        if not self.pipelined:
            t0 = time.perf_counter()
            for w in self.writes:
                t = time.perf_counter()
                self._write(w, w.first_layer, len(w.kv))
                w.seconds += time.perf_counter() - t
            self.busy = time.perf_counter() - t0
            return
        if self.device.type == "cuda":
            self._start_cuda()
            return
        self._thread = threading.Thread(target=self._run_thread, name="blendkv-kv-load")
        self._thread.start()

    def _run_thread(self) -> None:
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                for layer in range(self.num_layers):
                    for w in self.writes:
                        if layer >= w.first_layer:
                            t = time.perf_counter()
                            self._write(w, layer, 1)
                            w.seconds += time.perf_counter() - t
                    self._ready[layer].set()
        except BaseException as exc:  # re-raised in the forward's thread by wait()
            self._error = exc
            for event in self._ready:
                event.set()
        finally:
            self.busy = time.perf_counter() - t0

    def _start_cuda(self) -> None:
        self._stream = self._side_stream or torch.cuda.Stream(device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            start = _timing_event(self._stream)
            for lo, hi in load_stages(self.num_layers):
                for w in self.writes:
                    first = max(lo, w.first_layer)
                    if first < hi:
                        self._write(w, first, hi - first)
                event = _timing_event(self._stream)
                self._events.extend([event] * (hi - lo))
            self._span = (start, event)

    def _write(self, w: ChunkWrite, layer: int, count: int) -> None:
        """Layers ``layer .. layer + count`` of ``w`` into the pool."""
        i = layer - w.first_layer
        kv = w.kv[i : i + count]
        if kv.device != self.device:  # pinned host source (CUDA): copy on this stream
            kv = kv.to(self.device, non_blocking=True)
        self.backend.load_rotated_kv(
            self.kv_caches, layer, kv, w.positions, w.slots, self.cos, self.sin
        )

    # ---- the forward's side -------------------------------------------------------------
    def wait(self, layer: int) -> None:
        """Block until ``layer``'s K/V is in the pool (CUDA: order the compute stream)."""
        if not self.pipelined:
            return
        if self._stream is not None:
            event = self._events[layer]
            if event is not self._last_waited:  # a stage's first layer: time the stall
                stream = torch.cuda.current_stream(self.device)
                before = _timing_event(stream)
                stream.wait_event(event)
                self._stalls.append((before, _timing_event(stream)))
                self._last_waited = event
            return
        event = self._ready[layer]
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.waited += time.perf_counter() - t0
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """After the forward: every write is done (and its sources may be freed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                raise self._error
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            for w in self.writes:  # used on the side stream: not to be reused before it ran
                for t in (w.kv, w.positions, w.slots):
                    if t.device == self.device:
                        t.record_stream(self._stream)
            self._stream = None
        if self._span is not None:
            self._device_times()

    def _device_times(self) -> None:
        """CUDA: ``busy`` = device seconds from the first write to the last, ``waited`` = the
        compute stream's stalls on them; each write is given a share of ``busy`` by bytes.
        Waits for those events (the last stall is at the last stage's first layer), not for
        the end of the forward."""
        first, last = self._span
        self._span = None
        last.synchronize()
        self.busy = first.elapsed_time(last) / 1e3
        if self._stalls:
            self._stalls[-1][1].synchronize()
            self.waited = sum(b.elapsed_time(a) for b, a in self._stalls) / 1e3
        total = sum(w.nbytes for w in self.writes) or 1
        for w in self.writes:
            w.seconds += self.busy * w.nbytes / total

    @property
    def hidden(self) -> float:
        """Seconds of writing that overlapped compute."""
        return max(0.0, self.busy - self.waited) if self.pipelined else 0.0
