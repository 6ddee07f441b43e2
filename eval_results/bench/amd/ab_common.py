"""What the one-off MuSiQue A/B scripts next to this file share: their command line, the engine
(``bench_blend.musique_setup``: float32, no prefix cache, 8K context) and the blended prompts,
each run once first so every chunk is in the store."""

import argparse

from blendkv import SamplingParams
from blendkv.blend.config import BlendConfig
from blendkv.eval.bench_blend import _blended, musique_setup


def setup(repeats: int):
    """(args, llm, blend manager, BlendConfig(), one-token greedy params, prompts)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    examples, spec, llm = musique_setup(args)
    manager, cfg = llm.blend_manager(), BlendConfig()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [_blended(ex, spec) for ex in examples]
    for p in prompts:
        llm.generate([p], one, blend=cfg)
    return args, llm, manager, cfg, one, prompts


# Cold pages (cold_load_ab.py, deferred_reads_ab.py): chunk values paged out of LMDB's map.
from blendkv.eval.page_cache import page_out  # noqa: E402, F401
