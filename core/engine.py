"""The engine: ``step()`` = schedule → run → update.

* **schedule** (``Scheduler.schedule``): which requests run, prefill or decode, with this step's
  KV slots reserved per request (and who was retracted or cannot grow any further);
* **run** (the worker: plain or speculative): one ``StepResult`` per request -- tokens to emit
  and which of the reserved KV entries to keep;
* **update** (``Scheduler.update``): the scheduler applies the results to the KV tables and the
  requests; the engine turns them into ``RequestOutput`` (detokenizer, stop strings, metrics).

Only the scheduler changes KV tables and request states."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .backends import backend_from_config, target_quantization
from .compile import compile_layers
from .graphs import graph_rows
from .detokenizer import IncrementalDetokenizer
from .device import kv_budget_from_fraction, resolve_device
from .kv_cache import KVPool
from .model_loader import DTYPES, load_model, model_config
from .model_runner import PLAIN_BATCH_ROWS, ModelRunner
from .prefix_cache import PrefixCache
from .overlap import OverlapScheduler, chain_for_overlap, check_overlap, overlap_requested
from .quarantine import Quarantine
from .request import Request
from .sampling import SamplingParams, TokenLogprob
from .scheduler import ScheduledBatch, Scheduler, StepUpdate
from .stats import EngineStats, Load
from .step import StepResult
from .tp import partition, shard_model, start_leader, tp_size
from .worker import PlainWorker

logger = logging.getLogger("specfw")


@dataclass
class RequestOutput:
    """Incremental output of one request after a step."""

    rid: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    meta: dict = field(default_factory=dict)


@dataclass
class Completion:
    """Final result of ``Engine.generate``."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    meta: dict


def speculative_tree_shape(cfg, hf_config):
    """The validated tree shape of the configured speculative algorithm (None: plain decoding)."""
    from .config import speculative_config
    from .speculative.config import resolve_tree_shape

    spec = chain_for_overlap(speculative_config(cfg), cfg)
    return resolve_tree_shape(spec, hf_config) if hasattr(spec, "resolve_shape") else None


def _kv_bytes(engine_cfg, device) -> float:
    """The KV pool's memory budget: SGLang's ``mem_fraction_static`` rule where it is set, else
    ``kv_cache_memory_gb``."""
    fraction = getattr(engine_cfg, "mem_fraction_static", None)
    return kv_budget_from_fraction(device, fraction) if fraction else engine_cfg.kv_cache_memory_gb * 2**30


def load_target(cfg, device: torch.device):
    """The target as ``cfg.model`` says (every TP rank loads it the same way, then keeps its shard)."""
    return load_model(
        cfg.model.path,
        dtype=str(getattr(cfg.model.dtype, "value", cfg.model.dtype)),
        revision=cfg.model.revision,
        max_positions=cfg.model.context_length,
        device=device,
        quantization=target_quantization(cfg, device),
        load_format=str(getattr(cfg.model, "load_format", "auto")),
        trust_remote_code=bool(getattr(cfg.model, "trust_remote_code", False)),
    )


def target_config(cfg):
    """The target's transformers config as ``load_target`` reads it, without its weights."""
    load_format = str(getattr(cfg.model, "load_format", "auto"))
    return model_config(cfg.model.path, cfg.model.revision, load_format, bool(getattr(cfg.model, "trust_remote_code", False)))[1]


class Engine:
    def __init__(self, cfg, worker_factory=None):
        """``cfg``: a SpecfwConfig (OmegaConf or dataclass). ``worker_factory(engine)`` builds the
        worker; default: the speculative worker from the plugin registry, or plain decoding."""
        self.cfg = cfg
        check_overlap(cfg)
        if cfg.engine.num_threads:
            torch.set_num_threads(cfg.engine.num_threads)
        dtype = str(getattr(cfg.model.dtype, "value", cfg.model.dtype))
        self.device = resolve_device(str(getattr(cfg.model, "device", "auto")))
        self.tp = None
        if tp_size(cfg) > 1:  # the other ranks start first: they load, shard and wait for "init" while this one loads (core/tp)
            partition(target_config(cfg), 0, tp_size(cfg))  # a model that cannot be split fails before any rank starts
            self.tp = start_leader(cfg, self.device)
        try:
            self._build(cfg, dtype, worker_factory)
        except BaseException:
            if self.tp is not None:
                self.tp.stop()  # the ranks end once they have loaded or set up (or failed to): none waits for ever
            raise

    def _build(self, cfg, dtype: str, worker_factory) -> None:
        """Everything after the ranks start: the target, the kernels, the runner, the worker, the
        scheduler."""
        loaded = load_target(cfg, self.device)
        self.loaded, self.tokenizer, self.model_path = loaded, loaded.tokenizer, loaded.path
        self.dtype = DTYPES[dtype]
        self.tree_shape = speculative_tree_shape(cfg, loaded.hf_config)
        # batch-invariant linear plans are timed for the typical multi-row forward: a draft tree
        # (batch 1, the speculative regime) or a batch of plain decode steps (padding to 16 rows costs
        # more than to 8: docs/benchmarks.md, design figures)
        typical_rows = self.tree_shape.num_draft_tokens if self.tree_shape else PLAIN_BATCH_ROWS
        layer0 = loaded.model.layers[0]
        num_slots = cfg.engine.max_total_tokens or KVPool.slots_for_budget(
            _kv_bytes(cfg.engine, self.device), loaded.model.num_layers, layer0.n_kv, layer0.head_dim, self.dtype
        )
        if self.tp is not None:
            shard_model(loaded.model, loaded.hf_config, self.tp)
            self.tp.send("init", num_slots, dtype, (1, typical_rows))
        self.backend = backend_from_config(cfg.engine, self.device, cfg)
        self.runner = ModelRunner(loaded.model, loaded.hf_config, num_slots, self.dtype, backend=self.backend, timed_rows=(1, typical_rows), tp=self.tp)
        rows = graph_rows(cfg.engine, self.device, self.backend, self.tree_shape, tp_size(cfg))
        if rows:
            self.runner.enable_graphs(rows)
        if getattr(cfg.engine, "torch_compile", False):
            compile_layers(self.runner, cfg.engine.torch_compile_max_bs)
        self.stats = EngineStats(decode_log_interval=cfg.engine.decode_log_interval)
        self.worker = worker_factory(self) if worker_factory else self._default_worker()
        if self.runner.graphs is not None and self.runner.graphs.capture and hasattr(self.worker, "capture_graphs"):
            self._capture_graphs()
        self.scheduler = Scheduler(
            self.runner.kv,
            cfg.engine.max_running_requests,
            cfg.engine.max_prefill_tokens,
            self.runner.max_context,
            slots_per_decode=self.worker.slots_per_decode,
            max_queued_requests=cfg.engine.max_queued_requests,
            prefix_cache=None if getattr(cfg.engine, "disable_radix_cache", False) else PrefixCache(),
            prefix_to_reuse=getattr(self.worker, "prefix_to_reuse", None),
        )
        self.quarantine = Quarantine()
        self.eos_token_ids = tuple(sorted({i for i in [self.tokenizer.eos_token_id, getattr(loaded.hf_config, "eos_token_id", None)] if isinstance(i, int)}))
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.model_name = cfg.model.served_model_name or self.model_path.name
        self.overlap = OverlapScheduler(self) if overlap_requested(cfg) else None
        logger.info(
            "engine ready: model=%s dtype=%s device=%s kernels=%s kv_slots=%d worker=%s",
            self.model_name,
            dtype,
            self.device,
            self.backend.describe(),
            num_slots,
            type(self.worker).__name__,
        )

    def _capture_graphs(self) -> None:
        """Every CUDA graph a step can replay, captured before the first request (as SGLang does):
        the target's forwards per row bucket, then the drafter's (``specfw_capture_graphs``)."""
        t0 = time.perf_counter()
        made = self.worker.capture_graphs()
        logger.info("captured %d CUDA graphs at startup in %.1f s", made, time.perf_counter() - t0)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the overlap scheduler's compute thread and the other tensor-parallel ranks."""
        if self.overlap is not None:
            self.overlap.close()
        if self.tp is not None:
            self.tp.stop()
            self.tp = None

    def _default_worker(self):
        from .plugins import build_worker

        return build_worker(self) or PlainWorker(self.runner)

    # ---- requests -----------------------------------------------------------------------
    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def make_request(self, prompt: str | list[int], params: SamplingParams, rid: str | None = None) -> Request:
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        kw = {"rid": rid} if rid else {}
        eos = () if params.ignore_eos else self.eos_token_ids
        req = Request(prompt_ids=ids, params=params.validate(), eos_token_ids=eos, **kw)
        self.scheduler.check(req)
        return req

    def add_request(self, req: Request) -> Request:
        self.scheduler.add(req)
        self._detok[req.rid] = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        self.stats.on_arrival()
        return req

    def abort(self, rid: str) -> RequestOutput | None:
        req = self.scheduler.remove(rid)
        if req is None:
            return None
        return self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or (self.overlap is not None and self.overlap.has_work)

    def flush_cache(self) -> bool:
        """Empty the prefix cache and forget what drafting learned from earlier requests' tokens
        (``specfw_flush_cache``: the n-gram trie), as SGLang's ``/flush_cache``; only with no
        request in flight. Returns whether it flushed."""
        if self.has_work:
            return False
        self.scheduler.flush_cache()
        flush = getattr(self.worker, "flush_cache", None)
        if flush is not None:
            flush()
        return True

    # ---- the step -----------------------------------------------------------------------
    def step(self, deliver=None) -> list[RequestOutput]:
        """One step; returns its outputs. ``deliver(outputs)``, if given, may be called from another
        thread during the step with outputs not returned (the overlap scheduler streams step N-1's
        outputs while step N computes, core/overlap.py; without it ``deliver`` is not used)."""
        overlap = self.overlap
        batch = self.scheduler.schedule()
        if batch is None:
            return overlap.flush() if overlap else []
        for r in batch.retracted:
            self.worker.release(r)
        if batch.reqs:
            batch = self.quarantine.narrow(batch, self.scheduler)
        if overlap:
            overlap.start(deliver)  # step N-1's outputs on the output thread, while this step computes
        t0, error = time.perf_counter(), None
        try:
            if batch.reqs:
                try:
                    results = self.worker.run(batch)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others
                    error = exc
                else:
                    updates = self.scheduler.update(batch, results)
        finally:
            outs = overlap.join() if overlap else []
        outs += [self._finish(r, "length") for r in batch.starved if r.rid in self._detok]
        if not batch.reqs:
            self.scheduler.update(batch, [])
            return outs
        if error is not None:
            return outs + self._step_failed(self._unfinished(batch), error)
        self.quarantine.passed(batch)
        self.stats.on_step(batch, results, time.perf_counter() - t0, self._load())
        if overlap:
            overlap.hold(batch, results, updates)  # its outputs are made during the next step
            return outs
        return outs + self._outputs(batch, results, updates)

    def _unfinished(self, batch: ScheduledBatch) -> ScheduledBatch:
        """A failed batch less the requests that finished while it ran (overlap: a stop string in
        the last step's outputs); their reservations are freed."""
        keep = [i for i, r in enumerate(batch.reqs) if r.rid in self._detok]
        if len(keep) < len(batch.reqs):
            for i, slots in enumerate(batch.new_slots):
                if i not in keep:
                    self.scheduler.allocator.free(slots)
            batch.reqs = [batch.reqs[i] for i in keep]
            batch.new_slots = [batch.new_slots[i] for i in keep]
        return batch

    def _load(self):
        used = self.scheduler.kv_in_use  # the prefix cache's unlocked entries are free room
        return Load(len(self.scheduler.running), len(self.scheduler.waiting), used, used / self.runner.allocator.num_slots)

    def _step_failed(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """Roll the batch back; alone, its request is the cause and fails, else its requests
        become suspects that run alone next (see ``quarantine.py``)."""
        self.stats.step_failures += 1
        if not batch.reqs:  # every request of it finished meanwhile
            self.scheduler.rollback(batch)
            return []
        logger.error("%s step of %d request(s) failed: %s: %s", batch.kind, len(batch.reqs), type(exc).__name__, exc, exc_info=len(batch.reqs) == 1)
        self.scheduler.rollback(batch)
        for r in batch.reqs:
            self.worker.release(r)
        if len(batch.reqs) > 1:
            self.quarantine.suspect(batch, self.scheduler)
            return []
        return [self._finish(batch.reqs[0], "error", error=f"{type(exc).__name__}: {exc}")]

    def _outputs(self, batch: ScheduledBatch, results: list[StepResult], updates: list[StepUpdate], retire=None) -> list[RequestOutput]:
        """The step's ``RequestOutput``s. A finishing request's final output is made here; ``retire``
        (default: at once) takes it out of the scheduler and the worker (the overlap scheduler
        defers that until the step computing beside this returned)."""
        outs = []
        now = time.monotonic()
        for req, res, upd in zip(batch.reqs, results, updates):
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.on_first_token(now - req.arrival_time)
            if res.num_draft:  # one definition of accept length, as in /metrics: drafted steps only
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += res.num_accepted
            new, reason = upd.new_tokens, upd.finish_reason
            detok = self._detok[req.rid]
            if detok.update(req.output_ids[: upd.num_output]):  # a stop string
                reason = "stop"
            logprobs = res.logprobs[: len(new)]
            if reason is None:
                outs.append(self._output(req, new, detok.delta(False), False, None, logprobs, upd.num_output))
            elif retire is None:
                outs.append(self._finish(req, reason, new, logprobs))
            else:
                retire(req, reason, None, upd.num_output)
                outs.append(self._final_output(req, reason, new, logprobs, upd.num_output))
        return outs

    def _finish(self, req: Request, reason: str, new: list[int] | None = None, logprobs=None, error=None) -> RequestOutput:
        """Final output of a request, retired at once (out of the queues, KV freed, worker state released)."""
        self._retire(req, reason, error)
        return self._final_output(req, reason, new, logprobs)

    def _retire(self, req: Request, reason: str, error: str | None = None) -> None:
        """The scheduler finishes the request (out of the waiting queue or running set, KV freed), the
        worker drops its state."""
        self.scheduler.remove(req.rid)
        self.scheduler.finish(req, reason, error)
        self.quarantine.forget(req)
        self.worker.release(req)
        self.stats.on_finish(req)

    def _final_output(self, req: Request, reason: str, new, logprobs, num_output: int | None = None, error: str | None = None) -> RequestOutput:
        detok = self._detok.pop(req.rid, None)
        delta = detok.delta(True) if detok else ""
        req.final_text = detok.text if detok else ""
        return self._output(req, new or [], delta, True, reason, logprobs or [], num_output, error)

    def _output(self, req, new, delta, finished, reason, logprobs, num_output: int | None = None, error: str | None = None) -> RequestOutput:
        meta = {"spec_verify_ct": req.spec_verify_ct, "spec_accept_length": round(req.spec_accept_length, 4)} if req.spec_verify_ct else {}
        if req.cached_tokens is not None:  # SGLang's meta_info key: prompt tokens taken from the prefix cache
            meta["cached_tokens"] = req.cached_tokens
        n = len(req.output_ids) if num_output is None else num_output
        return RequestOutput(req.rid, new, delta, finished, reason, error or req.error, list(logprobs), len(req.prompt_ids), n, meta)

    # ---- offline convenience ------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams], progress: bool = False) -> list[Completion]:
        """Run prompts through continuous batching to completion; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(self.make_request(p, sp)) for p, sp in zip(prompts, plist)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        while self.has_work:
            for o in self.step():
                if o.finished and bar:
                    bar.update()
        if bar:
            bar.close()
        return [
            Completion(r.rid, r.final_text, list(r.output_ids), r.finish_reason, len(r.prompt_ids), self._output(r, [], "", True, r.finish_reason, []).meta)
            for r in reqs
        ]
