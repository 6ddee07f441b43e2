"""How ``CudaGraphCapture`` drives torch's capture API, without a GPU: ``torch.cuda.graph``,
``CUDAGraph`` and the pool handle replaced by recorders (the real capture runs in
``tests/gpu``). Checked: one graph per segment, replayed in order after ``before(k)``; and
however a capture ends, the stream current before it is current again."""

from __future__ import annotations

import pytest
import torch

from blendkv.engine import cuda_graphs


class FakeStreamContext:
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("stream in")

    def __exit__(self, *exc):
        self.log.append("stream out")


class FakeGraphContext:
    """``torch.cuda.graph``'s shape: enters its capture stream, begins; ends, leaves the
    stream, unless ending raises (then the stream stays, as torch's does)."""

    fail_end = False

    def __init__(self, graph, pool=None, capture_error_mode="global"):
        self.graph = graph
        self.stream_ctx = FakeStreamContext(graph.log)

    def __enter__(self):
        self.stream_ctx.__enter__()
        self.graph.log.append(f"begin {self.graph.index}")

    def __exit__(self, *exc):
        if FakeGraphContext.fail_end:
            raise RuntimeError("operation failed due to a previous error during capture")
        self.graph.log.append(f"end {self.graph.index}")
        self.stream_ctx.__exit__(*exc)


@pytest.fixture
def log(monkeypatch):
    log = []

    class FakeGraph:
        def __init__(self):
            self.log, self.index = log, sum(e.startswith("begin") for e in log)

        def replay(self):
            log.append(f"replay {self.index}")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeGraphContext)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(FakeGraphContext, "fail_end", False)
    return log


def test_segments_replay_in_order_after_before(log):
    def fn(cut):
        log.append("layer 0")
        cut()
        log.append("layer 1")
        cut()
        log.append("layer 2")

    replay = cuda_graphs.CudaGraphCapture().segments(fn)
    assert log.count("stream in") == log.count("stream out") == 3  # every capture left
    log.clear()
    replay(lambda k: log.append(f"before {k}"))
    assert log == ["before 0", "replay 0", "before 1", "replay 1", "before 2", "replay 2"]


def test_a_failed_capture_leaves_the_capture_stream(log):
    """An op that breaks the capture raises, and so does ending it: the original error is
    the one reported, and the capture stream is left (else every later op, the eager
    fallback's, would run on it, unordered with the default stream)."""

    def broken(cut):
        log.append("layer 0")
        if "begin 0" in log:  # inside the capture, not the warm-up
            FakeGraphContext.fail_end = True
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        cuda_graphs.CudaGraphCapture().segments(broken)
    assert log.count("stream in") == log.count("stream out") == 1


def test_a_capture_that_fails_to_end_raises_and_leaves_the_stream(log):
    FakeGraphContext.fail_end = True
    with pytest.raises(RuntimeError, match="previous error during capture"):
        cuda_graphs.CudaGraphCapture()(lambda: torch.zeros(1))
    assert log.count("stream in") == log.count("stream out") == 1
