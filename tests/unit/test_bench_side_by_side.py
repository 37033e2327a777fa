"""benchmarks/bench_side_by_side.py: configuration parsing and one end-to-end run on the demo target."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_side_by_side import DecodeClock, FirstTokenStamp, numerics, parse, prompt_chunks  # noqa: E402


# every engine of a run stays alive for its rounds: KV pools for a few short prompts, not the
# default 1 GB each (five engines' pools beside a test worker exceeded a 24 GiB machine)
SMALL_KV = "engine.max_total_tokens=2048"


def test_parse_names_and_typed_keys():
    assert parse("plain=") == ("plain", {})
    assert parse("eagle full=algorithm=eagle,token_map=full,adaptive_draft=False,num_steps=3") == (
        "eagle full",
        {"algorithm": "eagle", "token_map": "full", "adaptive_draft": False, "num_steps": 3},
    )


def test_decode_clock_leaves_each_first_token_out():
    clock = DecodeClock()
    assert clock.rate is None
    clock.add(9, 10.0, 12.0)  # 8 tokens after the first in 2 s
    clock.add(1, 20.0, 20.0)  # one token: no decode phase
    clock.add(5, None, 30.0)  # never timed: left out
    clock.add(5, 40.0, 42.0)
    assert clock.tokens == 12 and clock.seconds == 4.0 and clock.rate == 3.0
    from specfw.bench.drive import RunResult

    # an engine run: 2 requests (9 and 3 tokens), their first tokens apart, gaps 1 + 1 + 2 and 1 + 1 s
    clock.add_run(RunResult(outputs=[], seconds=20.0, output_tokens=12, ttft=[0.5, 0.7], itl=[1.0, 1.0, 2.0, 1.0, 1.0]))
    assert clock.tokens == 22 and clock.seconds == 10.0


def test_first_token_stamp_skips_the_prompt_put():
    stamp = FirstTokenStamp()
    stamp.put([1, 2, 3])  # generate() puts the prompt first
    assert stamp.first is None
    stamp.put([4])
    first = stamp.first
    stamp.put([5])
    assert first is not None and stamp.first == first


def test_rows_are_checked_against_rows_of_the_same_numerics():
    fp32 = numerics({}, "float32")
    assert numerics({"algorithm": "eagle3", "engine.cpu_greedy_head": False}, "float32") == fp32
    assert numerics({"model.quantization": "gguf"}, "float32") == fp32  # the GGUF blocks in place: the fp32 model's bits
    assert numerics({"model.quantization": "none", "model.activation_quantization": "none"}, "float32") == fp32
    a8 = numerics({"model.quantization": "gguf", "model.activation_quantization": "int8"}, "float32")
    assert a8 != fp32 and a8 == numerics({"algorithm": "ngram", "model.quantization": "gguf", "model.activation_quantization": "int8"}, "float32")
    assert numerics({"model.quantization": "int8"}, "float32") not in (fp32, a8)
    assert numerics({"model.dtype": "bfloat16"}, "float32") == numerics({}, "bfloat16") != fp32


@pytest.mark.model
def test_llama_cpp_rows_beside_specfw():
    """A llama.cpp row (the demo's own GGUF) and a quantized specfw pair checked against each other;
    the llama.cpp rows are counted against the fp32 row even where it runs after them in a round."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional benchmark extra (docs/quantization.md)")
    a8 = f"model.quantization=gguf,model.activation_quantization=int8,{SMALL_KV}"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_side_by_side.py"), "--n", "1", "--max-new-tokens", "8", "--rounds", "1",
         f"a8={a8}", "llama=backend=llama.cpp", f"plain={SMALL_KV}", f"a8 ngram=algorithm=ngram,{a8}", "llama pl=backend=llama.cpp,prompt_lookup_num_tokens=4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split("  ")[0].strip(): line for line in r.stdout.splitlines() if " tok/s " in line}
    assert rows.keys() == {"plain", "a8", "a8 ngram", "llama", "llama pl"}
    assert "== a8: yes" in rows["a8 ngram"] and "== plain: yes" in rows["plain"]
    for name in ("llama", "llama pl"):
        assert "== plain: 1/1" in rows[name] or "== plain: 0/1" in rows[name]
        assert "llama.cpp's own timer: " in rows[name] and " ms a decode call" in rows[name]


def test_interleave_splits_each_round_into_turns_of_k_prompts():
    assert prompt_chunks(5, 0) == [[0, 1, 2, 3, 4]]
    assert prompt_chunks(5, 1) == [[0], [1], [2], [3], [4]]
    assert prompt_chunks(5, 2) == [[0, 1], [2, 3], [4]]
    assert prompt_chunks(3, 8) == [[0, 1, 2]]


@pytest.mark.model
def test_interleaved_rounds_with_second_turns_check_outputs():
    """``--interleave 1 --turns 2``: engines alternate prompt by prompt, each prompt's second turn
    right after its first; outputs are still compared row against row."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_side_by_side.py"), "--n", "2", "--max-new-tokens", "6", "--rounds", "1",
         "--interleave", "1", "--turns", "2", f"plain={SMALL_KV}", f"ngram=algorithm=ngram,{SMALL_KV}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if " tok/s " in line]
    assert len(rows) == 2 and all("== plain: yes" in line for line in rows)
    assert "(both turns)" in r.stdout


def test_bad_backend_and_reference_rows_are_refused():
    for configs, says in (
        (["plain=", "x=backend=vllm"], "not one of"),
        (["hf=backend=hf", "plain="], "must be a specfw one"),
        (["--interleave", "-1", "plain="], "--interleave must be >= 0"),
    ):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_side_by_side.py"), *configs], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and says in r.stderr, r.stderr[-1000:]


@pytest.mark.model
def test_runs_configurations_side_by_side_and_checks_outputs():
    """Three specfw engines (one with its own ``engine.cpu_linear_prefetch``), two more in bf16
    (``model.dtype``: checked against the first bf16 row) and one HF transformers row
    (``backend=hf``) in one run."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_side_by_side.py"),
            "--n",
            "1",
            "--max-new-tokens",
            "8",
            "--rounds",
            "1",
            f"plain={SMALL_KV}",
            f"ngram=algorithm=ngram,{SMALL_KV}",
            f"ngram spread=algorithm=ngram,engine.cpu_linear_prefetch=spread,{SMALL_KV}",
            f"plain bf16=model.dtype=bfloat16,{SMALL_KV}",
            f"ngram bf16=algorithm=ngram,model.dtype=bfloat16,{SMALL_KV}",
            "hf pl=backend=hf,prompt_lookup_num_tokens=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("plain ", "ngram ")) and " bf16 " not in line[:11]]
    assert len(lines) == 3 and all("== plain: yes" in line for line in lines)  # a prefetch setting changes no token
    bf16 = [line for line in r.stdout.splitlines() if line.startswith(("plain bf16 ", "ngram bf16 "))]
    assert len(bf16) == 2 and all("== plain bf16: yes" in line for line in bf16)
    assert "x plain bf16 (rounds: " in bf16[1]  # its ratio to the first row of its dtype
    # an HF transformers row (prompt lookup): timed beside them, its outputs compared, not required equal
    hf = [line for line in r.stdout.splitlines() if line.startswith("hf pl ")]
    assert len(hf) == 1 and "tok/s" in hf[0] and "== plain: " in hf[0] and hf[0].rstrip().endswith("/1")
    assert "cpus, torch threads" in r.stdout  # the machine is named
    for line in lines + bf16 + hf:  # every row has its decode phase's rate (8 tokens: 7 after the first)
        rate = line.split("decode")[1].split()[0]
        assert float(rate) > 0, line


def test_long_chats_are_multi_turn_contexts_of_the_asked_length():
    """``--dataset sharegpt-long``'s prompts: ShareGPT conversations up to a user turn, the longest
    prefix of each within [3/4 N, N] by the given length (here characters / 4 stands in for tokens)."""
    from specfw.datasets import long_chats, sharegpt_conversations

    def length(msgs):
        return sum(len(m["content"]) for m in msgs) // 4

    chats = long_chats(length, 6, 2000)
    assert len(chats) == 6
    convs = sharegpt_conversations(4000)
    for chat in chats:
        assert 1500 <= length(chat) <= 2000 and chat[-1]["role"] == "user"
        assert [m["role"] for m in chat] == ["user", "assistant"] * (len(chat) // 2) + ["user"]
        whole = next(c for c in convs if c[: len(chat)] == chat)  # a prefix of a conversation ...
        assert len(whole) <= len(chat) + 1 or length(whole[: len(chat) + 2]) > 2000  # ... the longest that fits
    with pytest.raises(ValueError, match="only"):
        long_chats(length, 10**6, 2000, scan=50)
