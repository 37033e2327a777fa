"""``specfw cluster``: N ``specfw serve`` replicas on this machine behind SGLang's router
(``sglang-router``, ``pip install specfw[router]``), started and stopped together.

    specfw cluster replicas=2 [port=30000] [policy=cache_aware] [serve overrides ...]

Each replica is its own process (``specfw serve``, the given overrides, ``server.port`` = port + 1
+ i, ``engine.num_threads`` = the machine's cores split evenly unless given); the router listens
on ``port`` (its Prometheus metrics on port + 1 + N) with ``--worker-urls`` of all replicas and the chosen policy (``cache_aware``: a prompt
prefix seen before goes to the replica that served it; ``round_robin``, ``random``,
``power_of_two``). Ctrl-C or SIGTERM stops the router and every replica. Across machines, run
``specfw serve`` per machine and the router with Kubernetes service discovery
(``deploy/kubernetes.yaml``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
OWN_KEYS = ("replicas", "port", "policy")


class ClusterError(ValueError):
    pass


def parse(args: list[str]) -> tuple[dict, list[str]]:
    """``replicas``, ``port``, ``policy`` from ``args``; the rest are ``specfw serve`` overrides."""
    own = {"replicas": 2, "port": 30000, "policy": "cache_aware"}
    serve = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and key in OWN_KEYS:
            own[key] = value
        else:
            serve.append(a)
    try:
        own["replicas"], own["port"] = int(own["replicas"]), int(own["port"])
    except ValueError as e:
        raise ClusterError(f"replicas and port are integers ({e})") from None
    if own["replicas"] < 1:
        raise ClusterError(f"replicas: must be >= 1, got {own['replicas']}")
    if own["policy"] not in POLICIES:
        raise ClusterError(f"policy: '{own['policy']}' is not one of {list(POLICIES)}")
    if any(a.startswith("server.port=") for a in serve):
        raise ClusterError("server.port: the cluster sets each replica's port (port + 1 + i); give port=... instead")
    return own, serve


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(procs: list[subprocess.Popen], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(zip(urls, procs))
    while pending:
        for url, p in list(pending.items()):
            if p.poll() is not None:
                raise ClusterError(f"{url}: the process exited with {p.returncode} before it was healthy")
            if _healthy(url):
                del pending[url]
        if time.monotonic() > deadline:
            raise ClusterError(f"not healthy after {timeout:.0f} s: {', '.join(pending)}")
        time.sleep(0.3)


def _wait_registered(router: subprocess.Popen, url: str, n: int, timeout: float) -> None:
    """Until the router lists ``n`` healthy workers (``GET /workers``)."""
    import json

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/workers", timeout=2) as r:
                workers = json.loads(r.read()).get("workers", [])
            if sum(1 for w in workers if w.get("is_healthy")) >= n:
                return
        except (OSError, ValueError):
            pass
        if router.poll() is not None:
            raise ClusterError(f"the router exited with {router.returncode}")
        if time.monotonic() > deadline:
            raise ClusterError(f"the router did not register {n} healthy workers within {timeout:.0f} s")
        time.sleep(0.3)


def specfw_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "specfw")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "specfw.cli"]


def run(args: list[str], startup_timeout: float = 300) -> int:
    own, serve = parse(args)
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise ClusterError("sglang-router is not installed: pip install 'specfw[router]'") from None
    n, port = own["replicas"], own["port"]
    threads = [] if any(a.startswith("engine.num_threads=") for a in serve) else [f"engine.num_threads={max(1, (os.cpu_count() or 1) // n)}"]
    urls = [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)]
    procs: list[subprocess.Popen] = []

    def stop(*_):
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        return 0

    def interrupted(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also where it was ignored (started in the background)
    try:
        for i, url in enumerate(urls):
            procs.append(subprocess.Popen(specfw_command() + ["serve", *serve, *threads, f"server.port={port + 1 + i}"]))
            print(f"replica {i}: pid {procs[-1].pid} {url}", flush=True)
        _wait(procs, urls, startup_timeout)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--policy",
                    own["policy"],
                    "--worker-urls",
                    *urls,
                    "--prometheus-port",
                    str(port + 1 + n),
                ]
            )
        )
        print(f"router: pid {procs[-1].pid} http://127.0.0.1:{port} (policy {own['policy']})", flush=True)
        _wait(procs[-1:], [f"http://127.0.0.1:{port}"], 60)
        _wait_registered(procs[-1], f"http://127.0.0.1:{port}", n, 60)  # the router adds workers in the background
        print(f"cluster ready: {n} replica(s) behind http://127.0.0.1:{port}", flush=True)
        while all(p.poll() is None for p in procs[-1:]):
            time.sleep(0.5)
        return procs[-1].returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop()
