"""Where a decode step's time goes, per phase, plain decoding beside speculative algorithms, at one
request in flight or ``--batch`` (issue 23 on a GPU, issue 17 on a CPU).

    python benchmarks/bench_step_phases.py --device cuda --attention triton --graphs 1 --algos plain,eagle3,ngram
    python benchmarks/bench_step_phases.py --device cpu --algos plain,eagle3          # the CPU kernels
    python benchmarks/bench_step_phases.py --device cpu --isa avx2 --algos plain,eagle3   # the AVX2 build (on an AVX-512 CPU too)

Every phase is timed by wrapping the function that does it (the engine's step, the worker's
decode, the hooks the speculative worker calls, the target forward and, inside it, the host-side
preparation of a graphed forward; inside beam search its head steps, so that what is left is the
search's own host work). With ``--sync`` (default on CUDA) each phase boundary waits for
the device, so a phase owns the device work it launched: the phases then add up to what a step
costs, and the step itself is slower than unsynchronised by the few microseconds per boundary.
Prints milliseconds per decode step for each phase, tokens per step and ms per token; names the
device (and the CPU). After each speculative row (with a ``plain`` row first): its decode speedup
over plain, the same if drafting were free, the draft's share of a plain step and the tokens per
step ``--bar`` (1.8x) would need at this step's cost; then the draft's cost per *drafted* step
(the steps that called the draft hook): what issue 17's draft bar measures. ``name+key=value``
sets a speculative key for one row (``eagle3+draft_assist=ngram``).
"""

from __future__ import annotations

import argparse
import ast
import time
from collections import Counter, defaultdict

import torch

# (phase, its parent): what is wrapped where is set up in Phases.install
GRAPH_PREP = "host prep of graphed forwards (layouts and inputs copied in; target and head, within the phases above)"
PHASES = [
    ("engine step", None),
    ("worker decode", "engine step"),
    ("draft (hook)", "worker decode"),
    ("extend pass", "draft (hook)"),
    ("beam search", "draft (hook)"),
    ("head steps (batch + forward)", "beam search"),
    ("extend + beam search in one kernel call", "draft (hook)"),
    ("device chain: extend + loop, one replay", "draft (hook)"),
    ("build tree (hook)", "worker decode"),
    ("target forward", "worker decode"),
    ("verify (hook)", "worker decode"),
    ("on_accept (hook)", "worker decode"),
    ("observe (hook)", "worker decode"),
]


class Phases:
    """Wall time per phase; only decode steps count (prefill steps are kept apart)."""

    def __init__(self, sync: bool):
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.decoding = False

    def _wait(self):
        if self.sync:
            torch.cuda.synchronize()

    def wrap(self, name: str, fn, only_decode: bool = True):
        def timed(*args, **kwargs):
            if only_decode and not self.decoding:
                return fn(*args, **kwargs)
            self._wait()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._wait()
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed

    def install(self, engine) -> None:
        from specfw import graphs
        from specfw.speculative import device_chain, feature_drafter

        worker = engine.worker
        run = worker.run

        def worker_run(batch):
            self.decoding = not batch.is_prefill
            try:
                return (self.wrap("worker decode", run) if self.decoding else run)(batch)
            finally:
                self.decoding = False

        step = engine.step

        def engine_step(*a, **k):
            self._wait()
            t0 = time.perf_counter()
            before = self.calls["worker decode"]
            out = step(*a, **k)
            self._wait()
            if self.calls["worker decode"] > before:  # a decode step (prefill steps are not counted)
                self.seconds["engine step"] += time.perf_counter() - t0
                self.calls["engine step"] += 1
            return out

        worker.run, engine.step = worker_run, engine_step
        engine.runner.forward = self.wrap("target forward", engine.runner.forward)
        # the host side of every graphed forward (the target's and the draft head's beam steps)
        graphs.RowLayout.build = self.wrap(GRAPH_PREP, graphs.RowLayout.build)
        graphs._load_inputs = self.wrap(GRAPH_PREP, graphs._load_inputs)
        graphs.StaticRowLayout.load = self.wrap(GRAPH_PREP, graphs.StaticRowLayout.load)
        hook = getattr(worker, "hook", None)
        if hook is not None:
            worker.hook = _HookProxy(
                hook,
                {
                    "specfw_draft": self.wrap("draft (hook)", hook.specfw_draft),
                    "specfw_build_tree": self.wrap("build tree (hook)", hook.specfw_build_tree),
                    "specfw_verify": self.wrap("verify (hook)", hook.specfw_verify),
                    "specfw_on_accept": self.wrap("on_accept (hook)", hook.specfw_on_accept),
                    "specfw_observe_step": self.wrap("observe (hook)", hook.specfw_observe_step),
                },
            )
            feature_drafter.FeatureDrafter._extend = self.wrap("extend pass", feature_drafter.FeatureDrafter._extend)
            search = feature_drafter.beam_search

            def beam_search(*a, **k):  # its head steps timed apart: what is left is the search's own host work
                if len(a) > 7:
                    a = (*a[:7], self.wrap("head steps (batch + forward)", a[7]), *a[8:])
                return search(*a, **k)

            feature_drafter.beam_search = self.wrap("beam search", beam_search)
            one_call = feature_drafter.FeatureDrafter._step_in_one_call
            feature_drafter.FeatureDrafter._step_in_one_call = self.wrap("extend + beam search in one kernel call", one_call)
            device_chain.DeviceChain.draft = self.wrap("device chain: extend + loop, one replay", device_chain.DeviceChain.draft)

    def table(self) -> list[tuple[str, float, float]]:
        """(phase, ms per decode step, share of the step) for every phase seen, children indented."""
        steps = max(self.calls["engine step"], 1)
        total = self.seconds["engine step"] or 1e-12
        rows = []
        depth = {}
        for name, parent in PHASES:
            depth[name] = 0 if parent is None else depth[parent] + 1
            if self.calls.get(name):
                rows.append(("  " * depth[name] + name, 1e3 * self.seconds[name] / steps, self.seconds[name] / total))
        for parent in ("engine step", "worker decode", "draft (hook)", "target forward"):
            if not self.calls.get(parent):
                continue
            if not any(p == parent and self.calls.get(n) for n, p in PHASES):
                continue
            kids = sum(self.seconds[n] for n, p in PHASES if p == parent and self.calls.get(n))
            rest = self.seconds[parent] - kids
            i = next(i for i, r in enumerate(rows) if r[0].strip() == parent)
            end = i + 1
            while end < len(rows) and rows[end][0].startswith("  " * (depth[parent] + 1)):
                end += 1
            rows.insert(end, ("  " * (depth[parent] + 1) + f"(rest of {parent})", 1e3 * rest / steps, rest / total))
        if self.calls.get(GRAPH_PREP):
            rows.append((GRAPH_PREP, 1e3 * self.seconds[GRAPH_PREP] / steps, self.seconds[GRAPH_PREP] / total))
        return rows


class _HookProxy:
    def __init__(self, hook, wrapped: dict):
        self._hook, self._wrapped = hook, wrapped

    def __getattr__(self, name):
        return self._wrapped.get(name) or getattr(self._hook, name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--model", default="demo", help="demo, tiny (a random 2-layer model: smoke runs), or a model directory")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--quantization", default="none", help="model.quantization (e.g. gguf: the demo file's blocks)")
    ap.add_argument("--activations", default="none", help="model.activation_quantization (int8: integer dot products)")
    ap.add_argument("--attention", default="auto", help="model.attention_backend")
    ap.add_argument("--isa", default="auto", help="engine.cpu_isa (auto|avx512|avx2|portable|none): e.g. the AVX2 build on an AVX-512 CPU")
    ap.add_argument("--graphs", type=int, default=1, help="engine.cuda_graph_max_bs (0: no CUDA graphs)")
    ap.add_argument(
        "--algos",
        default="plain,eagle3,ngram",
        help="plain or algorithms (auto shape); name:steps:topk:tokens[:draft scheme] for a shape; +key=value after either: a speculative key",
    )
    ap.add_argument("--adaptive", default="auto", help="speculative.adaptive_draft")
    ap.add_argument("--dataset", default="mtbench", choices=["mtbench", "humaneval"], help="MT-bench first turns (chat) or HumanEval prompts (raw code)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="requests in flight")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sync", type=int, default=None, help="wait for the device at phase boundaries (default: on CUDA)")
    ap.add_argument("--python-draft", action="store_true", help="an EAGLE-3 head's draft step in Python, not in one kernel call (A/B)")
    ap.add_argument("--bar", type=float, default=1.8, help="a speedup over plain to say the tokens per step it needs (issue 17: 1.8)")
    a = ap.parse_args()
    if a.python_draft:
        from specfw.backends.cpu import CpuBackend

        CpuBackend.one_call_drafts = False

    from specfw import datasets
    from specfw.bench.drive import run_engine
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.machine import cpu_description
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams

    if a.model == "tiny":
        from specfw.testing import tiny_model

        a.model = str(tiny_model())
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    sync = bool(a.sync if a.sync is not None else a.device.startswith("cuda"))
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else "no GPU"
    print(f"{where}; CPU: {cpu_description()}; torch {torch.__version__}; model {a.model} ({dtype}, {a.load_format} weights, "
          f"quantization {a.quantization}, activations {a.activations}); "
          f"attention {a.attention}; cpu_isa {a.isa}; cuda_graph_max_bs {a.graphs}; sync at phase boundaries: {sync}; "
          f"{a.dataset} 1-{a.prompts} x {a.new_tokens} tokens, greedy, {a.batch} in flight", flush=True)  # fmt: skip
    texts = (datasets.mtbench_first_turns if a.dataset == "mtbench" else datasets.humaneval_prompts)(a.prompts + a.batch)  # the last batch warm up
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0, ignore_eos=True)
    results, plain_ms_per_token, plain_step_ms = {}, None, None
    for spec_name in a.algos.split(","):
        head, *extra = spec_name.split("+")
        name, *shape = head.split(":")
        spec = SpeculativeConfig()
        if name != "plain":
            kw = {"algorithm": name, "adaptive_draft": a.adaptive, **dict(_key_value(e) for e in extra)}  # a row's own keys win over --adaptive
            if len(shape) == 4:
                kw["draft_model_quantization"] = shape.pop()
            if shape:
                kw.update(num_steps=int(shape[0]), topk=int(shape[1]), num_draft_tokens=int(shape[2]))
            spec = plugin_manager().algorithms[name].config_class(**kw)
        engine = EngineConfig(max_running_requests=a.batch, cuda_graph_max_bs=a.graphs and max(a.graphs, a.batch), max_total_tokens=32768, cpu_isa=a.isa)
        model = ModelConfig(
            path=None if a.model == "demo" else a.model,
            dtype=dtype,
            device=a.device,
            attention_backend=a.attention,
            load_format=a.load_format,
            quantization=a.quantization,
            activation_quantization=a.activations,
        )
        with Engine(SpecfwConfig(model=model, engine=engine, speculative=spec)) as eng:
            kinds = Counter(type(m).__name__ for m in eng.runner.model.modules() if type(m).__name__.endswith("Linear"))
            print(f"\n{spec_name}: target linears " + ", ".join(f"{k} x {n}" for k, n in sorted(kinds.items())))
            chat = [eng.tokenize_chat([{"role": "user", "content": q}]) if a.dataset == "mtbench" else eng.tokenizer(q)["input_ids"] for q in texts]
            run_engine(eng, chat[a.prompts :], SamplingParams(max_new_tokens=24, temperature=0), a.batch, "warm-up")
            phases = Phases(sync)
            phases.install(eng)
            policy = getattr(eng.worker, "policy", None)
            chosen = dict(policy.budget.chosen) if policy is not None else {}
            t0 = time.perf_counter()
            res = run_engine(eng, chat[: a.prompts], params, a.batch, spec_name)
            wall = time.perf_counter() - t0
            if policy is not None:
                chosen = {s: n - chosen.get(s, 0) for s, n in policy.budget.chosen.items()}
        steps = phases.calls["engine step"]
        tokens = sum(len(o) for o in res.outputs)
        results[spec_name] = res.outputs
        same = ""
        if name != "plain" and "plain" in results:
            same = f"; == plain: {sum(x == y for x, y in zip(res.outputs, results['plain']))}/{len(res.outputs)}"
        per_step, per_token = tokens / max(steps, 1), 1e3 * phases.seconds["engine step"] / max(tokens, 1)
        print(
            f"\n## {spec_name}: {steps} decode steps, {per_step:.2f} tokens per step (prefill's token included), "
            f"{per_token:.3f} ms per token in decode steps, {tokens / wall:.1f} tok/s end to end{same}"
        )
        print("| phase | ms per decode step | share |\n|---|---|---|")
        for label, ms, share in phases.table():
            print(f"| {label} | {ms:.3f} | {100 * share:.1f}% |")
        step_ms = 1e3 * phases.seconds["engine step"] / max(steps, 1)
        if name == "plain":
            plain_ms_per_token, plain_step_ms = per_token, step_ms
        elif plain_ms_per_token:
            print(bounds(plain_ms_per_token, plain_step_ms, step_ms, 1e3 * phases.seconds["draft (hook)"] / max(steps, 1), per_step, a.bar))
            print(drafted_steps(phases, steps, plain_step_ms))
        if policy is not None and policy.adaptive:
            print(policy_line(policy, chosen))


def _key_value(item: str) -> tuple[str, object]:
    """``key=value`` with the value as a Python literal where it is one (``16``, ``False``), else a string."""
    key, _, value = item.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def bounds(plain_mpt: float, plain_step: float, step: float, draft: float, tokens: float, bar: float) -> str:
    """What bounds a speculative row, from this run's figures (ms per token / per step): its
    speedup over plain in decode steps, the speedup if drafting were free, the draft's cost as a
    share of a plain step, and the tokens per step this step cost would need for ``bar``."""
    return (
        f"decode speedup over plain {plain_mpt * tokens / step:.2f}x; with a free draft {plain_mpt * tokens / (step - draft):.2f}x; "
        f"draft {100 * draft / plain_step:.0f}% of a plain step; {bar}x needs {bar * step / plain_mpt:.2f} tokens per step at this step's cost "
        f"({bar * (step - draft) / plain_mpt:.2f} with a free draft)"
    )


def drafted_steps(phases: Phases, steps: int, plain_step: float) -> str:
    """The draft's cost on the steps that drafted (the hook runs only there: a step the policy
    played plain, or one whose every request took the draft assist's proposal, never calls it):
    issue 17's draft bar is per drafted step, not averaged over plain-played ones."""
    n = phases.calls.get("draft (hook)", 0)
    if not n:
        return f"drafted steps: 0 of {steps}"
    ms = 1e3 * phases.seconds["draft (hook)"] / n
    return f"drafted steps: {n} of {steps}; draft {ms:.2f} ms a drafted step, {100 * ms / plain_step:.0f}% of a plain step"


def policy_line(policy, chosen: dict[int, int]) -> str:
    """How the draft policy sized this run's steps: the budget's choices by tree size (1: a plain
    step; with confidence pruning 2 is one draft token, the largest the pruned tree), and the batch
    sizes that play the configured tree without it (``fixed_batches``); a step replayed to time its
    size is not a choice, so the counts may fall short of the steps."""
    plays = ", ".join(f"{s}: {n}" for s, n in sorted(chosen.items()))
    fixed = f"; fixed tree at batch sizes {sorted(policy.fixed_batches)}" if policy.fixed_batches else ""
    return f"draft policy choices by tree size: {{{plays}}}{fixed}" + budget_lines(policy)


def budget_lines(policy) -> str:
    """What the budget learned per batch size at the end of the run (tokens per step, ms per step
    and tokens/s per tree size: what its choices rest on) and the share of drafted nodes the
    confidence pruning kept."""
    out = []
    for batch in sorted(policy.budget.cost):
        cost, yields, rates = policy.budget.cost[batch], policy.budget.yields.get(batch, {}), policy.budget.rates(batch)
        cells = [f"{s}: {yields[s].mean:.2f} tok / {1e3 * cost[s].mean:.2f} ms = {rates[s]:.1f} tok/s" for s in sorted(rates)]
        out.append(f"\nbudget at {batch} in flight: " + "; ".join(cells))
    seen = policy.pruning.kept_nodes + policy.pruning.pruned_nodes
    if seen:
        out.append(f"\nconfidence pruning kept {policy.pruning.kept_nodes} of {seen} drafted nodes ({100 * policy.pruning.kept_nodes / seen:.0f}%)")
    return "".join(out)


if __name__ == "__main__":
    main()
