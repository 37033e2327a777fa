"""``engine.torch_compile`` (SGLang's ``--enable-torch-compile``): the target's decoder layers
through ``torch.compile`` for forwards of up to ``engine.torch_compile_max_bs`` rows, eager above.

One compiled function serves every layer (the layer is an argument, so its weights are inputs,
not guards: one compilation per shape class, not per layer); shapes are dynamic. What it can fuse
depends on the backend: torch's ops (a GPU, or ``engine.cpu_isa=none``) trace whole; specfw's
compiled CPU kernels are opaque calls, so around them there is little left to fuse. Measured on
CPUs in docs/gpu.md (it loses there, so it is off by default).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class CompiledLayers:
    """The compiled layer function; a compilation that fails (Inductor cannot lower an op, e.g.
    MKL's packed linears) is logged once and every layer runs eagerly from then on: the request
    that hit it is served, not failed (the compile fails before the layer computes anything)."""

    def __init__(self, fn, max_rows: int):
        self.compiled, self.max_rows, self.failed = torch.compile(fn, dynamic=True), max_rows, False

    def dispatch(self, layer):
        eager = type(layer).forward

        def forward(x, *args, **kw):
            if self.failed or x.shape[0] > self.max_rows:
                return eager(layer, x, *args, **kw)
            try:
                return self.compiled(layer, x, *args, **kw)
            except Exception as e:
                self.failed = True
                logger.warning(
                    "engine.torch_compile: compiling the decoder layer failed (%s: %s); running eagerly", type(e).__name__, str(e).splitlines()[0][:200]
                )
                return eager(layer, x, *args, **kw)

        return forward


def compile_layers(runner, max_rows: int) -> CompiledLayers:
    from .models.llama import DecoderLayer

    layers = CompiledLayers(DecoderLayer.forward, max_rows)
    for layer in runner.model.layers:
        layer.forward = layers.dispatch(layer)
    runner.compiled_layers = layers
    if runner.device.type == "cpu":
        logger.warning("engine.torch_compile on a CPU: measured slower than eager here (docs/gpu.md); kept because it was asked for")
    logger.info("torch.compile: decoder layers compiled for forwards of up to %d rows (engine.torch_compile_max_bs)", max_rows)
    return layers
