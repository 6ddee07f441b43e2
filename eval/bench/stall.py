"""Does one big request starve the others? Streaming clients against ``blendkv serve``.

    blendkv bench stall [--model PATH] [--dtype float32] [--clients 4] [--docs 700]
        [--long-tokens 8191] [--seconds 20] [--max-step-latency S|none] [--json PATH]

A real server (uvicorn on 127.0.0.1, the official ``openai`` client) serves ``--clients``
threads, each streaming short chat answers in a loop. Phases, one after the other, on one
engine: **baseline** (``--seconds`` of streams alone); **documents** (a chat request with
``--docs`` new tiny documents, ``max_tokens`` 1, while the streams run); **long prompt** (an
``--long-tokens`` prompt, ``max_tokens`` 1, while they run); each big request **alone**
(its completion time with no streams); and a **disconnect**: the documents request again,
closed after 2 s, timed until the engine holds no work of it. Reported per phase: the streams'
tokens per second and inter-token gap p50 / p99 / max, the longest time no stream got a token,
and the big request's completion time against its time alone. Correctness first: every stream
answer and every big request must finish without an error.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path

DOC = "box {i} is {color}."  # ~10 tokens with its template: 700 of them fill ~7K of an 8K context
COLORS = ("red", "green", "blue", "white", "black")


def main(args: argparse.Namespace) -> int:
    import openai

    from blendkv import LLM
    from blendkv.entrypoints.openai.api_server import ServeConfig, create_app

    llm = LLM(args.model, dtype=args.dtype, max_step_latency=args.max_step_latency)
    app = create_app(llm, ServeConfig(max_request_documents=max(args.docs, 1)))
    with _serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=3600)
        engine = app.state.blendkv.served.engine
        # every big request new to the engine: no stored chunk, no cached prefix
        docs = {run: _docs(args.docs, run) for run in ("beside", "alone", "disconnect")}
        long = {run: _long_prompt(llm, args.long_tokens, run) for run in ("beside", "alone")}
        rows = {"baseline": _phase(client, args, None)}
        beside = _phase(client, args, lambda: _big(client, "Which box?", docs["beside"]))
        rows["documents"] = beside
        rows["long prompt"] = _phase(client, args, lambda: _big(client, long["beside"]))
        rows["documents"]["alone_s"] = round(_big(client, "Which box?", docs["alone"]), 2)
        rows["long prompt"]["alone_s"] = round(_big(client, long["alone"]), 2)
        rows["disconnect_s"] = _disconnect(client, engine, docs["disconnect"])
    _report(rows, args)
    return 0


@contextmanager
def _serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        assert app.state.blendkv.wait_loaded(600), app.state.blendkv.load_error
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _docs(n: int, run: str) -> list[dict]:
    return [{"text": f"{run} " + DOC.format(i=i, color=COLORS[i % 5])} for i in range(n)]


def _long_prompt(llm, tokens: int, run: str) -> str:
    """A user message of about ``tokens`` tokens (numbered sentences, no two alike)."""
    text, i = [run], 0
    while len(llm.tokenizer.encode(" ".join(text))) < tokens - 64:
        text.append(f"Line {i} of the log reads value {i * 37 % 1000}.")
        i += 1
    return " ".join(text)


def _big(client, text: str, documents=None) -> float:
    """One big request (``max_tokens`` 1); its completion time in seconds."""
    extra = {"documents": documents} if documents is not None else {}
    t0 = time.perf_counter()
    client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": text}],
        max_tokens=1,
        temperature=0,
        extra_body=extra,
    )
    return time.perf_counter() - t0


def _phase(client, args, big) -> dict:
    """The streams for ``--seconds`` (baseline) or while ``big`` runs: their gaps, tokens."""
    stop = threading.Event()
    gaps: list[float] = []
    stamps: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def stream_loop(k: int) -> None:
        try:
            while not stop.is_set():
                last = time.perf_counter()
                stream = client.chat.completions.create(
                    model=None,
                    messages=[{"role": "user", "content": f"Client {k}: count to twenty."}],
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    if not chunk.choices or not chunk.choices[0].delta.content:
                        continue
                    now = time.perf_counter()
                    with lock:
                        gaps.append(now - last)
                        stamps.append(now)
                    last = now
        except BaseException as exc:  # noqa: BLE001  (reported: the phase is invalid)
            errors.append(exc)

    threads = [threading.Thread(target=stream_loop, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the streams are running
    t0 = time.perf_counter()
    big_s = big() if big is not None else None
    if big is None:
        time.sleep(args.seconds)
    wall = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a stream failed: {errors[0]!r}")
    inside = sorted(g for g, s in zip(gaps, stamps, strict=True) if s >= t0)
    moments = sorted(s for s in stamps if s >= t0)
    silence = max((b - a for a, b in zip(moments, moments[1:], strict=False)), default=wall)
    return {
        "seconds": round(wall, 2),
        "tok_s": round(len(inside) / wall, 2),
        "gap_p50_s": round(_quantile(inside, 0.5), 3),
        "gap_p99_s": round(_quantile(inside, 0.99), 3),
        "gap_max_s": round(max(inside, default=0.0), 3),
        "longest_silence_s": round(silence, 3),
        "big_s": None if big_s is None else round(big_s, 2),
    }


def _disconnect(client, engine, docs) -> float:
    """Seconds from closing a documents request's stream to the engine holding none of it."""
    stream = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "Which box is green?"}],
        max_tokens=1,
        stream=True,
        extra_body={"documents": docs},
    )
    time.sleep(2.0)
    t0 = time.perf_counter()
    stream.close()
    while engine.llm.engine.has_unfinished_requests():
        time.sleep(0.01)
    return round(time.perf_counter() - t0, 3)


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (0 for none)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, round(q * 100) - 1)]


def _report(rows: dict, args) -> None:
    base = rows["baseline"]
    print(f"{args.clients} streaming clients; max_step_latency {args.max_step_latency}")
    for name in ("baseline", "documents", "long prompt"):
        r = rows[name]
        ratio = r["tok_s"] / base["tok_s"] if base["tok_s"] else float("nan")
        line = (
            f"  {name:12s} {r['tok_s']:6.2f} tok/s ({ratio:.2f}x baseline)  gap p50 "
            f"{r['gap_p50_s']:.3f} p99 {r['gap_p99_s']:.3f} max {r['gap_max_s']:.3f} s  "
            f"longest silence {r['longest_silence_s']:.3f} s"
        )
        if r.get("alone_s"):
            line += f"  big {r['big_s']:.1f} s vs alone {r['alone_s']:.1f} s"
            line += f" ({r['big_s'] / r['alone_s']:.2f}x)"
        print(line)
    print(f"  disconnect: the engine idle {rows['disconnect_s']:.3f} s after the close")
    print(json.dumps({"stall_bench": rows}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
