"""The training loop shared by every draft kind: AdamW with warmup + cosine decay, gradient
clipping, progress bar, resumable checkpoints, export in the published layout, and a loss plot."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)


def lr_at(step: int, cfg) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    prog = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def autocast_bf16(cfg, device: torch.device) -> bool:
    """``autocast_bf16``, with null resolved for ``device``: on for CUDA and for CPUs whose bf16
    matmuls are native (AVX512-BF16, AMX); off elsewhere, where oneDNN emulates them (the tiny test
    drafts trained 5.7x slower with it on an AVX2-only EPYC, session 42)."""
    if cfg.autocast_bf16 is not None:
        return bool(cfg.autocast_bf16)
    if device.type != "cpu":
        return True
    from ..kernels import cpu_has_avx512_bf16

    return cpu_has_avx512_bf16()


def train(cfg, trainer, batch_iter_factory, out_dir: Path, device: torch.device | None = None) -> Path:
    device = device or torch.device("cpu")
    ckpt_dir = out_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    history: list[dict] = []
    step = 0
    last = ckpt_dir / "last.pt"
    if cfg.resume and last.exists():
        state = torch.load(last, map_location="cpu", weights_only=False)
        trainer.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        logger.info("resumed from %s at step %d", last, step)
    batches = batch_iter_factory(step)
    t0 = time.monotonic()
    autocast = autocast_bf16(cfg, device)
    logger.info("bf16 autocast %s on %s", "on" if autocast else "off", device)
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.draft.kind}", unit="step")
    while step < cfg.steps:
        ids, mask, valid = (t.to(device, non_blocking=True) for t in next(batches))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, metrics = trainer.loss(ids, mask, valid)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        metrics["step"], metrics["lr"] = step, opt.param_groups[0]["lr"]
        history.append(metrics)
        bar.update()
        bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k not in ("step", "lr")})
        out_of_time = cfg.max_minutes is not None and time.monotonic() - t0 > 60 * cfg.max_minutes
        if step % cfg.save_every == 0 or step == cfg.steps or out_of_time:
            tmp = ckpt_dir / "last.pt.tmp"
            torch.save({"model": trainer.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history}, tmp)
            tmp.replace(last)
        if out_of_time:
            logger.warning("max_minutes reached at step %d: checkpoint saved; rerun the same command to resume", step)
            break
    bar.close()
    dtype = getattr(torch, str(getattr(cfg.save_dtype, "value", cfg.save_dtype)))
    final = trainer.export(out_dir / "draft", dtype)
    (out_dir / "history.json").write_text(json.dumps(history))
    plot_history(history, out_dir / "loss.png", f"{cfg.draft.kind} draft training")
    return final


def plot_history(history: list[dict], path: Path, title: str) -> None:
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, [h["loss"] for h in history], lw=0.8)
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("loss")
    ax[0].set_title(title)
    for k in sorted(k for k in history[-1] if k.startswith("acc")):
        ax[1].plot(steps, [h.get(k, float("nan")) for h in history], lw=0.8, label=k)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("top-1 agreement with target")
    if any(k.startswith("acc") for k in history[-1]):
        ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
