import fcntl
import json
import os
from pathlib import Path

import pytest

import specfw  # noqa: F401  (sets MKL_CBWR before anything starts MKL)
import torch

# Under pytest-xdist (`-n 2`: two workers on the 2-core machines) each worker and every process it
# starts (servers, CLIs, tensor-parallel ranks) computes on one thread: two workers of two OpenMP
# threads each on two cores would preempt each other's spinning threads inside every parallel loop
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ.get("SPECFW_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")))
# Triton kernels run under Triton's interpreter on CPU tensors where there is no GPU (read when a
# kernel module is imported: set before any test imports one)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# `specfw serve` applies tuned defaults from the user's cache (specfw tune): tests never see them
os.environ["SPECFW_TUNED_DIR"] = __import__("tempfile").mkdtemp(prefix="specfw-tuned-")


def make_cfg(**engine_kw):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig

    model_kw = {k[6:]: engine_kw.pop(k) for k in list(engine_kw) if k.startswith("model_")}
    spec = engine_kw.pop("speculative", None) or SpeculativeConfig()
    return SpecfwConfig(model=ModelConfig(**model_kw), engine=EngineConfig(**engine_kw), speculative=spec)


@pytest.fixture(scope="session")
def demo_dir():
    from specfw.demo_model import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def demo_engine():
    from specfw.engine import Engine

    return Engine(make_cfg(max_running_requests=8, max_total_tokens=8192))


def built_once(tmp_path_factory, name: str, build):
    """``build(directory)`` run once per test run for every pytest-xdist worker (each worker has
    its own session): the first worker to get here builds under an OS file lock in the run's shared
    temporary directory, the others wait and read what it wrote (``build``'s JSON-able result).
    The build computes on every core: a worker that waits for it leaves its core idle."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above every worker's own
    out, result = base / name, base / f"{name}.json"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            out.mkdir(exist_ok=True)
            threads = torch.get_num_threads()
            torch.set_num_threads(max(threads, min(2, os.cpu_count() or 1)))
            try:
                result.write_text(json.dumps(build(out)))
            finally:
                torch.set_num_threads(threads)
        return json.loads(result.read_text())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_dir):
    """A 2-layer random Llama with the demo tokenizer (fast unit tests): the plugin test kit's
    ``specfw.testing.tiny_model``, seed 0."""
    from specfw.testing import tiny_model

    return Path(built_once(tmp_path_factory, "tiny-llama", lambda out: str(tiny_model(out, seed=0))))


TINY_DRAFT_CHATS = ["Count to ten.", "Name a color.", "What is two plus two?"]
# raw token-id prompts a drafter can predict (repetitive) and one it cannot
TINY_RAW_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999]]


@pytest.fixture(scope="session")
def tiny_spec_prompts(tiny_model_dir):
    """The speculative contract's prompts for the tiny target: TINY_DRAFT_CHATS as chat contexts
    (the tiny EAGLE heads are trained on them), then TINY_RAW_PROMPTS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)["input_ids"]) for c in TINY_DRAFT_CHATS]
    return chat + TINY_RAW_PROMPTS


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_model_dir, tmp_path_factory):
    """A one-layer standalone draft for the tiny target (its first layer), once per test run."""
    from specfw_plugins.standalone.make_draft import truncate_model

    return truncate_model(tiny_model_dir, tmp_path_factory.mktemp("tiny-draft"), layers=1)


@pytest.fixture(scope="session")
def tiny_eagle_drafts(tiny_model_dir, tmp_path_factory):
    """EAGLE and EAGLE-3 heads and a NextN (MTP) layer for the tiny target, trained on-policy with
    `specfw train` on TINY_DRAFT_CHATS, once per test run (shared by every test and worker that
    needs a draft)."""
    paths = built_once(tmp_path_factory, "tiny-eagle", lambda root: {k: str(v) for k, v in _train_tiny_drafts(tiny_model_dir, root).items()})
    return {k: Path(v) for k, v in paths.items()}


def _train_tiny_drafts(tiny_model_dir, root: Path) -> dict:
    from hydra import compose, initialize_config_module
    from specfw.config_store import register_configs
    from specfw.train.run import run_training

    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in TINY_DRAFT_CHATS))
    register_configs()
    out = {}
    # the NextN layer predicts over the full 49152-token vocabulary at every unrolled step (~5 s a
    # step on a 2-core AVX2 EPYC) and agrees with the target on these chats after ~5 steps: 12 steps
    kinds = [("eagle3", ["draft.aux_layers=[0,1,1]", "draft.draft_vocab_size=2048", "draft.ttt_steps=3"]), ("eagle", []), ("mtp", [])]
    for kind, extra in kinds:
        steps = 12 if kind == "mtp" else 40
        with initialize_config_module("specfw_conf", version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[
                    f"model.path={tiny_model_dir}",
                    f"draft={kind}",
                    f"steps={steps}",
                    "batch_size=3",
                    "lr=3e-3",
                    "warmup_steps=2",
                    "data.source=jsonl",
                    f"data.jsonl={root / 'prompts.jsonl'}",
                    "data.num_prompts=3",
                    "data.max_new_tokens=48",
                    "data.max_len=96",
                    "data.regen_dtype=float32",
                    f"data.cache_dir={root}",
                    f"output_dir={root / kind}",
                    "target_dtype=float32",
                    "save_dtype=float32",
                    f"save_every={steps}",
                ]
                + extra,
            )
        out[kind] = run_training(cfg)
    return out


@pytest.fixture
def tiny_engine(tiny_model_dir):
    from specfw.engine import Engine

    return Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=8, max_total_tokens=4096))


TRIM_ABOVE_MB = 2048


def _rss_mb() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def pytest_runtest_teardown(item, nextitem):
    """Give the memory the finished test freed back to the OS once this process holds more than
    ``TRIM_ABOVE_MB``: glibc keeps freed heap for reuse, and over a whole run a test process grew to
    ~12 GB, much of it freed heap (two pytest-xdist workers of that size exceed a 24 GiB machine; the
    OOM killer ended one; with this a worker still reaches ~8.7 GB of live memory late in a run).
    Measured over tests/engine/test_quant.py, test_hf_equivalence.py and test_overlap.py: 2.6 GB at
    the end without this, 1.6 GB with it."""
    if _rss_mb() > TRIM_ABOVE_MB:
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def pytest_sessionstart(session):
    """Every kernel build the tests load (each ISA this CPU runs: the tests force each one),
    compiled side by side before the first test instead of one after another inside tests (a
    cached build loads in well under a second)."""
    from specfw.kernels import build_all

    build_all(every_isa=True)
