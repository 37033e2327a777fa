"""Serving overhead: decode tokens/s through a real `specfw serve` (uvicorn on 127.0.0.1, the
`openai` client, non-streaming and streaming) vs the same engine in-process, batch 1, same
prompts and thread count, one run; prints the ratios. The server is measured first, then shut
down, then the in-process engine (never both at once on the same cores).

    .venv/bin/python benchmarks/bench_server.py [--prompts 4] [--new-tokens 128] [--args speculative=ngram]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(extra: list[str], threads: int):
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "specfw"), "serve", f"server.port={port}", f"engine.num_threads={threads}", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    import urllib.request

    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("specfw serve exited during startup")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("specfw serve did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--args", nargs="*", default=[], help="extra `specfw serve` overrides (also applied in-process)")
    args = ap.parse_args()
    import openai
    from specfw.datasets import mtbench_first_turns

    questions = mtbench_first_turns(args.prompts)
    extra = {"ignore_eos": True}

    proc, port = serve(args.args, args.threads)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        chat = lambda q, **kw: client.chat.completions.create(  # noqa: E731
            model=model, messages=[{"role": "user", "content": q}], max_tokens=args.new_tokens, temperature=0, extra_body=extra, **kw
        )
        chat(questions[0])  # warm-up
        rates = {}
        for stream in (False, True):
            n, t = 0, 0.0
            for q in tqdm(questions, desc=f"server ({'stream' if stream else 'non-stream'})"):
                t0 = time.perf_counter()
                if stream:
                    got = sum(1 for c in chat(q, stream=True) if c.choices and c.choices[0].delta.content is not None)
                    got = args.new_tokens  # ignore_eos: exactly max_tokens tokens
                else:
                    got = chat(q).usage.completion_tokens
                t += time.perf_counter() - t0
                n += got
            rates[stream] = n / t
    finally:
        proc.terminate()
        proc.wait(30)

    import torch

    torch.set_num_threads(args.threads)
    from hydra import compose, initialize_config_module
    from specfw.config import validate
    from specfw.config_store import register_configs
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams

    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        cfg = compose("serve", overrides=[f"engine.num_threads={args.threads}", *args.args])
    validate(cfg)
    eng = Engine(cfg)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    prompts = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in questions]
    eng.generate([prompts[0]], params)
    n, t = 0, 0.0
    for p in tqdm(prompts, desc="in-process engine"):
        t0 = time.perf_counter()
        n += len(eng.generate([p], params)[0].token_ids)
        t += time.perf_counter() - t0
    local = n / t
    print(f"\n{args.prompts} MT-bench prompts x {args.new_tokens} tokens, batch 1, {args.threads} threads, overrides {args.args or 'none'}")
    print(f"in-process engine        : {local:7.2f} tok/s")
    print(f"server, non-streaming    : {rates[False]:7.2f} tok/s   ratio vs in-process: {rates[False] / local:.2f}x")
    print(f"server, streaming (SSE)  : {rates[True]:7.2f} tok/s   ratio vs in-process: {rates[True] / local:.2f}x")


if __name__ == "__main__":
    main()
