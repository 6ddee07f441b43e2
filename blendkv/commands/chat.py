"""``blendkv chat``: an interactive chat in the terminal (streams replies)."""

from __future__ import annotations

import argparse
import sys

from blendkv.cli import add_model_args, engine_kwargs
from blendkv.commands.generate import add_sampling_args, sampling_params


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with the model")
    p.add_argument("--system", default=None, help="system prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blendkv import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": line})
        reply = []
        sys.stdout.write("assistant> " if interactive else "")
        for out in llm.stream(llm.render_chat(messages), params):
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            reply.append(out.delta_text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
