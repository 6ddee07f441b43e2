"""An engine on a Redis Cluster store: a master killed while a request is queued costs misses
(recomputed, the same tokens), never an error reaching the request; once its replica is
promoted every chunk is a hit again (nothing a write-back committed was lost). Two processes
sharing a cluster: tests/store/test_store_redis_cluster.py."""

from __future__ import annotations

import time

from helpers import QuietLLM
from redis_cluster import RedisCluster
from test_shared_store import DOCS, GREEDY

from blendkv.store import open_kv_store


def test_a_master_killed_mid_run_is_recomputed_not_an_error(tiny_llama_dir, tmp_path):
    cluster = RedisCluster(tmp_path).start()
    llm = QuietLLM(
        str(tiny_llama_dir),
        dtype="float32",
        enable_prefix_caching=False,
        kv_store_dir=cluster.url,
        kv_store_memory_bytes=1,  # no memory tier: every read goes to the cluster
    )
    prompt = {"documents": DOCS, "query": "Who built the lighthouse?"}
    try:
        first = llm.generate([prompt], GREEDY)[0]
        assert first.blend_stats.chunks_missed == 2
        llm.blend_manager().flush()
        assert llm.generate([prompt], GREEDY)[0].blend_stats.chunks_hit == 2
        with open_kv_store(cluster.url, None) as store:  # inspect mode: where the chunks live
            index_master = cluster.master_port_of(store._k("chunks"))
            masters = {cluster.master_port_of(store._chunk(m.key, "m")) for m in store.iter_meta()}
        victim = next(p for p in sorted(masters) if p != index_master)
        engine = llm.engine
        rid = engine.add_request(prompt, GREEDY, blend=None)
        cluster.kill(victim)  # the request is queued; a replica takes the slots over later
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
        lost = outs[rid]
        assert lost.outputs[0].token_ids == first.outputs[0].token_ids
        assert lost.blend_stats.chunks_missed >= 1 and lost.blend_stats.store_errors > 0
        llm.blend_manager().flush()  # a failed write-back is logged, not raised
        cluster.wait_ok()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the promoted replica serves every chunk again
            again = llm.generate([prompt], GREEDY)[0]
            if again.blend_stats.chunks_hit == 2:
                break
            time.sleep(0.2)
        assert again.blend_stats.chunks_hit == 2, again.blend_stats
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.close()
        cluster.stop()
