"""Reconstruction error and size of the stored-K/V codecs on a model's real chunk K/V.

Prefills 256-token chunks of MuSiQue dev paragraphs alone behind the model's anchor (as the
store does), then encodes each chunk with every variant (symmetric or asymmetric groups, group
sizes, int4 outlier-head thresholds, and fp8 e4m3 as a comparison) and prints one JSON line per
variant: relative Frobenius error of K and of V (summed over chunks), the share of int4 key
heads kept in 16 bits, and the encoded value's size against the raw one.

    python -m blendkv.eval.bench.kv_codecs [--model M] [--chunks 16] [--data musique_dev.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from blendkv.store import format as fmt
from blendkv.store.codecs import decode_reference, encode


def chunk_kvs(model: str | None, data: Path, num_chunks: int, chunk_tokens: int = 256):
    from blendkv import LLM

    llm = LLM(model, dtype="bfloat16", warmup=False)
    try:
        manager = llm.blend_manager()
        tok = manager.tokenizer
        text = "\n\n".join(
            c["text"] if isinstance(c, dict) else str(c)
            for record in json.loads(data.read_text())
            for c in record["ctxs"]
        )
        ids = tok.encode(text, add_special_tokens=False)
        chunks = [ids[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(num_chunks)]
        anchor = list(manager.anchor_ids)
        kvs = llm.engine.runner.compute_chunk_kv([anchor] * len(chunks), chunks)
        return [kv.cpu() for kv in kvs]
    finally:
        llm.close()


def fp8_error(x: torch.Tensor, dim: tuple[int, ...]) -> torch.Tensor:
    """x through float8 e4m3 with a float16 scale per group (reduced over ``dim``)."""
    x = x.float()
    s = (x.abs().amax(dim=dim, keepdim=True) / 448).clamp_min(2.0**-14).half().float()
    return (x / s).to(torch.float8_e4m3fn).float() * s


def measure(kvs, name: str, codec: str, **options) -> dict:
    err_k = err_v = norm_k = norm_v = 0.0
    raw = size = heads = outliers = 0
    for kv in kvs:
        if codec == "fp8":
            k = fp8_error(kv[:, 0], (1,))
            v = fp8_error(kv[:, 1], (3,))
            dec = torch.stack((k, v), dim=1)
            nbytes = kv.numel() + 2 * (kv.shape[0] * kv.shape[3] * (kv.shape[2] + kv.shape[4]))
        else:
            enc = encode(kv, codec, **options)
            dec = decode_reference(enc, torch.float32)
            nbytes = len(fmt.encode_value(enc)) - fmt.HEADER_SIZE
            if enc.outlier_heads is not None:
                outliers += int(enc.outlier_heads.sum())
        heads += kv.shape[0] * kv.shape[3]
        raw += kv.numel() * kv.element_size()
        size += nbytes
        x = kv.float()
        err_k += float((dec[:, 0] - x[:, 0]).square().sum())
        err_v += float((dec[:, 1] - x[:, 1]).square().sum())
        norm_k += float(x[:, 0].square().sum())
        norm_v += float(x[:, 1].square().sum())
    return {
        "variant": name,
        "k_rel_err": round(math.sqrt(err_k / norm_k), 5),
        "v_rel_err": round(math.sqrt(err_v / norm_v), 5),
        "outlier_heads": round(outliers / heads, 4),
        "x_smaller": round(raw / size, 3),
    }


def variants(head_dim: int):
    inf = math.inf
    yield "int8 sym", "int8", {"asymmetric": (False, False)}
    yield "int8 asym", "int8", {"asymmetric": (True, True)}
    yield "fp8 e4m3 (K per channel, V per token)", "fp8", {}
    for gt in (32, 64, 128):
        for gd in (32, 64):
            if gd > head_dim:
                continue
            for asym in ((False, False), (True, False), (True, True)):
                tag = "/".join("asym" if a else "sym" for a in asym)
                opts = {"groups": ((gt, 1), (1, gd)), "asymmetric": asym}
                yield f"int4 K gt={gt} V gd={gd} {tag}", "int4", {**opts, "outlier_threshold": inf}
    for threshold in (0.1, 0.15, 0.2, 0.25, 0.3):
        yield f"int4 default, outliers > {threshold}", "int4", {"outlier_threshold": threshold}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--data", type=Path, default=Path("../shared/data/musique_dev.json"))
    p.add_argument("--save-kv", type=Path, default=None, help="also save the chunks' K/V here")
    p.add_argument("--load-kv", type=Path, default=None, help="measure K/V saved by --save-kv")
    args = p.parse_args(argv)
    if args.load_kv is not None:
        kvs = torch.load(args.load_kv)
    else:
        kvs = chunk_kvs(args.model, args.data, args.chunks)
    if args.save_kv is not None:
        torch.save(kvs, args.save_kv)
    for name, codec, options in variants(kvs[0].shape[-1]):
        print(json.dumps(measure(kvs, name, codec, **options)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
