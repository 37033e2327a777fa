"""Named engine configurations side by side in one process: every round runs the same prompts
through each engine in turn (engines stay warm, their adaptive policies keep learning; what
drafters learned from the tokens of earlier rounds is flushed before each round: the n-gram trie
would otherwise know the answers), so a machine whose speed drifts 10-30% within minutes drifts
for all of them alike. Prints tok/s per
round, each configuration's median and its ratio to the first (``plain``), its decode tok/s (the
tokens after each request's first over the time after it: 1 / TPOT, the prompts' prefill, the same
work in every row, left out) and that ratio, and checks every greedy output equals the plain
engine's.

    .venv/bin/python benchmarks/bench_side_by_side.py --dataset mtbench --start 40 --n 24 --rounds 2 \\
        plain= eagle=algorithm=eagle "eagle full=algorithm=eagle,token_map=full"

A configuration is ``name=key=value,key=value`` over the speculative keys (``algorithm`` first;
nothing after the name = plain decoding), ``engine.*`` keys (e.g. ``engine.cpu_greedy_head=False``; ``engine.cpu_linear_prefetch``,
one setting of the kernel build per process, is applied again before each of its row's runs, so rows can compare its values) and ``model.*``
keys (e.g. ``model.quantization=gguf``: the GGUF blocks in place, the fp32 model's bits; ``model.dtype=bfloat16``: a row in
another dtype, whose output is checked against the first row of that dtype and whose ratio to that row is printed too).
``--dtype``, ``--batch`` (requests in flight) and ``--max-new-tokens`` apply to all.

``--interleave K`` alternates the rows within a round: every engine runs the first K prompts, then
every engine the next K, and so on (each row's time is the sum of its turns). On a host whose speed
moves 20-50% between minutes (these 2-core VMs), rows run one after another can differ by that much
for no reason of their own (session 62: eagle's fixed tree against its draft policy came out 1.08x
in one such run and 0.90x in the next); ``--interleave 1`` at ``--batch 1`` compares them prompt by
prompt. With ``--batch B`` a turn of K prompts ends at lower concurrency: use K well above B.

``backend=hf`` makes a row of Hugging Face transformers' ``generate`` on the same checkpoint and
dtype (batch 1), the other keys going to ``generate``: what a user would run instead, e.g. HF
prompt lookup beside specfw's ngram on HumanEval:

    .venv/bin/python benchmarks/bench_side_by_side.py --dataset humaneval --n 20 --max-new-tokens 128 \
        plain= ngram=algorithm=ngram "hf=backend=hf" "hf prompt lookup=backend=hf,prompt_lookup_num_tokens=10"

``backend=llama.cpp`` makes a row of llama.cpp (llama-cpp-python, ``pip install '.[bench-llama]'``
built for the CPU: docs/quantization.md) on the demo target's own Q4_1 GGUF file, fed the same
prompt token ids, greedy, ``--threads`` threads, batch 1; ``prompt_lookup_num_tokens=N`` gives it
llama-cpp-python's prompt lookup drafting. Its KV starts empty for every prompt (as HF's does).
What a CPU user would pick for a GGUF, against specfw's fastest exact rows:

    .venv/bin/python benchmarks/bench_side_by_side.py --dataset mtbench --start 40 --n 24 \
        plain= "gguf+a8=model.quantization=gguf,model.activation_quantization=int8" \
        "gguf+a8 eagle3=algorithm=eagle3,model.quantization=gguf,model.activation_quantization=int8" \
        "llama.cpp=backend=llama.cpp" "hf=backend=hf"

HF and llama.cpp rows report how many outputs equal the reference's instead of failing the run
(their kernels are not specfw's, so a near-tie may go the other way; llama.cpp also rounds its
activations to 8 bits).

``--dataset sharegpt-long --context N`` sends multi-turn ShareGPT chats of 3/4 N to N tokens (each
conversation up to the last user turn that fits), where decoding reads a long KV cache every step:

    .venv/bin/python benchmarks/bench_side_by_side.py --dataset sharegpt-long --context 2000 --n 8 \
        --max-new-tokens 128 "gguf+a8=model.quantization=gguf,model.activation_quantization=int8" \
        "llama.cpp=backend=llama.cpp"

``--turns 2`` (MT-bench) runs each question's second turn after the first, as a chat client
would: the conversation so far (the question, the engine's own answer, the second question)
is sent again, so a prefix cache serves all of it but the new question; tok/s counts both
turns' tokens and time. E.g. the prefix cache's worth, plain and speculative:

    .venv/bin/python benchmarks/bench_side_by_side.py --dataset mtbench --turns 2 --n 16 \
        plain= "plain no cache=engine.disable_radix_cache=True" eagle3=algorithm=eagle3 \
        "eagle3 no cache=algorithm=eagle3,engine.disable_radix_cache=True"
"""

from __future__ import annotations

import argparse
import ast
import statistics
import time

import torch
from tqdm import tqdm


def parse(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition("=")
    kw = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            kw[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            kw[k] = v
    return name, kw


def numerics(kw: dict, dtype: str) -> str:
    """What a specfw row's greedy bits depend on: its dtype (``model.dtype``, else ``--dtype``), its
    weight scheme (``gguf`` keeps the fp32 model's bits) and its activation rounding. Rows with the
    same numerics must give the same tokens."""
    quant = kw.get("model.quantization")
    quant = None if quant in (None, "none", "gguf") else quant
    acts = kw.get("model.activation_quantization")
    acts = None if acts in (None, "none") else acts
    return " ".join(x for x in (str(kw.get("model.dtype", dtype)), quant and f"weights {quant}", acts and f"activations {acts}") if x)


def make_engine(kw: dict, dtype: str, batch: int, threads: int):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager

    kw = dict(kw)
    engine = {k.removeprefix("engine."): kw.pop(k) for k in list(kw) if k.startswith("engine.")}
    model = {k.removeprefix("model."): kw.pop(k) for k in list(kw) if k.startswith("model.")}
    spec = SpeculativeConfig()
    if kw:
        algo = kw.pop("algorithm")
        spec = plugin_manager().algorithms[algo].config_class(algorithm=algo, **kw)
        spec.validate()
    engine = EngineConfig(num_threads=threads, max_running_requests=batch, **engine)
    return Engine(SpecfwConfig(model=ModelConfig(**{"dtype": dtype, **model}), speculative=spec, engine=engine))  # model.dtype overrides --dtype


class HFGenerate:
    """HF transformers' greedy ``generate`` on ``model_path`` at batch 1, ``kw`` passed to it."""

    def __init__(self, model_path: str, dtype: str, tokenizer, kw: dict):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        self.tokenizer, self.kw = tokenizer, kw

    def flush_cache(self) -> None:
        pass

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, clock: "DecodeClock") -> list[list[int]]:
        out = []
        for ids in prompts:
            stamp = FirstTokenStamp()
            seq = self.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.eos_token_id, streamer=stamp, **self.kw
            )
            out.append(seq[0, len(ids) :].tolist())
            clock.add(len(out[-1]), stamp.first, time.perf_counter())
        return out


class FirstTokenStamp:
    """A ``generate`` streamer that notes when the first generated token came (its first ``put``
    is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class DecodeClock:
    """The decode phase of a run: per request, the tokens after its first and the time from its first
    token to its last. Their ratio over the run is decode tok/s (1 / TPOT): what speculation changes,
    the prompt's prefill (the same work in every row) left out."""

    def __init__(self):
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, first: float | None, last: float) -> None:
        if first is not None and tokens > 1:
            self.tokens, self.seconds = self.tokens + tokens - 1, self.seconds + last - first

    def add_run(self, res) -> None:
        """A ``specfw.bench.drive.run_engine`` result: its per-request TTFTs and inter-token gaps."""
        self.tokens, self.seconds = self.tokens + res.output_tokens - len(res.ttft), self.seconds + sum(res.itl)

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class LlamaCppGenerate:
    """llama.cpp's greedy decoding of the demo target's Q4_1 GGUF at batch 1 (llama-cpp-python)."""

    def __init__(self, threads: int, kw: dict):
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:
            raise SystemExit(f"backend=llama.cpp needs llama-cpp-python ({e}); see docs/quantization.md for the build") from None
        from specfw.demo_model import demo_gguf_path

        unknown = set(kw) - {"prompt_lookup_num_tokens"}
        if unknown:
            raise SystemExit(f"backend=llama.cpp: unknown keys {sorted(unknown)} (allowed: prompt_lookup_num_tokens)")
        draft = LlamaPromptLookupDecoding(num_pred_tokens=int(kw["prompt_lookup_num_tokens"])) if "prompt_lookup_num_tokens" in kw else None
        self.llm = Llama(str(demo_gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=4096, verbose=False, draft_model=draft)
        self.eval_ms, self.evals = 0.0, 0  # llama.cpp's own timer of its decode calls (no Python around them)

    def flush_cache(self) -> None:
        self.llm.reset()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, clock: DecodeClock) -> list[list[int]]:
        from llama_cpp import llama_perf_context, llama_perf_context_reset

        out = []
        for ids in prompts:
            self.llm.reset()
            llama_perf_context_reset(self.llm._ctx.ctx)
            toks: list[int] = []
            first = None
            for tok in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                toks.append(int(tok))
                first = first or time.perf_counter()
                if len(toks) >= max_new_tokens or tok == self.llm.token_eos():
                    break
            clock.add(len(toks), first, time.perf_counter())
            perf = llama_perf_context(self.llm._ctx.ctx)
            self.eval_ms, self.evals = self.eval_ms + perf.t_eval_ms, self.evals + perf.n_eval
            out.append(toks)
        return out

    def note(self) -> str:
        return f"  (llama.cpp's own timer: {self.eval_ms / max(self.evals, 1):.2f} ms a decode call)" if self.evals else ""


OTHER_BACKENDS = ("hf", "llama.cpp")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", help="name=key=value,... (the first is the reference; name= alone: plain decoding)")
    ap.add_argument("--dataset", choices=["mtbench", "humaneval", "sharegpt-long"], default="mtbench")
    ap.add_argument("--context", type=int, default=2000, help="sharegpt-long: multi-turn chats of 3/4 of this to this many tokens")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, choices=[1, 2], default=1, help="2: MT-bench's second turns too, after each engine's own first answers")
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="each engine in turn runs K prompts (then the next engine the same K): rows alternate within a round, so a host's drift "
        "between minutes hits every row alike (0: each engine runs all prompts in turn)",
    )
    args = ap.parse_args()
    if args.interleave < 0:
        raise SystemExit(f"--interleave must be >= 0 (prompts per engine turn; 0: off), got {args.interleave}")
    if args.turns == 2 and args.dataset != "mtbench":
        raise SystemExit("--turns 2 needs --dataset mtbench (the only set with second turns)")
    torch.set_num_threads(args.threads)
    from specfw.bench.drive import run_engine
    from specfw.datasets import humaneval_prompts, long_chats, mtbench_first_turns, mtbench_questions
    from specfw.machine import cpu_description
    from specfw.sampling import SamplingParams

    configs = dict(parse(c) for c in args.configs)
    if next(iter(configs.values())).get("backend", "specfw") != "specfw":
        raise SystemExit(f"the first configuration is the reference and must be a specfw one, not {next(iter(configs))}")
    for name, kw in configs.items():
        if kw.get("backend", "specfw") not in ("specfw", *OTHER_BACKENDS):
            raise SystemExit(f"{name}: backend={kw['backend']} is not one of {['specfw', *OTHER_BACKENDS]}")
        if kw.get("backend") in OTHER_BACKENDS and args.batch != 1:
            raise SystemExit(f"{name}: backend={kw['backend']} rows run at --batch 1")
    specfw_rows = {name: {k: v for k, v in kw.items() if k != "backend"} for name, kw in configs.items() if kw.get("backend", "specfw") == "specfw"}
    engines = {name: make_engine(kw, args.dtype, args.batch, args.threads) for name, kw in specfw_rows.items()}
    if not engines:
        raise SystemExit("at least one specfw configuration is needed (the first one is the reference)")
    spec_engine = next(iter(engines.values()))
    for name, kw in configs.items():
        other = {k: v for k, v in kw.items() if k != "backend"}
        if kw.get("backend") == "hf":
            engines[name] = HFGenerate(spec_engine.model_path, args.dtype, spec_engine.tokenizer, other)
        elif kw.get("backend") == "llama.cpp":
            engines[name] = LlamaCppGenerate(args.threads, other)
    engines = {name: engines[name] for name in configs}  # the command line's order
    matches: dict[str, list[int]] = {name: [] for name in engines if isinstance(engines[name], (HFGenerate, LlamaCppGenerate))}
    if args.dataset == "sharegpt-long":  # multi-turn chat contexts: where attention over the KV cache weighs
        chats = long_chats(lambda m: len(spec_engine.tokenize_chat(m)), args.start + args.n, args.context)[args.start :]
        texts = chats
    else:
        texts = (mtbench_first_turns if args.dataset == "mtbench" else humaneval_prompts)(args.start + args.n)[args.start :]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    decode_rates: dict[str, list[float | None]] = {name: [] for name in engines}
    first = next(iter(engines))
    # a row's greedy output must equal the first row's of its own numerics
    numerics_of = {name: numerics(configs[name], args.dtype) for name in engines if configs[name].get("backend", "specfw") == "specfw"}
    numerics_first = {}
    for name in numerics_of:
        numerics_first.setdefault(numerics_of[name], name)
    plain_numerics = numerics({}, args.dtype)
    for name in engines:  # HF and llama.cpp rows: counted against specfw's unquantized row of --dtype, else the first row
        numerics_of.setdefault(name, plain_numerics if plain_numerics in numerics_first else numerics_of[first])
    if args.dataset == "sharegpt-long":
        ids = [spec_engine.tokenize_chat(c) for c in chats]
    else:
        ids = [spec_engine.tokenize_chat([{"role": "user", "content": t}]) if args.dataset == "mtbench" else spec_engine.tokenizer.encode(t) for t in texts]
    questions = mtbench_questions()[args.start : args.start + args.n] if args.turns == 2 else []

    def run(eng, prompts, clock: DecodeClock):
        if isinstance(eng, (HFGenerate, LlamaCppGenerate)):
            return eng.generate(prompts, args.max_new_tokens, clock)
        res = run_engine(eng, prompts, params, args.batch, "requests")
        clock.add_run(res)
        return res.outputs

    def second_turn(question, answer):
        """The conversation after the first answer, ending with the second question."""
        text = spec_engine.tokenizer.decode(answer, skip_special_tokens=True)
        turns = [question["turns"][0], text, question["turns"][1]]
        return spec_engine.tokenize_chat([{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)])

    chunks = prompt_chunks(len(ids), args.interleave)
    with tqdm(total=args.rounds * len(engines) * len(chunks), desc="runs") as bar:
        for _ in range(args.rounds):
            references: dict[str, list] = {}  # numerics -> the first specfw row's outputs this round
            others: dict[str, list] = {}  # HF and llama.cpp rows' outputs this round
            clocks = {name: DecodeClock() for name in engines}
            seconds = dict.fromkeys(engines, 0.0)
            outputs: dict[str, list] = {name: [] for name in engines}
            for eng in engines.values():
                eng.flush_cache()  # the n-gram trie must not remember the last round's outputs of these prompts
            for chunk in chunks:
                for name, eng in engines.items():
                    backend = getattr(getattr(eng, "runner", None), "backend", None)
                    if hasattr(backend, "set_linear_prefetch"):  # process-wide: this row's value (auto unless it sets one)
                        backend.set_linear_prefetch(str(configs[name].get("engine.cpu_linear_prefetch", "auto")))
                    t0 = time.perf_counter()
                    tokens = run(eng, [ids[i] for i in chunk], clocks[name])
                    if args.turns == 2:
                        tokens = tokens + run(eng, [second_turn(questions[i], t) for i, t in zip(chunk, tokens)], clocks[name])
                    seconds[name] += time.perf_counter() - t0
                    outputs[name] += tokens
                    bar.update()
            for name in engines:
                tokens = outputs[name]
                rates[name].append(sum(len(t) for t in tokens) / seconds[name])
                decode_rates[name].append(clocks[name].rate)
                if name in matches:  # counted after the round: the specfw row it is counted against may come later
                    others[name] = tokens
                elif tokens != references.setdefault(numerics_of[name], tokens):
                    raise SystemExit(f"{name}: greedy output differs from {numerics_first[numerics_of[name]]}'s")
            for name, tokens in others.items():
                matches[name].append(sum(a == b for a, b in zip(tokens, references[numerics_of[name]])))
    turns = " (both turns)" if args.turns == 2 else ""
    dataset = args.dataset + (f" (prompts {min(map(len, ids))}-{max(map(len, ids))} tokens)" if args.dataset == "sharegpt-long" else "")
    where = f"{dataset} {args.start + 1}-{args.start + args.n}{turns} x {args.max_new_tokens} tokens, {args.batch} in flight, {args.dtype}"
    print(f"\n{where}, on {cpu_description()}")
    print("tok/s: every token over the whole run; decode: the tokens after each request's first over the time after it (1 / TPOT)")
    base = statistics.median(rates[first])
    decode_base = median_or_none(decode_rates[first])
    for name, r in rates.items():
        rounds = ", ".join(f"{x / y:.3f}" for x, y in zip(r, rates[first]))
        same = f"{min(matches[name])}/{len(texts)}" if name in matches else "yes"
        ref = numerics_first[numerics_of[name]]
        own = ""
        if ref != first:  # other numerics: its ratio to the first row of those too
            own = f", {statistics.median(r) / statistics.median(rates[ref]):.3f}x {ref} (rounds: {', '.join(f'{x / y:.3f}' for x, y in zip(r, rates[ref]))})"
        note = engines[name].note() if isinstance(engines[name], LlamaCppGenerate) else ""
        dec = median_or_none(decode_rates[name])
        decode = f"decode {dec:7.1f} tok/s {dec / decode_base:.3f}x" if dec and decode_base else "decode       - tok/s       -"
        total = f"{statistics.median(r):7.1f} tok/s  {statistics.median(r) / base:.3f}x {first}"
        print(f"{name:24s} {total}  {decode}  (rounds: {rounds}){own}  == {ref}: {same}{note}")


def prompt_chunks(n: int, interleave: int) -> list[list[int]]:
    """The prompts each engine runs per turn within a round: ``--interleave K`` gives K at a time
    (every engine runs the first K, then every engine the next K, ...: a host whose speed moves
    between minutes moves for every row alike); 0 gives all of them in one turn per engine."""
    if interleave <= 0:
        return [list(range(n))]
    return [list(range(i, min(i + interleave, n))) for i in range(0, n, interleave)]


def median_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


if __name__ == "__main__":
    main()
