"""Fake CUDA tensors on a CPU-only torch build, for device-placement tests without a GPU.

``FakeTensorMode`` creates CUDA tensors without a GPU (metadata only) and raises
``FakeTensorDeviceMismatchError`` whenever an op mixes CPU and CUDA tensors: exactly the bug a
GPU run would hit first. Its one gap on a CPU-only build: the Python bindings of
``Tensor.__getitem__``/``__setitem__`` and ``Tensor.to``/``copy_`` take a CUDA device guard before
dispatching, which such a build does not have ("PyTorch is not linked with support for cuda
devices"). :class:`_IndexingAsAtenOps` routes those through the aten ops they lower to
(``slice``/``select``/``unsqueeze``/``index``/``index_put_``/``_to_copy``), which FakeTensorMode
handles; every other op runs as is.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def _basic(x: torch.Tensor, idx) -> tuple[torch.Tensor, list]:
    """Apply ints/slices/None/Ellipsis; return the view and the per-dim tensor indices."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    consumed = sum(0 if i is None or i is Ellipsis else _dims_of(i) for i in idx)
    out: list = []
    for i in idx:
        if i is Ellipsis:
            out.extend([slice(None)] * (x.dim() - consumed))
        else:
            out.append(i)
    dim = 0
    tensors: list = []
    for i in out:
        if i is None:
            x = aten.unsqueeze(x, dim)
            tensors.append(None)
            dim += 1
        elif isinstance(i, bool):
            raise NotImplementedError("bool scalar index")
        elif isinstance(i, int):
            x = aten.select.int(x, dim, i)
        elif isinstance(i, slice):
            if i != slice(None):
                x = aten.slice.Tensor(x, dim, i.start, i.stop, i.step or 1)
            tensors.append(None)
            dim += 1
        else:
            t = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=x.device)
            tensors.append(t)
            dim += t.dim() if t.dtype == torch.bool else 1
    return x, tensors


def _dims_of(i) -> int:
    if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
        return i.dim()
    return 1


def _getitem(x, idx):
    view, tensors = _basic(x, idx)
    if all(t is None for t in tensors):
        return view
    return aten.index.Tensor(view, tensors)


def _setitem(x, idx, value):
    view, tensors = _basic(x, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=x.dtype, device=x.device)
    if all(t is None for t in tensors):
        aten.copy_(view, value)
    else:
        aten.index_put_(view, tensors, value.to(x.dtype))


def _to(x, *args, **kwargs):
    device, dtype, non_blocking = None, kwargs.get("dtype"), kwargs.get("non_blocking", False)
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, bool):
            non_blocking = a
    device = torch.device(device) if device is not None else x.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype = dtype or x.dtype
    if device == x.device and dtype == x.dtype:
        return x
    return aten._to_copy(x, dtype=dtype, device=device, non_blocking=non_blocking)


class _IndexingAsAtenOps(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return _getitem(*args)
        if func is torch.Tensor.__setitem__:
            return _setitem(*args)
        if func is torch.Tensor.to:
            return _to(*args, **kwargs)
        if func is torch.tensor and kwargs.get("device") is not None:
            device = kwargs.pop("device")
            return _to(torch.tensor(*args, **kwargs), device)
        if func is torch.Tensor.copy_:
            return aten.copy_(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return _to(args[0], "cuda")
        if func is torch.Tensor.cpu:
            return _to(args[0], "cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode in which ``device="cuda"`` works on this CPU-only build."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), _IndexingAsAtenOps():
        yield
