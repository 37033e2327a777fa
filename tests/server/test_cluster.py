"""Replicas behind SGLang's router: the worker endpoints the router calls, and ``specfw cluster``
with two real replicas (tiny model) behind the real ``sglang-router``: requests spread over both,
a repeated prompt prefix sticks to one replica (cache-aware policy), a killed replica does not fail
new requests, and stopping the cluster stops every process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import httpx2
import openai
import pytest

from server_helpers import ServerThread, wait_until


def test_worker_endpoints_the_router_calls(tiny_engine):
    from specfw.server.app import create_app

    with ServerThread(create_app(tiny_engine)) as s, httpx2.Client(base_url=s.url, timeout=30) as c:
        info = c.get("/server_info").json()
        assert info["dp_size"] == 1 and info["tp_size"] == 1 and info["model_id"] == info["served_model_name"]
        assert "config" in info and "state" in info  # the older /get_server_info's content too
        assert c.get("/model_info").json() == c.get("/get_model_info").json()
        load = c.get("/get_load").json()
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0 and load[0]["num_tokens"] == 0
        assert c.get("/v1/loads").json()["loads"][0]["dp_rank"] == 0
        assert c.post("/flush_cache").status_code == 200
        assert c.get("/health_generate").json() == {"status": "ok"}


def _free_port_block(n: int) -> int:
    """A port p with p .. p + n free (checked, not reserved)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n >= 65535:
            continue
        ok = True
        for q in range(p, p + n + 1):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no free port block")


def _served(url: str) -> int:
    text = httpx2.get(url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^specfw_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


class Cluster:
    """``specfw cluster`` as a subprocess (two replicas of the tiny model, the real router)."""

    def __init__(self, model_dir, log, policy):
        self.port = _free_port_block(3)
        exe = os.path.join(os.path.dirname(sys.executable), "specfw")
        cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "specfw.cli"]
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                cmd
                + [
                    "cluster",
                    "replicas=2",
                    f"port={self.port}",
                    f"policy={policy}",
                    f"model.path={model_dir}",
                    "engine.max_total_tokens=2048",
                    "server.log_level=warning",
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        self.replicas = [f"http://127.0.0.1:{self.port + 1}", f"http://127.0.0.1:{self.port + 2}"]
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=120)

    def __enter__(self):
        assert wait_until(lambda: "cluster ready" in self.log.read_text() or self.proc.poll() is not None, 240, 0.5)
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        self.pids = [int(p) for p in re.findall(r"^(?:replica \d|router): pid (\d+)", self.log.read_text(), re.M)]
        assert len(self.pids) == 3
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        assert wait_until(lambda: not any(_alive(p) for p in self.pids), 30), "processes left after the cluster stopped"

    def ask(self, text) -> int:
        """Raw completions: the router's prefix tree sees the text itself (a chat template would give
        every request the same long system-prompt prefix)."""
        return self.client.completions.create(model="default", prompt=text, max_tokens=4, temperature=0).usage.completion_tokens

    def served(self) -> list[int]:
        return [_served(u) for u in self.replicas]

    def who_serves(self, text) -> int:
        before = self.served()
        assert self.ask(text) > 0
        gained = [a - b for a, b in zip(self.served(), before)]
        assert sorted(gained) == [0, 1], gained
        return gained.index(1)


def test_cluster_spreads_requests_and_survives_a_killed_replica(tiny_model_dir, tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install 'specfw[router]')")
    with Cluster(tiny_model_dir, tmp_path / "rr.log", "round_robin") as c:
        for t in ["Rivers", "Volcanoes", "Glaciers", "Deserts", "Forests", "Oceans"]:
            assert c.ask(f"{t} are interesting because") > 0
        assert c.served() == [3, 3]
        os.kill(c.pids[0], signal.SIGKILL)  # one replica gone mid-run
        for i in range(6):  # every new request still succeeds (retries, health checks)
            assert c.ask(f"after the failure, request {i}") > 0
        assert _served(c.replicas[1]) == 9


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(tiny_model_dir, tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install 'specfw[router]')")
    with Cluster(tiny_model_dir, tmp_path / "ca.log", "cache_aware") as c:
        prefixes = [
            "Here is a long shared context about the history of astronomy and telescopes. " * 6,
            "Quite another long context: recipes for bread, sourdough starters and ovens. " * 6,
        ]
        where = {0: set(), 1: set()}
        for i in range(4):  # interleaved: each prefix keeps its replica
            for k, prefix in enumerate(prefixes):
                where[k].add(c.who_serves(prefix + f"Question {i}:"))
        assert len(where[0]) == 1 and len(where[1]) == 1, where


def test_cluster_config_errors_name_the_key():
    from specfw.cluster import ClusterError, parse

    assert parse(["replicas=3", "speculative=ngram"]) == ({"replicas": 3, "port": 30000, "policy": "cache_aware"}, ["speculative=ngram"])
    for args, key in ((["replicas=0"], "replicas"), (["policy=fastest"], "policy"), (["server.port=1"], "server.port"), (["port=x"], "replicas and port")):
        with pytest.raises(ClusterError, match=key):
            parse(args)
