"""Serving overhead, as a thin wrapper over ``specfw bench``: the same prompts through a real
``specfw serve`` (``bench.url``: uvicorn on 127.0.0.1, streamed chat completions) and then through
the same engine in-process, batch 1, one run; prints the ratio. The server is stopped before the
in-process run (never both on the same cores at once).

    .venv/bin/python benchmarks/bench_server.py [--prompts 4] [--new-tokens 128] [--args speculative=ngram]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(extra: list[str], threads: int):
    import httpx2

    port = free_port()
    cmd = [str(BIN / "specfw"), "serve", f"server.port={port}", f"engine.num_threads={threads}", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    for _ in range(600):
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx2.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("specfw serve exited during startup")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("specfw serve did not become healthy")


def bench(overrides: list[str], out: Path, name: str) -> dict:
    subprocess.run([str(BIN / "specfw"), "bench", *overrides, f"bench.out_dir={out}", f"bench.name={name}"], check=True)
    return [json.loads(line) for line in (out / name / "records.jsonl").read_text().splitlines()][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--args", nargs="*", default=[], help="extra `specfw serve` overrides (also applied in-process)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    common = [f"bench.prompts.num_prompts={args.prompts}", f"bench.max_new_tokens={args.new_tokens}", "bench.ignore_eos=true"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    proc, port = serve(args.args, args.threads)
    try:
        server = bench(common + [f"bench.url=http://127.0.0.1:{port}"], args.out, f"server-{stamp}")
    finally:
        proc.terminate()
        proc.wait(30)
    local = bench(common + [f"engine.num_threads={args.threads}", "bench.compare_plain=false", *args.args], args.out, f"in-process-{stamp}")
    print(f"\n{args.prompts} MT-bench prompts x {args.new_tokens} tokens, batch 1, {args.threads} threads, overrides {args.args or 'none'}")
    print(f"on {local['machine']}")
    print(f"in-process engine        : {local['tok_s']:7.2f} tok/s")
    print(f"server, streaming (SSE)  : {server['tok_s']:7.2f} tok/s   ratio vs in-process: {server['tok_s'] / local['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
