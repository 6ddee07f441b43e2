"""``blendkv bench gpu`` end to end on the CPU with the tiny shape (the GPU numbers need a GPU;
this checks the command runs, agrees with transformers and reports every figure)."""

from __future__ import annotations

import json

from blendkv.cli import main


def test_bench_gpu_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    args = ["bench", "gpu", "--shapes", "tiny", "--device", "cpu", "--dtype", "float32"]
    args += ["--prefill-tokens", "128", "--blend-prompts", "120:3,200:4"]
    args += ["--decode-tokens", "4", "--concurrency", "3", "--repeats", "1", "--kv-cache-gb", "1"]
    assert main([*args, "--json", str(out), "--profile", str(tmp_path / "prof")]) == 0
    (row,) = json.loads(out.read_text())
    assert row["greedy_match"] == 1.0  # fp32: blendkv's greedy tokens are transformers'
    for key in ("prefill_vs_hf", "decode_vs_hf_1", "decode_vs_hf_3"):
        assert row[key] > 0
    small, large = row["blend"]
    assert (small["docs"], large["docs"]) == (3, 4)
    assert abs(small["tokens"] - 120) <= 30 and abs(large["tokens"] - 200) <= 40
    for size in (small, large):
        for name in ("blend", "blend_v0.15", "reuse", "engine_choice", "blend_device"):
            assert size[f"{name}_s"] > 0 and size[f"{name}_speedup"] > 0
        assert size["reuse_device_s"] > 0 and size["serial_load_s"] > 0
        assert size["device_tier_chunks"].endswith(f"/{size['docs']}")
        # the engine measured both rates in the warm-up, so the cost check made a choice
        assert size["engine_choice"] in ("blend", "cheaper_selection", "full_prefill")
        assert size["engine_choice_reason"].startswith("cost check:")
        for name in ("full", "blend", "reuse"):
            profile = size[f"profile_{name}"]
            assert profile["wall_ms"] >= profile["host_busy_ms"] > 0
    printed = capsys.readouterr().out
    assert "greedy match 1.00" in printed and "engine's choice" in printed
    assert "chunks kept in device memory" in printed
    assert "every layer loaded before the forward" in printed
    # the Triton and CUDA-graph variants change nothing on the CPU backend: said, not timed
    assert "variant unsplit: changes nothing on this engine, skipped" in printed
    assert "blend_unsplit_s" not in small and "blend_eager_s" not in small
    # --profile: one report per shape, each request's host figures (no device on the CPU)
    report = (tmp_path / "prof" / "profile_tiny.txt").read_text()
    for name in ("blend", "reuse", "full"):
        assert f"## {name}: " in report and f"### {name}: cProfile (cumulative)" in report
        assert row["profile"][name]["aten_ops"] > 0 and row["profile"][name]["wall_ms"] > 0


def test_bench_gpu_attention_checks_both_kernels_on_cpu(tmp_path, capsys):
    """Split and whole prefill kernels against the torch backend (Triton's interpreter here)."""
    out = tmp_path / "attention.json"
    args = ["bench", "gpu-attention", "--device", "cpu", "--heads", "4:2:16", "--rows", "3"]
    assert main([*args, "--keys", "600", "--repeats", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["splits"] == 2 and row["split_ms"] > 0 and row["whole_ms"] > 0
    assert "2 parts" in capsys.readouterr().out


def test_bench_gpu_rejects_unknown_shapes(capsys):
    assert main(["bench", "gpu", "--shapes", "gpt5", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "gpu", "--shapes", "tiny", "--variants", "eager,turbo"]) == 2
    assert "--variants: unknown ['turbo']" in capsys.readouterr().err


def test_count_launches_counts_the_kernels_of_each_request(tmp_path):
    """The launch counter on a 2-layer model: a full prefill launches each Triton kernel of a
    layer once per layer (the final norm once more), and a blend launches more than a reuse.
    With piecewise graphs (the engine's default on CUDA) the norms and the MLP's activation run
    inside the replays, one launch per dense piece: fewer launches in all."""
    out = tmp_path / "launches.json"
    args = ["--layers", "2", "--docs", "2", "--doc-words", "8", "--max-model-len", "256"]
    args += ["--json", str(out)]
    assert main(["bench", "launches", *args]) == 0
    graphs = json.loads(out.read_text())
    assert main(["bench", "launches", *args, "--eager"]) == 0
    rows = json.loads(out.read_text())
    assert graphs["graphs"] and not rows["graphs"]
    assert "_rms_norm_kernel" not in graphs["full"]["triton"]
    assert graphs["full"]["top_aten"]["graph_replay"] == 2 + 1  # first, link, last
    for name in ("full", "reuse", "blend"):
        assert graphs[name]["launches"] < rows[name]["launches"]
        assert graphs[name]["host_syncs"] == rows[name]["host_syncs"]
    full = rows["full"]["triton"]
    assert full["_rms_norm_kernel"] == 2 * 2 + 1
    assert full["_rotary_qk_kernel"] == full["_silu_and_mul_kernel"] == 2
    # RoPE writes every row's K/V in its launch (the pruned last layer's too): no other write
    assert "_kv_write_kernel" not in full
    # a full prefill waits for the device once: the sampled token comes back
    (where,) = rows["full"]["syncs_at"]
    assert "sampler.py" in where and rows["full"]["host_syncs"] == 1
    # metadata and row indices go up without waiting (pinned, non_blocking): a reuse waits
    # for its token only, a blend also for ProphetKV's scores
    assert rows["reuse"]["host_syncs"] == 1, rows["reuse"]["syncs_at"]
    assert rows["blend"]["host_syncs"] == 2, rows["blend"]["syncs_at"]
    assert rows["blend"]["launches"] > rows["reuse"]["launches"] > 0
    blend = rows["blend"]["triton"]
    assert blend["_mass_kernel"] == 2  # ProphetKV's pass: every layer
    # attention leaves its log-sum-exp for the score: a pass of its own only at the last
    # layer, where the query pass stops before attention
    assert blend["_lse_kernel"] == 1
    assert blend["_shift_kernel"] == 1  # the correction, one launch at layer 1
    # attention writes its output into the graph buffer the next piece reads: no copy of it
    # per layer and pass (left: the ids into the first piece, SDPA's output, ...)
    for name in ("full", "reuse"):
        assert graphs[name]["top_aten"]["copy_"] <= 3
    # the blend's ProphetKV pass replays one graph per loading stage (2 layers: 2): its rows
    # copied into the graphs' buffers once (ids, positions and their padding, slots, score
    # positions, key count, block table)
    assert graphs["blend"]["top_aten"]["copy_"] <= 3 + 6
    assert graphs["blend"]["top_aten"]["graph_replay"] == 2 + 3  # the pass; first, link, last


def test_count_launches_leaves_out_host_bookkeeping():
    """Ops on tensors a GPU run keeps on the host launch no kernel; ops on device tensors (and
    their results, and tensors made with device=) do, and a host read of one is a sync."""
    import torch

    from blendkv.eval.bench.launches import count
    from blendkv.kernels.uploads import upload

    weight = torch.ones(4, 4)
    cuda = torch.device("cpu")  # what the counter follows as the device

    def run():
        positions = torch.arange(8)  # host bookkeeping: nothing launched
        _ = (positions * 2).sum().item()
        h = weight @ weight  # 1 kernel
        h = torch.relu(h + 1)  # 2 kernels
        ids = torch.tensor([1, 2], device=cuda)  # a blocking copy: torch syncs after it
        more = upload(torch.tensor([0, 3]), cuda)  # pinned, non_blocking: no sync
        _ = h[ids].sum().item()  # index + sum, then the host waits: 1 sync
        _ = h[more]  # index: 1 kernel

    counted = count(run, [weight])
    assert counted["aten_kernels"] == 3 + 1 + 2 + 1, counted["top_aten"]
    assert counted["host_syncs"] == 2, counted["syncs_at"]
    assert sorted(counted["syncs_at"].values()) == [1, 1]


def test_bench_gpu_attention_tune_checks_and_writes_a_table(tmp_path, capsys):
    """--tune on the CPU (Triton's interpreter): every config checked against the torch
    reference on both kinds of rows, the winner merged into the table."""
    from blendkv.kernels.triton.prefill_tiles import PrefillTiles, load_table

    table, out = tmp_path / "sm90.json", tmp_path / "tune.json"
    args = ["bench", "gpu-attention", "--device", "cpu", "--heads", "4:2:16", "--keys", "96"]
    args += ["--tune", "--configs", "32:16:4:2,64:64:8:2", "--repeats", "10"]
    assert main([*args, "--tune-out", str(table), "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert [c["kind"] for c in result["cases"]] == ["query", "scattered"]
    assert result["cases"][1]["rows"] == 10  # 10 % of 96 keys, the last one among them
    assert len(result["ranking"]) == 3 and not result["skipped"]  # the defaults are added
    best = PrefillTiles(**result["best"])
    assert load_table(table) == {"group2_dim16_bfloat16": best}
    assert "best PrefillTiles" in capsys.readouterr().out


def test_bench_gpu_decode_tokens_zero_skips_decode(tmp_path):
    out = tmp_path / "gpu.json"
    args = ["bench", "gpu", "--shapes", "tiny", "--device", "cpu", "--dtype", "float32"]
    args += ["--prefill-tokens", "64", "--blend-prompts", "", "--decode-tokens", "0"]
    assert main([*args, "--repeats", "1", "--kv-cache-gb", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["prefill_s"] > 0 and not any(k.startswith("decode_") for k in row)


def test_bench_gpu_kernel_variants_run_in_engines_of_their_own(tmp_path):
    """On the Triton backend (interpreted here) the prefill kernel's variants apply: each is
    timed in an engine built with its KernelConfig, none is switched on the default one."""
    out = tmp_path / "gpu.json"
    args = ["bench", "gpu", "--shapes", "tiny", "--device", "cpu", "--dtype", "float32"]
    args += ["--attention-backend", "triton", "--prefill-tokens", "32", "--blend-prompts", "48:2"]
    args += ["--decode-tokens", "0", "--repeats", "1", "--variants", "unsplit,untuned"]
    assert main([*args, "--json", str(out)]) == 0
    ((size,),) = [row["blend"] for row in json.loads(out.read_text())]
    for key in ("blend_unsplit_s", "reuse_unsplit_s", "blend_untuned_s", "reuse_untuned_s"):
        assert size[key] > 0
    assert "serial_load_s" not in size and "blend_device_s" not in size
