"""``specfw serve model.tp_size=2``: a real server over two ranks answers the OpenAI client, and
Ctrl-C ends every rank."""

import os

import openai

from server_helpers import CliProcess, free_port, wait_until


def _children(pid: int) -> set[int]:
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(c) for c in f.read().split()}
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_serve_over_two_ranks_answers_and_stops_every_rank(tiny_model_dir, tmp_path):
    port = free_port()
    args = ["serve", f"model.path={tiny_model_dir}", "model.tp_size=2", "speculative=ngram", f"server.port={port}", "engine.max_total_tokens=4096"]
    with CliProcess(args, tmp_path / "serve.log") as server:
        assert server.healthy(f"http://127.0.0.1:{port}"), server.output()[-3000:]
        ranks = _children(server.proc.pid)
        assert len(ranks) == 1, ranks  # rank 1 (rank 0 is the server itself)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):
            r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=16, temperature=0)
            assert r.choices[0].message.content and r.usage.completion_tokens > 0
        server.stop()
        assert server.proc.returncode is not None
    assert wait_until(lambda: not any(_alive(p) for p in ranks), 20), server.output()[-3000:]
