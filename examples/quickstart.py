"""Quickstart: batched generation and chat on the embedded SmolLM2-135M-Instruct.

    make demo            # or: .venv/bin/python examples/quickstart.py

The first run converts the embedded GGUF model once (~30 s) into ~/.cache/blendkv.
"""

from __future__ import annotations

from blendkv import LLM, SamplingParams


def main() -> None:
    # dtype "auto" (the default): bfloat16 where the CPU computes it natively (AMX or
    # AVX512-BF16) or on a GPU; float32 on other CPUs, where bfloat16 runs several times slower.
    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=48)

    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write a haiku about caching.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    for q, out in zip(questions, llm.chat(conversations, params), strict=True):
        m = out.metrics
        print(f"Q: {q}\nA: {out.text.strip()}")
        print(f"   ({m.num_prompt_tokens} prompt tokens, TTFT {m.ttft * 1000:.0f} ms)\n")

    print("Streaming:")
    prompt = llm.render_chat([{"role": "user", "content": "Explain KV caching in one sentence."}])
    for out in llm.stream(prompt, params):
        print(out.delta_text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
