"""The algorithm author's contract: pluggy hook specifications of specfw.

Two kinds of plugin objects exist:

* **Distribution plugins** — the object an entry point in the ``specfw`` group points to (a
  module, usually). They implement :func:`specfw_register_algorithms` and may implement the
  observer hooks. They are registered once per process.
* **Algorithm runtimes** — the object an algorithm's factory returns for one engine. It
  implements the per-step hooks (drafting, optionally tree building / verification, and the
  lifecycle hooks). Only the runtime of the configured algorithm is registered with the
  engine's plugin manager, so hook implementations never need to check which algorithm is
  active, and the core never branches on an algorithm's name.

The core itself registers :mod:`specfw.speculative.defaults`, whose ``specfw_build_tree`` and
``specfw_verify`` are ``trylast``: an algorithm that only drafts gets tree building and
verification for free; one that returns a result from those hooks overrides them.

All per-step hooks run on the engine thread, one at a time, also under the overlap scheduler
(``engine.overlap_schedule``: only output making moves to another thread; ``specfw_release`` of a
request that finished meanwhile is called after the step returned). Model tensors (``hidden``, ``aux_hidden``,
``logits``) are on the runner's device (``ctx.runner.device``); ``DraftCandidates`` and
``DraftTree`` are host (CPU) tensors, like every other piece of scheduling metadata
(``specfw.device``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .speculative.types import DraftCandidates, DraftTree, SpecContext, StepPlan, VerifyResult
    from .request import Request

PROJECT = "specfw"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---- registration (distribution plugins) ------------------------------------------------
@hookspec
def specfw_register_algorithms(register: Callable) -> None:
    """Register speculative algorithms.

    Called once when the plugin manager is built, before Hydra composes the config.

    :param register: ``register(name, config_class, factory, description="")``.
        ``name`` becomes the option ``speculative=<name>``; ``config_class`` is a dataclass
        deriving from :class:`specfw.speculative.config.SpecAlgoConfig` (its fields are the option's
        keys; Hydra validates them); ``factory(ctx: SpecContext)`` builds the algorithm runtime
        (an object with hook implementations) for one engine, loading draft weights if any.
    """


@hookspec
def specfw_register_trainers(register: Callable) -> None:
    """Register draft trainers for ``specfw train draft=<kind>``.

    Called once when the plugin manager is built, before Hydra composes the config.

    :param register: ``register(kind, config_class, factory, description="", demo_draft=None,
        copy_tokenizer=False)``. ``kind`` becomes the option ``draft=<kind>`` (by convention the
        algorithm's name); ``config_class`` is a dataclass deriving from
        :class:`specfw.train.config.DraftTrainConfig` (its ``check(draft)`` staticmethod validates
        the composed node); ``factory(cfg, teacher, examples)`` returns the trainer the core's loop
        drives (see :class:`specfw.train.common.ModuleTrainer`); ``demo_draft`` is the committed
        draft directory ``init_draft=demo`` starts from; ``copy_tokenizer`` copies the target's
        tokenizer files into the exported draft.
    """


@hookspec
def specfw_register_draft_assists(register: Callable) -> None:
    """Register draft assists for ``speculative.draft_assist=<name>``.

    A draft assist proposes extra candidates beside any algorithm's drafter (e.g. the n-gram
    trie's continuation of the context beside an EAGLE head's tree); the core merges them into
    the drafter's candidates before the draft policy's cut (``speculative/merge.py``).

    :param register: ``register(name, factory, description="")``. ``factory(ctx: SpecContext)``
        builds the assist runtime for one engine: an object implementing
        :func:`specfw_assist_draft` and optionally the lifecycle hooks (``specfw_on_accept``,
        ``specfw_release``); it is registered beside the algorithm's runtime.
    """


# ---- drafting ---------------------------------------------------------------------------
@hookspec(firstresult=True)
def specfw_draft(ctx: "SpecContext", reqs: "list[Request]", plan: "StepPlan") -> "list[DraftCandidates]":
    """Propose draft candidates for each running request (one entry per request, in order).

    Called once per decode step before the target's verify forward, except on steps the draft
    policy runs without a draft (``plan.size == 1``, ``speculative.adaptive_draft``): drafters
    must catch up from ``req.seq_ids`` rather than assume they saw every step. The candidates
    carry tokens, scores and parent links (a tree rooted at the request's last sampled token,
    index -1); scores rank candidates (higher = likelier to be accepted) when the policy cuts
    the tree to this step's size. An empty candidate list means "no draft" (the step decodes one
    token). Implemented by every algorithm runtime.

    ``reqs`` may be a subset of the running batch: with a draft assist (``speculative.draft_assist``)
    the requests whose assist proposal is confident enough are not passed to the drafter that step.

    :param ctx: engine-wide speculative context (config, tree shape, target runner, stats).
    :param reqs: running requests; ``req.seq_ids[-1]`` is the root token (sampled, no KV yet).
    :param plan: this step's :class:`~specfw.speculative.types.StepPlan`: at most ``plan.size - 1``
        candidates are verified, ``plan.depth`` is the useful draft depth and candidates scoring
        below ``plan.score_floor`` will be pruned, so beams below it need not be expanded.
        (A hook implementation may leave ``plan`` out of its signature.)
    """


@hookspec(firstresult=True)
def specfw_assist_draft(ctx: "SpecContext", reqs: "list[Request]", plan: "StepPlan") -> "list[DraftCandidates]":
    """A draft assist's candidates for each request (one entry per request, in order; empty =
    nothing to add), called on the steps that draft, before :func:`specfw_draft`.

    The core merges each request's tree into the drafter's (a node with the same parent and token
    as an existing one is that node, keeping the higher score) and cuts the result by score to
    ``plan.size - 1``. Scores must be on the drafter's scale: cumulative log-probabilities that
    the path is accepted. The draft policy reads them as such: where the assist's expected
    accepted tokens (the sum of ``exp(score)`` over its nodes) reach what a drafted step has been
    accepting on average, the drafter is not run for that request this step.
    Implemented by draft assists only (``specfw_register_draft_assists``), never by algorithms.
    """


# ---- tree building ----------------------------------------------------------------------
@hookspec(firstresult=True)
def specfw_build_tree(ctx: "SpecContext", req: "Request", candidates: "DraftCandidates", plan: "StepPlan") -> "DraftTree":
    """Turn one request's candidates into the draft tree to verify (at most ``plan.size`` nodes,
    root included).

    ``candidates`` are what :func:`specfw_draft` proposed for the request after the draft
    policy's one cut: the best ``plan.size - 1`` by score, closed under ancestors, in their
    original (parents-first) order, then cut where the draft's calibrated confidence says a node
    does not pay for its verification (``speculative.adaptive_draft``). The core's default
    (trylast) keeps them all, prepends the root, and derives positions (``seq_len - 1 + depth``),
    the ancestor mask and retrieve indices.

    :param req: the request the candidates belong to.
    """


# ---- verification -----------------------------------------------------------------------
@hookspec(firstresult=True)
def specfw_verify(ctx: "SpecContext", req: "Request", tree: "DraftTree", logits: "torch.Tensor", argmax: "list[int] | None") -> "VerifyResult":
    """Choose the accepted path and the bonus token for one request.

    ``logits`` are the target's logits at every tree node ``[num_nodes, vocab]`` (row i
    predicts the token after node i). ``argmax``: each of those rows' argmax (first index on
    ties), read for the whole batch at once where every request in it is greedy without
    penalties or logprobs (one device read a step, not one a request), else None; an
    implementation may leave the argument out of its signature. The core's default (trylast) does greedy tree
    verification for greedy requests, stochastic tree verification with
    ``accept_threshold_single`` / ``accept_threshold_acc`` otherwise, and chain rejection
    sampling when the tree is a chain carrying draft probabilities.

    Not called (nor :func:`specfw_build_tree`) on a decode step the draft policy plays without a
    draft when every request in the batch is greedy without penalties or logprobs: the core takes
    the target's argmax of each request's one row, which is what any lossless verification of a
    root-only tree returns. Sampled requests always come here.

    :returns: :class:`VerifyResult` with the accepted node indices (root first) and the tokens
        to emit (accepted draft tokens + bonus).
    """


# ---- lifecycle --------------------------------------------------------------------------
@hookspec
def specfw_on_prefill(
    ctx: "SpecContext", reqs: "list[Request]", hidden: "torch.Tensor", aux_hidden: "list[torch.Tensor]", spans: "list[tuple[int, int]]"
) -> None:
    """After the target prefilled ``reqs``: build per-request drafter state.

    :param hidden: target last-layer hidden states of every prefilled token ``[T, H]``.
    :param aux_hidden: hidden states entering ``ctx.capture_layers`` (EAGLE-3 taps), each ``[T, H]``.
    :param spans: per request, ``(start, length)`` of its rows in ``hidden``. The token sampled
        from this prefill is appended to ``req.output_ids`` by the engine right after this hook.

    A request's rows are its positions ``req.num_cached ..`` (at this hook ``req.slots`` holds only
    the prefix the prefix cache supplied, usually not 0 with the cache on): the target computed no
    hidden state for the positions before, so a drafter that consumes target features starts
    there (the EAGLE family's pairs do); one that keeps its own KV computes it from
    ``req.seq_ids`` (the standalone draft model prefills the whole prompt).
    """


@hookspec
def specfw_on_accept(
    ctx: "SpecContext", reqs: "list[Request]", results: "list[VerifyResult]", hidden: "torch.Tensor", aux_hidden: "list[torch.Tensor]"
) -> None:
    """After verification: keep the drafter in step with the accepted tokens.

    Called before the scheduler applies the step (keeps the accepted path's target KV, appends
    ``results[i].tokens``, accepted draft tokens + bonus, to ``req.output_ids``; it may stop
    early at eos / a stop condition). Drafters that keep their own cache should treat ``req.seq_ids`` as the source of
    truth and catch up lazily in the next :func:`specfw_draft`.
    ``hidden``/``aux_hidden`` are the verify forward's rows ``[sum(tree sizes), H]``; each
    result's ``node_rows`` index the accepted nodes in them. Also called after decode steps
    without a draft (one row per request), so keep it cheap: the EAGLE family only gathers the
    rows here and runs its own weights when it drafts.
    """


@hookspec(firstresult=True)
def specfw_prefix_to_reuse(ctx: "SpecContext", req: "Request", cached: int) -> "int | None":
    """The prefix cache holds the KV of ``req``'s first ``cached`` tokens: how many of them the
    target reuses (the rest it recomputes, and :func:`specfw_on_prefill` gets their hidden states).
    Return ``cached`` or less; None (no implementation) reuses all. A drafter that continues from
    target features and keeps its own state of earlier requests returns how far that state
    reaches, so the target computes the features it continues from (the EAGLE family: its cached
    pairs, ``speculative/pair_cache.py``). Called when the scheduler admits ``req``."""


@hookspec
def specfw_release(ctx: "SpecContext", req: "Request") -> None:
    """A request finished or was aborted/retracted: drop its drafter state (and draft KV)."""


@hookspec
def specfw_flush_cache(ctx: "SpecContext") -> None:
    """Forget what was learned from earlier requests' tokens (the n-gram trie: SGLang's
    ``/flush_cache``), so that later requests are drafted as on a fresh engine. Called between
    steps with no request in flight (``Engine.flush_cache``). Statistics that are not token
    content (the draft policy's timings, acceptance calibrations) stay."""


@hookspec
def specfw_capture_graphs(ctx: "SpecContext") -> "int | None":
    """Called once at startup, on CUDA, where the target's forwards are replayed from CUDA graphs
    (``engine.cuda_graph_max_bs``), after the target's graphs were captured: capture the
    runtime's own graphs (a draft loop's) now rather than on first use, as SGLang does (a capture
    met while serving costs its kernels' compiles and a few forwards inside a request's step).
    Return how many were captured (logged)."""


# ---- observers --------------------------------------------------------------------------
@hookspec
def specfw_observe_step(ctx: "SpecContext", reqs: "list[Request]", results: "list[VerifyResult]") -> None:
    """Called after every speculative decode step (drafted or not) with the verify results
    (metrics, logging)."""
