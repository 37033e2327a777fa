"""The overlap scheduler (``engine.overlap_schedule``; SGLang's SpecV2, ``SGLANG_ENABLE_SPEC_V2``).

Step N computes on the engine thread (the worker's forward, drafting and verification, then the
scheduler's ``update`` that commits the step's tokens and KV) while an output thread turns step
N-1 into outputs: detokenization, stop strings, logprobs, ``RequestOutput``s, metrics. Its
outputs are returned (streamed by the server) while step N is still computing.

* **Future map.** Batch N+1 is scheduled holding requests, not tokens: a request's inputs are
  read from its state when step N+1 starts computing, after step N was committed, so
  step N's accepted tokens resolve where they are used (what SGLang's future token map does
  for its device-side batch). KV reservations are position-independent slots.
* **One step late.** A request that a stop string ends at step N-1 is known only while step N
  computes; that step's tokens for it are dropped when the step returns (SGLang's overlap
  scheduler finishes requests one step late too). Eos, stop ids and lengths are decided in
  ``update`` with the step, so they are never late.
* **Thread rules.** The output thread touches neither the scheduler nor the worker: finishing a
  request (out of the scheduler, KV freed, drafter state released) waits until the step returned
  (``_settle``); aborts, admissions and retractions happen between steps as without overlap.

Speculative decoding with it takes chains only (``speculative.topk=1``, SGLang's rule; unset tree
keys become the auto depth with topk=1); n-gram trees are refused, as SGLang disables overlap for
NGRAM. Why it is off by default on CPUs: docs/overlap.md."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .config import ConfigError

logger = logging.getLogger("specfw")

ENV = "SGLANG_ENABLE_SPEC_V2"


def _env_on() -> bool:
    return os.environ.get(ENV, "").lower() in ("1", "true", "yes", "on")


def _algorithm(cfg) -> str:
    spec = getattr(cfg, "speculative", None)
    try:
        return str(spec.get("algorithm", "none") if hasattr(spec, "get") else getattr(spec, "algorithm", "none"))
    except Exception:  # noqa: BLE001 - no speculative node (MISSING)
        return "none"


def _builds_trees(cfg) -> bool:
    """An algorithm whose tree is not shaped by ``topk`` (n-gram: the trie's breadth)."""
    from .config import speculative_config

    spec = speculative_config(cfg)
    return "topk" in getattr(type(spec), "unused_keys", ())


def _assist(cfg):
    spec = cfg.speculative
    return spec.get("draft_assist") if hasattr(spec, "get") else getattr(spec, "draft_assist", None)


def overlap_requested(cfg) -> bool:
    """``engine.overlap_schedule``, or SGLang's env var for a speculative algorithm that drafts
    chains (for n-gram trees the env var is ignored with a warning, as SGLang does)."""
    if bool(getattr(cfg.engine, "overlap_schedule", False)):
        return True
    if not _env_on() or _algorithm(cfg) == "none":
        return False
    if _builds_trees(cfg):
        logger.warning("%s is set but speculative=%s drafts trees: the overlap scheduler stays off (SGLang disables it for NGRAM)", ENV, _algorithm(cfg))
        return False
    if _assist(cfg) is not None:
        logger.warning("%s is set but speculative.draft_assist=%s makes trees: the overlap scheduler stays off", ENV, _assist(cfg))
        return False
    return True


def check_overlap(cfg) -> None:
    """Startup rules (ConfigError naming the key): chains only, one tensor-parallel rank."""
    if not overlap_requested(cfg):
        return
    if int(getattr(cfg.model, "tp_size", 1)) > 1:
        raise ConfigError("engine.overlap_schedule", f"needs model.tp_size=1 (got {cfg.model.tp_size}); allowed with tensor parallelism: false")
    if _algorithm(cfg) == "none":
        return
    if _builds_trees(cfg):
        algo = _algorithm(cfg)
        raise ConfigError("engine.overlap_schedule", f"speculative={algo} drafts trees, the overlap scheduler takes topk=1 chains; allowed: false")
    topk = cfg.speculative.get("topk") if hasattr(cfg.speculative, "get") else getattr(cfg.speculative, "topk", None)
    if topk is not None and int(topk) != 1:
        raise ConfigError("speculative.topk", f"the overlap scheduler (engine.overlap_schedule / {ENV}) takes chains only: allowed 1, got {topk}")
    if _assist(cfg) is not None:
        raise ConfigError(
            "speculative.draft_assist",
            f"the overlap scheduler (engine.overlap_schedule / {ENV}) takes chains only, "
            "and an assist's chain merged into the drafter's makes a tree; allowed: null",
        )


def chain_for_overlap(spec, cfg):
    """With overlap on and no tree key given, the algorithm's auto depth as a topk=1 chain."""
    if not overlap_requested(cfg) or not hasattr(spec, "resolve_shape") or "topk" in getattr(type(spec), "unused_keys", ()):
        return spec
    if all(getattr(spec, k) is None for k in ("num_steps", "topk", "num_draft_tokens")):
        spec.topk = 1
        logger.info("overlap scheduler: speculative.topk=1 (chains only); num_steps from the auto shape")
    return spec


@dataclass
class _Done:
    """A computed step whose outputs are made while the next step computes."""

    batch: object
    results: list
    updates: list


class OverlapScheduler:
    """Runs an engine's steps with step N's compute beside step N-1's output processing."""

    def __init__(self, engine):
        self.engine = engine
        # the step computes on the engine thread (its OpenMP team stays the only busy one: a
        # second thread running kernels halved the step rate here, docs/overlap.md); the
        # outputs are made on this one
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specfw-outputs")
        self.pending: _Done | None = None  # the last computed step, outputs not yet made
        self.retiring: list = []  # (req, reason, error, num_output): finished by its outputs, settled after the step
        self._outputs = None  # the output thread's future while a step computes
        logger.info("overlap scheduler on: step N computes while step N-1 is detokenized and streamed (docs/overlap.md)")

    @property
    def has_work(self) -> bool:
        return self.pending is not None

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # ---- around one step (Engine.step) ----------------------------------------------------
    def start(self, deliver=None) -> None:
        """Make the held step's outputs on the output thread (handed to ``deliver`` as soon as made)."""
        self._outputs = self.pool.submit(self._drain, deliver) if self.pending is not None else None

    def join(self) -> list:
        """The step returned: wait for the outputs, then retire what they finished."""
        future, self._outputs = self._outputs, None
        try:
            return future.result() if future is not None else []
        finally:
            self._settle()

    def hold(self, batch, results, updates) -> None:
        self.pending = _Done(batch, results, updates)

    def flush(self) -> list:
        """Nothing to compute: the held step's outputs, made here."""
        outs = self._drain()
        self._settle()
        return outs

    # ---- output thread (or the engine thread when nothing computes) -----------------------
    def _drain(self, deliver=None) -> list:
        """The pending step's outputs (handed to ``deliver`` at once if given); finishing requests
        are retired after the running step."""
        done, self.pending = self.pending, None
        if done is None:
            return []
        eng = self.engine
        live = [i for i, r in enumerate(done.batch.reqs) if r.rid in eng._detok]  # not aborted meanwhile
        pick = lambda xs: [xs[i] for i in live]  # noqa: E731
        batch = type(done.batch)(done.batch.kind, pick(done.batch.reqs))
        outs = eng._outputs(batch, pick(done.results), pick(done.updates), retire=self._retire_later)
        if deliver is None or not outs:
            return outs
        deliver(outs)
        return []

    def _retire_later(self, req, reason: str, error: str | None, num_output: int) -> None:
        self.retiring.append((req, reason, error, num_output))

    def _settle(self) -> None:
        """The step returned: requests finished while it computed leave the scheduler and the
        worker; tokens a request got after its stop string are dropped."""
        retiring, self.retiring = self.retiring, []
        for req, reason, error, num_output in retiring:
            del req.output_ids[num_output:]
            self.engine._retire(req, reason, error)
