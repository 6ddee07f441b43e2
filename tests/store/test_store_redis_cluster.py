"""The chunk-K/V store on a real local Redis Cluster (tests/redis_cluster.py): hash-tagged keys,
bulk reads that follow MOVED and ASK, two processes sharing chunks, a store written before the
``{ns}`` tag, and a master killed under a running engine (misses, never errors, until its
replica is promoted; no committed chunk lost). The shared single-server tests run on the
cluster too (tests/store/test_store_redis.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import redis
from redis_cluster import RedisCluster
from store_helpers import key_of, make_kv, same_bits

from blendkv.cli import main
from blendkv.store import NewChunk, open_kv_store


def test_keys_are_hash_tagged_and_any_node_url_works(redis_cluster, fp):
    redis_cluster.flush()
    other_node = f"redis://127.0.0.1:{redis_cluster.ports[1]}/0"
    with open_kv_store(redis_cluster.url, fp, memory_tier_bytes=0, part_bytes=64) as a:
        assert a.cluster
        a.put_many([NewChunk(key_of(i), make_kv(i), doc_id="d", position=i) for i in range(6)])
        slot = a.client.keyslot
        for i in range(6):  # a chunk's parts and metadata: one slot
            names = [a._chunk(key_of(i), s) for s in ("m", "p:0", "p:1", "e")]
            assert len({slot(n) for n in names}) == 1
        store_wide = [a._k(s) for s in ("fp", "format", "chunks", "gen", "next_id", "doc:d")]
        assert len({slot(n) for n in store_wide}) == 1
        masters = {redis_cluster.master_port_of(a._chunk(key_of(i), "m")) for i in range(6)}
        assert len(masters) > 1  # the chunks are spread over the masters
    with open_kv_store(other_node, fp, memory_tier_bytes=0) as b:
        assert len(b) == 6 and b.verify().ok, b.verify()
        assert [m.position for m in b.document_chunks("d")] == list(range(6))
        assert b.stats().entries == 6 and b.stats().map_used > 0


def test_bulk_reads_follow_moved_and_ask(redis_cluster, fp):
    redis_cluster.flush()
    with open_kv_store(redis_cluster.url, fp, memory_tier_bytes=0, part_bytes=100) as s:
        chunk = NewChunk(key_of(7), make_kv(7))
        s.put_many([chunk])
        marker = s._chunk(chunk.key, "m")
        slot = s.client.keyslot(marker)
        nodes = s.client.nodes_manager
        owner = s.client.get_node_from_key(marker)
        other = next(n for n in s.client.get_primaries() if n.name != owner.name)
        # MOVED: the reader's slot map names the wrong master; it is refreshed and followed.
        nodes.slots_cache[slot] = [other]
        assert same_bits(s.get(chunk.key).kv, chunk.kv)
        assert s.client.get_node_from_key(marker).name == owner.name
        # ASK: the slot is migrating and the chunk's keys have moved; ASKING, then the GETs.
        src, dst = redis.Redis(port=owner.port), redis.Redis(port=other.port)
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        names = [k for k in src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)]
        src.execute_command("MIGRATE", "127.0.0.1", other.port, "", 0, 5000, "KEYS", *names)
        assert s._bulk.read(*_parts(s, chunk.key)) is not None  # via -ASK
        assert same_bits(s.get(chunk.key).kv, chunk.kv)
        for port in (owner.port, other.port):  # the migration finished: the slot is dst's
            redis.Redis(port=port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        assert same_bits(s.get(chunk.key).kv, chunk.kv) and s.connection_errors == 0


def _parts(store, key):
    record = json.loads(store.client.get(store._chunk(key, "m")))
    return [store._chunk(key, f"p:{i}") for i in range(record["parts"])], record["nbytes"]


def test_two_processes_share_chunks_through_the_cluster(redis_cluster, fp):
    redis_cluster.flush()
    script = f"""
import sys
sys.path[:0] = {sys.path[:0] + [p for p in sys.path if p.endswith(("tests", "store"))]!r}
from store_helpers import key_of, make_kv, make_fingerprint
from blendkv.cli import main
from blendkv.store import NewChunk, open_kv_store
with open_kv_store({redis_cluster.url!r}, make_fingerprint(), memory_tier_bytes=0) as s:
    s.put_many([NewChunk(key_of(i), make_kv(i), doc_id="d", position=i) for i in range(4)])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    with open_kv_store(redis_cluster.url, fp, memory_tier_bytes=0) as s:
        assert len(s) == 4 and s.generation() > 0
        for i in range(4):
            assert same_bits(s.get(key_of(i)).kv, make_kv(i))


def test_a_single_server_store_in_the_old_key_layout_is_renamed_on_open(redis_server, fp):
    redis_server.flush()
    with open_kv_store(redis_server.url, fp, memory_tier_bytes=0) as s:
        s.put_many([NewChunk(key_of(1), make_kv(1), doc_id="d", position=0)])
        c = s.client
        for name in c.scan_iter("{blendkv}:*"):  # back to the layout before the {ns} tag
            c.rename(name, name.decode().replace("{blendkv}", "blendkv"))
    assert redis.Redis(port=redis_server.port).exists("blendkv:fp")
    try:
        open_kv_store(redis_server.url, fp, readonly=True)
        raise AssertionError("a read-only open must refuse the old layout")
    except Exception as e:
        assert "key layout" in str(e) and "{blendkv}:fp" in str(e)
    with open_kv_store(redis_server.url, fp, memory_tier_bytes=0) as s:
        assert same_bits(s.get(key_of(1)).kv, make_kv(1)) and len(s) == 1
        assert [m.key for m in s.document_chunks("d")] == [key_of(1)] and s.verify().ok


def test_a_killed_master_is_misses_until_its_replica_is_promoted(tmp_path, fp, capsys):
    cluster = RedisCluster(tmp_path).start()
    try:
        with open_kv_store(cluster.url, fp, memory_tier_bytes=0, socket_timeout=1.0) as s:
            s.put_many([NewChunk(key_of(i), make_kv(i)) for i in range(9)])
            master = {i: cluster.master_port_of(s._chunk(key_of(i), "m")) for i in range(9)}
            index_master = cluster.master_port_of(s._k("chunks"))
            victim = next(p for p in master.values() if p != index_master)
            lost = [i for i in range(9) if master[i] == victim]
            stats = redis.Redis(port=victim).info("commandstats")
            assert stats["cmdstat_wait"]["calls"] >= len(lost)  # each put waited (WAIT 1)
            replica = redis.Redis(port=cluster.replica_of(victim))
            replica.config_set("cluster-replica-no-failover", "yes")  # hold the outage
            cluster.kill(victim)
            found = {i: s.get(key_of(i)) for i in range(9)}  # misses, never errors
            assert all(found[i] is None for i in lost)
            assert all(same_bits(found[i].kv, make_kv(i)) for i in range(9) if i not in lost)
            capsys.readouterr()
            main(["store", "verify", "--store", cluster.url, "--json"])  # `blendkv store verify`
            report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            kinds = [p["kind"] for p in report["problems"]]
            assert not report["ok"] and "unreachable" in kinds, report
            assert kinds.count("missing_value") == len(lost), report
            replica.config_set("cluster-replica-no-failover", "no")
            cluster.wait_ok()  # the replica is promoted
            deadline = time.monotonic() + 10
            while s.get(key_of(lost[0])) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            for i in range(9):  # nothing a put returned was lost (WAIT 1)
                assert same_bits(s.get(key_of(i)).kv, make_kv(i))
            assert s.verify().ok, s.verify()
            s.put_many([NewChunk(key_of(9), make_kv(9))])  # writes go to the new master
            assert same_bits(s.get(key_of(9)).kv, make_kv(9))
    finally:
        cluster.stop()
