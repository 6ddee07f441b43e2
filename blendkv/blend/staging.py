"""Host staging buffers for chunk K/V on its way from the store to the device.

Two buffers alternate. On CUDA they are pinned, so a copy from one to the device runs
asynchronously (``non_blocking=True``) while the store reads the next chunk into the other; a
buffer is reused only after the copy that read it has finished (a CUDA event per buffer). On the
CPU there is no copy and the buffers are plain memory.
"""

from __future__ import annotations

import torch


class StagingBuffers:
    def __init__(self, dtype: torch.dtype, pinned: bool) -> None:
        self.dtype = dtype
        self.pinned = pinned
        self._buffers = [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)]
        self._events: list = [None, None]
        self._turn = 0

    def next(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of ``shape`` into the next buffer, safe to overwrite."""
        i = self._turn = (self._turn + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the device copy that read this buffer is done
            self._events[i] = None
        numel = 1
        for n in shape:
            numel *= n
        if self._buffers[i].numel() < numel:
            self._buffers[i] = torch.empty(numel, dtype=self.dtype, pin_memory=self.pinned)
        return self._buffers[i][:numel].view(shape)

    def record_use(self, view: torch.Tensor) -> None:
        """A copy reading ``view`` (from the current buffer) was queued on the current stream."""
        assert view.data_ptr() == self._buffers[self._turn].data_ptr()
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event
