"""Replicas on a local Ray cluster: chunk-affinity routing against round-robin and least-loaded,
one run, the same Zipf workload for each.

``blendkv bench replicas [--replicas 2] [--requests 64] [--concurrency 4 | --rate R]
[--rounds N] [--kill-replica]``

1. A private redis-server is the shared store. The workload's corpus (:mod:`blendkv.eval
   .zipf_workload`: one chunk per passage) is ingested on two Ray Data workers
   (:func:`~blendkv.rag.distributed.ingest_on_ray`); their rates are reported.
2. For each router, fresh replicas (cold tiers) serve the same requests (documents sent in the
   request, all of them ingested), streamed: ``--concurrency`` at a time (closed loop) or, with
   ``--rate``, each at its Poisson arrival time (open loop). The client measures time to first
   token; each response's blend stats say which replica served it and where its chunks came
   from: the memory tier, the shared store, or nowhere (a repeated request found whole in the
   engine's prefix cache). Each replica's memory tier holds ``--memory-tier-chunks`` chunks:
   fewer than the corpus, so where a request goes decides whether its chunks load from memory
   or from Redis. Prefetch is off, so a chunk counted "in memory" was in the memory tier.
   ``--rounds N`` runs every router N times in turn; a router's row pools its rounds, and its
   p50 TTFT is given over round-robin's with a paired 95 % bootstrap interval (the same
   requests resampled for both).
3. ``--kill-replica``: a replica is killed while it streams an answer: that stream must end
   with an error event (not hang), requests sent meanwhile must succeed, Ray Serve must replace
   the replica, and the store must verify with every chunk still there.
4. The per-tier costs that ``blendkv bench route-sim`` replays are measured in one engine
   here: the time to first token of the same blended request with its chunks in Redis, then
   in the memory tier, and its decode time (``tiers`` in the JSON).

Correctness first: every request must succeed and compute no chunk (a chunk computed at query
time would mean the routing keys and the stored ones differ). Then the table. Absolute times
drift on a shared machine; the routers run back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from blendkv.eval.zipf_workload import ZipfWorkload

POLICIES = ("round-robin", "least-loaded", "chunk-affinity")


def main(args: argparse.Namespace) -> int:
    import ray

    from blendkv.eval.bench.redis_server import start_redis
    from blendkv.rag.distributed import ingest_on_ray

    workload = ZipfWorkload(
        num_documents=args.documents,
        documents_per_request=args.per_request,
        topic_size=args.topic_size,
        zipf_s=args.zipf_s,
        num_requests=args.requests,
        rate=args.rate,
        seed=args.seed,
    )
    corpus, requests = workload.corpus(), workload.requests()
    engine = {"dtype": args.dtype, "kv_cache_memory_bytes": args.kv_cache_mb << 20}
    out: dict = {"command": "blendkv bench replicas " + " ".join(_argv(args)), **_machine()}
    with tempfile.TemporaryDirectory(prefix="blendkv-bench-replicas-") as tmp:
        redis, url = start_redis(Path(tmp))
        try:
            ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
            folder = Path(tmp) / "corpus"
            folder.mkdir()
            for i, text in enumerate(corpus):
                (folder / f"passage-{i:04d}.md").write_text(text)
            report = ingest_on_ray(
                url, paths=[folder], workers=2, model=args.model, **engine, progress=True
            )
            print(report.summary())
            out["ingest"] = _ingest_row(report, len(corpus))
            chunk_bytes = _chunk_bytes(url)
            memory_bytes = args.memory_tier_chunks * chunk_bytes
            options = {
                **engine,
                "kv_store_memory_bytes": memory_bytes,
                "prefetch_kv": False,
                "num_threads": 1,
            }
            out.update(_serve_routers(args, options, url, corpus, requests))
            out["tiers"] = _tier_costs(args, url, corpus, workload, memory_bytes)
            print("tiers:", json.dumps(out["tiers"]))
        finally:
            if ray.is_initialized():
                ray.shutdown()
            redis.kill()
    out.update(
        workload=vars(workload), memory_tier_chunks=args.memory_tier_chunks, chunk_bytes=chunk_bytes
    )
    _print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    failed = [p for p, r in out["routers"].items() if r["errors"] or r["store_misses"]]
    if failed:
        print(f"FAILED: errors or store misses with {failed}")
        return 1
    return 0


# ------------------------------------------------------------------------- one router
def _run_policy(args, policy, options, url, corpus, requests, kill: bool) -> dict:
    from ray import serve

    from blendkv.entrypoints.ray_serve.app import build_app

    name = f"bench-{policy}" + ("-kill" if kill else "")
    app = build_app(
        args.model,
        replicas=args.replicas,
        policy=policy,
        imbalance=args.imbalance,
        engine_options=options,
        serve_options={"store_dir": url},
    )
    t0 = time.perf_counter()
    serve.run(app, name=name, route_prefix="/")
    started = time.perf_counter() - t0
    try:
        base = f"http://127.0.0.1:{args.port}"
        if kill:
            return {"kill": asyncio.run(_kill_mid_stream(args, base, name, corpus, requests, url))}
        result = asyncio.run(_replay(args, base, corpus, requests))
        result["start_s"] = round(started, 1)
        return result
    finally:
        serve.delete(name)


async def _replay(args, base: str, corpus, requests) -> dict:
    """The requests sent to the running app: closed loop (``--concurrency`` in flight) or, with
    ``--rate``, open loop (each sent at its arrival time, whatever is in flight). One row per
    request, in request order, and the wall time."""
    import httpx

    limit = asyncio.Semaphore(args.concurrency if args.rate is None else len(requests))
    rows: list[dict] = [{} for _ in requests]
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        t0 = time.perf_counter()

        async def one(i, r) -> None:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            async with limit:
                rows[i] = await _stream(client, _body(args, corpus, r))

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        wall = time.perf_counter() - t0
    return {"rows": rows, "wall_s": wall}


def _summary(runs: list[dict], base: list[dict] | None) -> dict:
    """One router's row from its runs (one per round, each ``_replay``'s result), pooled; with
    ``base`` (round-robin's runs), its p50 TTFT over round-robin's with a paired interval."""
    rows = [r for run in runs for r in run["rows"]]
    ok = [r for r in rows if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok)
    chunks = sum(r["num_chunks"] for r in ok)
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    wall = sum(run["wall_s"] for run in runs)
    out = {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "memory_hit_rate": sum(r["in_memory"] for r in ok) / chunks if chunks else 0.0,
        "store_reads": sum(r["hit"] - r["in_memory"] - r["on_device"] for r in ok),
        "prefix_cached": sum(r["prefix_cached"] > 0 for r in ok),
        "store_misses": sum(r["missed"] for r in ok),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "throughput_rps": len(ok) / wall,
        "wall_s": round(wall, 2),
        "rounds": len(runs),
        "per_replica": dict(sorted(per_replica.items())),
        "ttfts": [r.get("ttft") for r in rows],
    }
    if base is not None:
        out["p50_vs_round_robin"] = _paired_p50_ratio(runs, base)
    return out


def _paired_p50_ratio(runs: list[dict], base: list[dict]) -> dict | None:
    """p50 TTFT over round-robin's, with a 95 % bootstrap interval: the same requests (round,
    index) are resampled for both routers, since each round replays the same traffic."""
    import numpy as np

    pairs = [
        (a["ttft"], b["ttft"])
        for run, ref in zip(runs, base, strict=True)
        for a, b in zip(run["rows"], ref["rows"], strict=True)
        if a.get("ok") and b.get("ok")
    ]
    if len(pairs) < 2:
        return None
    x, y = np.array(pairs).T
    idx = np.random.default_rng(0).integers(0, len(x), size=(10_000, len(x)))
    ratios = np.median(x[idx], axis=1) / np.median(y[idx], axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return {
        "ratio": round(float(np.median(x) / np.median(y)), 3),
        "low": round(float(lo), 3),
        "high": round(float(hi), 3),
    }


def _serve_routers(args, options: dict, url: str, corpus, requests) -> dict:
    """Each router policy on Ray Serve in turn, ``--rounds`` times, then (``--kill-replica``)
    chunk affinity with a replica killed mid-stream: ``{"routers": {policy: row}, "kill":
    row}``."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    for _ in range(args.rounds):
        for policy in args.policies:
            run = _run_policy(args, policy, options, url, corpus, requests, kill=False)
            runs[policy].append(run)
            _print_row(policy, _summary([run], None))
    base = runs.get("round-robin")
    out: dict = {
        "routers": {p: _summary(r, base if p != "round-robin" else None) for p, r in runs.items()}
    }
    if args.kill_replica:
        out["kill"] = _run_policy(args, "chunk-affinity", options, url, corpus, requests, kill=True)
        print("kill:", json.dumps(out["kill"]["kill"]))
    serve.shutdown()
    return out


def _body(args, corpus, r, max_tokens: int | None = None) -> dict:
    return {
        "messages": [{"role": "user", "content": r.question}],
        "documents": [{"text": corpus[d]} for d in r.documents],
        "max_tokens": max_tokens or args.max_tokens,
        "temperature": 0,
        "stream": True,
    }


async def _stream(client, body: dict) -> dict:
    """One streamed request: time to its first token, its blend stats, whether it ended well."""
    t0 = time.perf_counter()
    ttft, stats, error, done = None, {}, None, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            replica = resp.headers.get("x-blendkv-replica", "?")
            if resp.status_code != 200:
                await resp.aread()
                return {"ok": False, "error": resp.text[:200], "replica": replica}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                if ttft is None and any(c["delta"].get("content") for c in event["choices"]):
                    ttft = time.perf_counter() - t0
                stats = event.get("blendkv") or stats
    except Exception as exc:  # a hang shows as the client's timeout here
        return {"ok": False, "error": repr(exc), "replica": "?"}
    ok = done and error is None and ttft is not None and bool(stats)
    return {
        "ok": ok,
        "error": error,
        "replica": stats.get("replica", replica),
        "ttft": ttft,
        "seconds": time.perf_counter() - t0,
        "num_chunks": stats.get("num_chunks", 0),
        "hit": stats.get("chunks_hit", 0),
        "in_memory": stats.get("chunks_in_memory", 0),
        "on_device": stats.get("chunks_on_device", 0),
        "missed": stats.get("chunks_missed", 0),
        "prefix_cached": stats.get("prefix_cached_tokens", 0),
    }


# --------------------------------------------------------------------- a replica killed
async def _kill_mid_stream(args, base, app_name, corpus, requests, url) -> dict:
    """Kill the replica serving a long stream; see the module docstring (3.)."""
    import httpx
    import ray
    from ray import serve

    before = _store_check(url)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        body = _body(args, corpus, requests[0], max_tokens=400)
        body["ignore_eos"] = True
        events: list[str] = []
        first = asyncio.Event()
        killed_at = 0.0
        serving: list[str] = []  # the replica the long stream is on

        async def long_stream() -> dict:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                replica = resp.headers["x-blendkv-replica"]
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if not first.is_set():
                            serving.append(replica)
                            first.set()
            return {"ended_s": time.perf_counter() - killed_at}

        task = asyncio.ensure_future(long_stream())
        await asyncio.wait_for(first.wait(), 300)
        victim = serving[0]
        actor = _replica_actor(ray, app_name, victim)
        killed_at = time.perf_counter()
        ray.kill(actor, no_restart=True)
        others = await asyncio.gather(
            *(_stream(client, _body(args, corpus, r)) for r in requests[1:5])
        )
        ended = await asyncio.wait_for(task, 120)  # a hang fails here
    error_event = any('"error"' in e for e in events[-3:]) and events[-1] == "data: [DONE]"
    replaced_s = _wait_replaced(serve, app_name, args.replicas, killed_at)
    after = _store_check(url)
    return {
        "killed": victim,
        "stream_events_before_end": len(events),
        "stream_ended_with_error_event": error_event,
        "stream_ended_s_after_kill": round(ended["ended_s"], 2),
        "others_ok": sum(o["ok"] for o in others),
        "others": len(others),
        "others_replicas": sorted({o["replica"] for o in others}),
        "replaced_s_after_kill": replaced_s,
        "store_chunks_before": before["chunks"],
        "store_chunks_after": after["chunks"],
        "store_verify_ok": after["ok"],
    }


def _replica_actor(ray, app_name: str, replica_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith("SERVE_REPLICA") and app_name in name and name.endswith(replica_id):
            return ray.get_actor(name, namespace=a["namespace"])
    raise RuntimeError(f"no replica actor {replica_id} in {app_name}")


def _wait_replaced(serve, app_name: str, replicas: int, since: float) -> float | None:
    """Seconds from the kill until the deployment runs ``replicas`` healthy replicas again."""
    deadline = time.perf_counter() + 300
    seen_down = False
    while time.perf_counter() < deadline:
        status = serve.status().applications[app_name].deployments["BlendKVReplica"]
        running = status.replica_states.get("RUNNING", 0)
        seen_down = seen_down or running < replicas or status.status != "HEALTHY"
        if seen_down and running == replicas and status.status == "HEALTHY":
            return round(time.perf_counter() - since, 1)
        time.sleep(0.5)
    return None


def _store_check(url: str) -> dict:
    from blendkv.store.backends import open_kv_store, stored_fingerprint

    with open_kv_store(url, stored_fingerprint(url), memory_tier_bytes=0) as kv:
        return {"chunks": len(kv), "ok": kv.verify().ok}


# ------------------------------------------------------------------------ tier costs
def _tier_costs(args, url, corpus, workload: ZipfWorkload, memory_bytes: int) -> dict:
    """One engine over the shared store: the same blended request with its chunks read from
    Redis (memory tier emptied first), then from the memory tier; TTFT medians and the
    decode time per request (what route-sim replays)."""
    from blendkv import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_store_dir=url,
        kv_store_memory_bytes=max(memory_bytes, 1),
        kv_cache_memory_bytes=args.kv_cache_mb << 20,
        prefetch_kv=False,
        num_threads=1,
        enable_prefix_caching=False,
    )
    try:
        tier = llm.blend_manager().store.memory_tier
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        cold, warm, decode = [], [], []
        for r in workload.requests()[: args.tier_samples]:
            prompt = {"documents": [corpus[d] for d in r.documents], "query": r.question}
            tier.clear()
            out = llm.generate([prompt], params)[0]
            assert out.blend_stats.chunks_in_memory == 0, "the cold read hit memory"
            cold.append(out.metrics.ttft)
            out = llm.generate([prompt], params)[0]
            warm.append(out.metrics.ttft)
            decode.append(out.metrics.e2e_latency - out.metrics.ttft)
    finally:
        llm.close()
    n = workload.documents_per_request
    write_s = _store_write_s(url)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "ttft_store_s": round(cold_s, 4),
        "ttft_memory_s": round(warm_s, 4),
        "store_chunk_s": round(max(cold_s - warm_s, 0.0) / n, 4),
        "base_s": round(warm_s, 4),
        "decode_s": round(statistics.median(decode), 4),
        "documents_per_request": n,
        "store_write_s": round(write_s, 4),
    }


def _store_write_s(url: str, samples: int = 8) -> float:
    """Median seconds to put one stored chunk's K/V into Redis (under a scratch namespace,
    removed after): the store-side cost of an ingest write."""
    from blendkv.store import NewChunk
    from blendkv.store.backends import open_kv_store, stored_fingerprint

    fp = stored_fingerprint(url)
    with open_kv_store(url, fp, memory_tier_bytes=0) as kv:
        values = [kv.get(m.key).kv for m in list(kv.iter_meta())[:samples]]
    times = []
    with open_kv_store(url, fp, memory_tier_bytes=0, namespace="blendkv-bench-scratch") as kv:
        for i, value in enumerate(values):
            key = i.to_bytes(16, "big")
            t0 = time.perf_counter()
            kv.put_many([NewChunk(key, value, doc_id="scratch")])
            times.append(time.perf_counter() - t0)
            kv.delete([key])
    return statistics.median(times)


# ----------------------------------------------------------------------------- output
def _chunk_bytes(url: str) -> int:
    """The mean stored chunk's K/V bytes (what the memory tier budget counts)."""
    from blendkv.store.backends import open_kv_store, stored_fingerprint

    with open_kv_store(url, stored_fingerprint(url), memory_tier_bytes=0) as kv:
        keys = [m.key for m in kv.iter_meta()][:8]
        sizes = [kv.get(k).kv.numel() * kv.get(k).kv.element_size() for k in keys]
    return int(statistics.mean(sizes)) + 1


def _ingest_row(report, documents: int) -> dict:
    return {
        "documents": documents,
        "chunks": report.num_chunks,
        "seconds": round(report.seconds, 1),
        "workers": [
            {"worker": w.worker, "chunks": w.chunks, "chunks_per_s": round(w.chunks_per_second, 2)}
            for w in report.workers
        ],
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def _print_row(policy: str, r: dict) -> None:
    print(
        f"{policy:15s} hit {r['memory_hit_rate']:.2f}  p50 {r['ttft_p50_s']}s  p99 "
        f"{r['ttft_p99_s']}s  {r['throughput_rps']:.3f} req/s  per replica {r['per_replica']}  "
        f"errors {r['errors']}  misses {r['store_misses']}",
        flush=True,
    )


def _print_table(out: dict) -> None:
    rows = out["routers"]
    print(
        "\n| router | memory-tier hit rate | store reads | TTFT p50 (s) | p50 vs round-robin "
        "(95 % CI) | TTFT p99 (s) | throughput (req/s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for policy, r in rows.items():
        vs = r.get("p50_vs_round_robin")
        ratio = f"{vs['ratio']:.2f}x ({vs['low']:.2f}-{vs['high']:.2f})" if vs else ""
        print(
            f"| {policy} | {r['memory_hit_rate']:.2f} | {r['store_reads']} | {r['ttft_p50_s']} | "
            f"{ratio} | {r['ttft_p99_s']} | {r['throughput_rps']:.3f} |"
        )
    print(f"\n{out['commit']} on {out['machine']}")


def _machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"commit": commit, "machine": f"{os.cpu_count()} cores, {cpu}", "load_avg": load}


def _argv(args: argparse.Namespace) -> list[str]:
    skip = {"func", "bench", "command", "verbose", "json"}
    out = []
    for k, v in sorted(vars(args).items()):
        if k in skip or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out.append(f"{flag} {','.join(map(str, v))}")
        else:
            out.append(f"{flag} {v}")
    return out
