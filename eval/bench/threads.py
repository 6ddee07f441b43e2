"""The CPU engine beside other work: prefill and decode per OpenMP wait setting, with the CPU to
itself and beside one busy process (``blendkv.openmp_env``).

OpenMP reads its settings when torch loads it, so each setting runs in a child process of its
own: ``blendkv`` (no variable set: the spin count ``import blendkv`` sets), ``libgomp``
(``GOMP_SPINCOUNT=300000``, libgomp's own default) and ``passive`` (``OMP_WAIT_POLICY=PASSIVE``:
threads sleep at once). Each child times one prefill of ``--prefill-tokens`` random tokens and
greedy decode of one and of ``--num-requests`` requests; the settings run interleaved, first
alone, then beside a process that spins on one core. The greedy tokens must be the same under
every setting (only waiting differs) before any time is reported.

    blendkv bench threads [--model M] [--dtype bfloat16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "blendkv": {},
    "libgomp": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
BUSY = "while True: pass"


def _child(args: argparse.Namespace) -> None:
    """One setting's timings, as a JSON line on stdout (runs in its own process)."""
    import random
    import time

    from blendkv import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = len(llm.tokenizer)
    prefill = [rng.randrange(vocab) for _ in range(args.prefill_tokens)]
    prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(args.num_requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate([prefill[:64]], SamplingParams(max_tokens=2))  # warm-up
    out = {}
    start = time.perf_counter()
    llm.generate([prefill], SamplingParams(max_tokens=1))
    out["prefill_s"] = time.perf_counter() - start
    tokens = []
    for name, batch in (("decode1", prompts[:1]), (f"decode{len(prompts)}", prompts)):
        start = time.perf_counter()
        outs = llm.generate(batch, sp)
        out[f"{name}_tok_s"] = len(batch) * args.output_tokens / (time.perf_counter() - start)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    print(json.dumps({"timings": out, "tokens": tokens}))


def _busy() -> subprocess.Popen:
    """A process that spins on one core, in a session of its own as another program's would be
    (with the scheduler's autogroups, sessions share the CPU as groups)."""
    return subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)


def _run_setting(args: argparse.Namespace, setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(SETTINGS[setting])
    cmd = [sys.executable, "-m", "blendkv.eval.bench.threads", "--child", "--dtype", args.dtype]
    cmd += ["--prefill-tokens", str(args.prefill_tokens), "--num-requests", str(args.num_requests)]
    cmd += ["--output-tokens", str(args.output_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench threads: the {setting!r} child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> dict:
    runs: dict[tuple[str, str], list[dict]] = {}
    tokens = {}
    for _ in range(args.repeats):
        for load in ("alone", "beside a busy process"):
            busy = _busy() if load != "alone" else None
            try:
                for setting in SETTINGS:
                    got = _run_setting(args, setting)
                    runs.setdefault((load, setting), []).append(got["timings"])
                    tokens[(load, setting)] = got["tokens"]
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    first = next(iter(tokens.values()))
    same = all(t == first for t in tokens.values())
    if not same:
        raise RuntimeError("bench threads: greedy tokens differ between wait settings")
    rows = []
    for (load, setting), timings in runs.items():
        med = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
        rows.append({"load": load, "setting": setting, **{k: round(v, 3) for k, v in med.items()}})
    for row in rows:  # ratios to libgomp's default under the same load
        base = next(r for r in rows if r["load"] == row["load"] and r["setting"] == "libgomp")
        row["prefill_vs_libgomp"] = round(row["prefill_s"] / base["prefill_s"], 2)
        for k in [k for k in row if k.endswith("_tok_s")]:
            row[k.replace("_tok_s", "_vs_libgomp")] = round(row[k] / base[k], 2)
    keys = [k for k in rows[0] if k not in ("load", "setting")]
    print(f"{'load':<22} {'setting':<8} " + " ".join(f"{k:>18}" for k in keys))
    for row in rows:
        print(f"{row['load']:<22} {row['setting']:<8} " + " ".join(f"{row[k]:>18}" for k in keys))
    result = {"threads_bench": rows, "tokens_equal": same, "cores": os.cpu_count()}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":  # a child of main(): one setting
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-tokens", type=int, required=True)
    parser.add_argument("--num-requests", type=int, required=True)
    parser.add_argument("--output-tokens", type=int, required=True)
    _child(parser.parse_args())
