"""Writing a step's loaded chunk K/V into the KV pool, layer by layer, behind the forward.

Rotating K to the fused positions and writing K/V into the request's blocks, in one of:

- **pipelined** on the CPU: a thread writes layer ``l`` of every chunk, then marks it ready;
  the forward's ``wait(l)`` blocks only if it gets there first;
- **pipelined** on CUDA: the writes (and copies of pinned sources) on a side stream in stages of
  1, 2, 4, ... layers (:func:`load_stages`), one event per stage, waited for by the compute
  stream;
- **serial**: everything before the forward, one load-kernel call per chunk.

Deferred reads (``ChunkWrite.fetch``) are fetched by a thread behind the full layer; a chunk
found evicted or corrupt is recomputed (``ChunkWrite.recover``). A chunk from an ``int8`` /
``int4`` store stays encoded (:class:`~blendkv.kernels.kv_dequant.EncodedChunk`) up to the
blend's load kernel, which decodes it as it writes (``BlendKernels.load_encoded_kv``). The
written bits are the same in every mode. ``busy`` / ``waited``: seconds the writes took / the
forward blocked.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blendkv.engine.kv_connector import load_stages
from blendkv.kernels.blend_kernels import BlendKernels
from blendkv.kernels.kv_dequant import EncodedChunk, is_encoded
from blendkv.loading.controller import LoadingController


def spare_cpu_core() -> bool:
    """Whether this process may run on more cores than torch's intra-op threads use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


def resolve_pipelined(setting: bool | None, device: torch.device, backend) -> bool:
    """Whether a step's writes run behind the forward: ``setting``
    (``BlendConnectorConfig.pipeline_kv_load``; None picks: CUDA, or a spare CPU core), and on
    the CPU only with a backend that allows a second thread."""
    if device.type == "cuda":
        return setting is not False
    if setting is None:
        setting = spare_cpu_core()
    return setting and backend.thread_safe


def _timing_event(stream):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


@dataclass
class ChunkWrite:
    """One chunk's K/V to write: ``kv`` [L', 2, T, kv_heads, head_dim] holds layers
    ``first_layer ..`` (K before RoPE), a tensor or an encoded chunk standing for one, on the
    device or (CUDA) in host memory; None until a deferred read (``fetch``) ran."""

    kv: torch.Tensor | EncodedChunk | None
    first_layer: int
    positions: torch.Tensor  # [T] int64 on the device
    slots: torch.Tensor  # [T] int64 on the device
    owner: object = None  # (the request's stats, the tier it came from), for accounting
    fetch_seconds: float = 0.0  # time spent finding it (store read)
    seconds: float = 0.0  # time spent writing it (CPU modes)
    # A deferred read (CPU, LMDB): returns ``kv`` or None (evicted or corrupt since the lookup);
    # then ``recover`` computes it, in the forward's thread.
    fetch: Callable[[], torch.Tensor | EncodedChunk | None] | None = None
    recover: Callable[[], torch.Tensor] | None = None
    # Per layer of ``kv``, its leading tokens not written (a sliding window never reads them:
    # :mod:`blendkv.blend.window_skip`); None: every layer writes all of them.
    layer_skips: list[int] | None = None
    # The device tier's copy of ``kv`` (raw, all layers): each write copies its layers there
    # and loads from it; ``copied_layers`` counts them (the whole chunk: it may be kept).
    device_copy: torch.Tensor | None = None
    copied_layers: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes written into the pool (decoded: what the loading controller's rates are in)."""
        if self.kv is None:
            return 0
        if is_encoded(self.kv):
            shape = self.kv.shape
            total = shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * self.kv.dtype.itemsize
        else:
            total = self.kv.numel() * self.kv.element_size()
        if self.layer_skips is None:
            return total
        layers, tokens = self.kv.shape[0], self.kv.shape[2]
        return total * sum(tokens - k for k in self.layer_skips) // max(1, layers * tokens)

    def skip_at(self, layer: int) -> int:
        """Leading tokens layer ``layer`` (of the model) does not write."""
        return 0 if self.layer_skips is None else self.layer_skips[layer - self.first_layer]


class LayerwiseLoad:
    def __init__(
        self,
        kernels: BlendKernels,
        kv_caches: list[torch.Tensor],
        rotary_tables: tuple[torch.Tensor, torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]],
        writes: list[ChunkWrite],
        pipelined: bool | None,
        stream=None,
    ) -> None:
        """``kernels``: the blend's kernels that write the chunks into the attention backend's
        pool. ``stream``: the side CUDA stream to load on; pass the same one every step (the caching
        allocator keeps memory per stream: on a new stream each step, the copies' device
        buffers would be allocated afresh every time)."""
        self.kernels = kernels
        self.kv_caches = kv_caches
        # (cos, sin) of every layer, or one per layer (Gemma 3's sliding layers have their own).
        if not isinstance(rotary_tables, list):
            rotary_tables = [rotary_tables] * len(kv_caches)
        self.tables = rotary_tables
        self.writes = writes
        self.device = kv_caches[0].device
        self.pipelined = resolve_pipelined(pipelined, self.device, kernels.backend) and bool(writes)
        self.num_layers = len(kv_caches)
        self.busy = 0.0
        self.waited = 0.0
        # Deferred reads: fetched by a thread while the layers before ``_deferred_from`` run.
        self._deferred = [w for w in writes if w.fetch is not None]
        assert not self._deferred or self.device.type == "cpu", "deferred reads are CPU-only"
        self._deferred_from = min((w.first_layer for w in self._deferred), default=0)
        self._settled = not self._deferred
        self._fetched = threading.Event()
        self._fetch_error: BaseException | None = None
        self._reader: threading.Thread | None = None
        self.read_busy = 0.0  # the deferred reads' seconds (in the thread)
        self.read_waited = 0.0  # of which the forward waited for
        self._forward_busy = 0.0  # pipelined: writes the forward's thread did (recovered chunks)
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
            if self._deferred:
                self._reader = threading.Thread(target=self._fetch_all, name="blendkv-kv-read")
                self._reader.start()
            self.busy += self._write_serially([w for w in self.writes if w.fetch is None])
            return
        if self.device.type == "cuda":
            self._start_cuda()
            return
        self._thread = threading.Thread(target=self._run_thread, name="blendkv-kv-load")
        self._thread.start()

    def _write_serially(self, writes: list[ChunkWrite]) -> float:
        """All layers of ``writes``, one load-kernel call each; returns the seconds."""
        t0 = time.perf_counter()
        for w in writes:
            t = time.perf_counter()
            self._write(w, w.first_layer, len(w.kv))
            w.seconds += time.perf_counter() - t
        return time.perf_counter() - t0

    def _fetch_all(self) -> None:
        """The deferred reads (in a thread); a chunk found missing keeps ``kv`` None."""
        t0 = time.perf_counter()
        try:
            for w in self._deferred:
                t = time.perf_counter()
                w.kv = w.fetch()
                w.fetch_seconds += time.perf_counter() - t
        except BaseException as exc:  # re-raised in the forward's thread by wait()
            self._fetch_error = exc
        finally:
            self.read_busy = time.perf_counter() - t0
            self._fetched.set()

    def _run_thread(self) -> None:
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                if self._deferred:
                    self._fetch_all()
                # a chunk the reads found missing is the forward's (wait() recovers it)
                writes = [w for w in self.writes if w.kv is not None]
                for layer in range(self.num_layers):
                    for w in writes:
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
            self.busy = time.perf_counter() - t0 - self.read_busy

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
        if w.device_copy is not None:  # kept for later requests: copy, then load from it
            dst = w.device_copy[i : i + count]
            dst.copy_(kv, non_blocking=True)
            w.copied_layers += count
            kv = dst
        elif kv.device != self.device:  # pinned host source (CUDA): copy on this stream
            kv = kv.to(self.device, non_blocking=True)
        load = self.kernels.load_encoded_kv if is_encoded(kv) else self.kernels.load_rotated_kv
        # one load-kernel call per run of layers sharing their RoPE tables and written tokens
        start = layer
        for end in range(layer + 1, layer + count + 1):
            if (
                end < layer + count
                and self.tables[end][0] is self.tables[start][0]
                and w.skip_at(end) == w.skip_at(start)
            ):
                continue
            cos, sin = self.tables[start]
            part = kv if end - start == count else kv[start - layer : end - layer]
            skip = w.skip_at(start)
            if skip < len(w.positions):
                if skip:
                    part = part[:, :, skip:]
                positions, slots = w.positions[skip:], w.slots[skip:]
                load(self.kv_caches, start, part, positions, slots, cos, sin)
            start = end

    # ---- the forward's side -------------------------------------------------------------
    def wait(self, layer: int) -> None:
        """Block until ``layer``'s K/V is in the pool (CUDA: order the compute stream)."""
        if not self._settled and layer >= self._deferred_from:
            self._settle()
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

    def _settle(self) -> None:
        """The forward reached the first layer of a deferred read: join the reads, compute the
        chunks they found missing, and write what the loading thread will not."""
        self._settled = True
        t0 = time.perf_counter()
        self._fetched.wait()
        self.read_waited = time.perf_counter() - t0
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        if self._fetch_error is not None:
            raise self._fetch_error
        lost = [w for w in self._deferred if w.kv is None]
        for w in lost:
            w.kv = w.recover()
            w.owner = (w.owner[0], "computed")
        if self.pipelined:  # behind the thread's layers: not hidden (added in finish())
            self._forward_busy = self._write_serially(lost)
        else:
            self.busy += self._write_serially(self._deferred)

    def finish(self) -> None:
        """After the forward: every write is done (and its sources may be freed)."""
        if self._reader is not None:  # the forward failed before joining the reads
            self._reader.join()
            self._reader = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.busy += self._forward_busy
            self.waited += self._forward_busy
            if self._error is not None:
                raise self._error
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            for w in self.writes:  # used on the side stream: not to be reused before it ran
                for t in (w.kv, w.positions, w.slots, w.device_copy):
                    if t is not None and t.device == self.device:
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

    @property
    def read_hidden(self) -> float:
        """Seconds of deferred reading that overlapped compute."""
        return max(0.0, self.read_busy - self.read_waited)


def account_writes(load: LayerwiseLoad, controller: LoadingController) -> None:
    """A finished load's cost: each write's read, write and hidden seconds into its request's
    stats (``ChunkWrite.owner``: stats and tier), and the stored tiers' bytes and seconds into
    the loading ``controller`` (its per-tier bandwidth)."""
    hidden_share = load.hidden / load.busy if load.busy > 0 else 0.0
    read_share = load.read_hidden / load.read_busy if load.read_busy > 0 else 0.0
    for w in load.writes:
        stats, tier = w.owner
        # a deferred read's time is in no pre-forward load time (the loader's) yet
        read_hidden = w.fetch_seconds * read_share if w.fetch is not None else 0.0
        stats.load_seconds += w.seconds + (w.fetch_seconds if w.fetch is not None else 0.0)
        stats.read_seconds += w.fetch_seconds
        stats.read_hidden_seconds += read_hidden
        stats.write_seconds += w.seconds
        stats.load_hidden_seconds += w.seconds * hidden_share + read_hidden
        if tier != "computed":
            layerwise = w.seconds if load.pipelined else 0.0
            controller.record_load(
                tier, w.nbytes, w.seconds + w.fetch_seconds, layerwise_seconds=layerwise
            )
