"""``blendkv generate "prompt" ...``: complete prompts (streams a single prompt)."""

from __future__ import annotations

import argparse
import json
import sys

from blendkv import SamplingParams
from blendkv.cli import add_model_args, engine_kwargs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_penalty_args(p)


def add_penalty_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="scale the logits of prompt and output tokens down by this factor (>1 discourages "
        "loops; transformers' and vLLM's repetition_penalty)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from the logit of every token generated so far ([-2, 2], OpenAI's)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this once per time a token was generated ([-2, 2], OpenAI's)",
    )


def penalty_kwargs(args: argparse.Namespace) -> dict:
    return {
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
    }


def sampling_params(args: argparse.Namespace):
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        **penalty_kwargs(args),
    )


def register(sub) -> None:
    p = sub.add_parser("generate", help="complete one or more prompts")
    p.add_argument("prompts", nargs="+", help="prompt text (several run as one batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blendkv import LLM

    params = sampling_params(args)  # validate before loading the model
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = [
        llm.render_chat([{"role": "user", "content": p}]) if args.chat else p for p in args.prompts
    ]
    if len(prompts) == 1 and not args.json:
        for out in llm.stream(prompts[0], params):
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for prompt, out in zip(args.prompts, llm.generate(prompts, params), strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": out.text,
                "finish_reason": out.outputs[0].finish_reason,
                "num_prompt_tokens": out.metrics.num_prompt_tokens,
                "num_output_tokens": len(out.outputs[0].token_ids),
                "ttft_s": out.metrics.ttft,
            }
            print(json.dumps(record))
        else:
            print(f"### {prompt}\n{out.text}\n")
    return 0
