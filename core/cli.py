"""``specfw`` console script: Hydra-composed subcommands ``generate``, ``serve``, ``train``,
``bench`` and ``tune``; ``plugins``, ``new-plugin`` and ``cluster``."""

from __future__ import annotations

import logging
import os
import sys
import time

USAGE = """usage: specfw <command> [hydra overrides...]

commands:
  generate   one-shot generation: specfw generate prompt="..." [max_new_tokens=64] [speculative=ngram]
  serve      OpenAI-compatible HTTP server: specfw serve [server.port=30000] [speculative=...]
             specfw serve --from-sglang "<sglang.launch_server flags>" [overrides...]: SGLang's flags
             translated (the equivalent command and each flag not honoured are printed), then served
  train      train a draft: specfw train draft=<registered trainer, e.g. eagle3> [steps=300] [output_dir=...]
  bench      measure a prompt set in-process or against a server: specfw bench [-m] speculative=... [bench.batch_sizes=[1,4]]
             [bench.prompts.dataset=mtbench|humaneval|sharegpt|jsonl] [bench.url=http://host:port]: records, table, plot
  tune       find the best tree settings per batch-size bucket and write them for serve:
             specfw tune speculative=eagle3 [tune.batch_sizes=[1,4]] (tuned vs auto measured on held-out prompts)
  plugins    list installed speculative algorithms (package, version, description, hooks) and trainers
  new-plugin write a plugin package to start from: specfw new-plugin NAME [DIR]
  cluster    N serve replicas behind SGLang's router: specfw cluster replicas=2 [port=30000]
             [policy=cache_aware|round_robin|random|power_of_two] [serve overrides...]

Overrides are Hydra's: key=value, group=option (speculative=<algorithm>), -m for sweeps,
--cfg job to print the composed config.
"""

COMMANDS = ("generate", "serve", "train", "bench", "tune", "plugins", "new-plugin", "cluster")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s", force=True)


def _run_hydra(command: str, task) -> None:
    import hydra
    from .config_store import register_configs

    register_configs()
    hydra.main(config_path="pkg://specfw_conf", config_name=command, version_base="1.3")(_clean_errors(task))()


def _clean_errors(task):
    """Config and request errors end the command with one clear line, not a traceback."""
    import functools

    @functools.wraps(task)
    def run(cfg):
        from .bench.client import ServerError
        from .config import ConfigError
        from .model_loader import ModelLoadError
        from .plugins import PluginError
        from .sampling import SamplingParamsError
        from .scheduler import RequestRejected

        try:
            task(cfg)
        except (ConfigError, ModelLoadError, PluginError, SamplingParamsError, RequestRejected, ServerError) as e:
            print(f"specfw {sys.argv[0].split()[-1]}: error: {e}", file=sys.stderr)
            sys.exit(2)

    return run


def sweep_label() -> str | None:
    """``[job N] overrides`` when this run is one job of a ``-m`` sweep, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hc = HydraConfig.get()
    return f"[job {hc.job.num}] {' '.join(hc.overrides.task)}"


def follow_torchrun(cfg) -> bool:
    """Under torchrun with ``model.tp_size`` > 1, ranks other than 0 hold a shard and follow rank 0
    (which runs the engine): True once such a rank is done."""
    from .tp import serve_as_follower, torchrun_follower

    if not torchrun_follower(cfg):
        return False
    serve_as_follower(cfg)
    return True


def generate_task(cfg) -> None:
    from .config import validate
    from .engine import Engine
    from .sampling import SamplingParams

    validate(cfg)
    label = sweep_label()
    if label:
        print(label, flush=True)
    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p, seed=cfg.seed
    ).validate()
    setup_logging(cfg.server.log_level if cfg.server.log_level != "info" else "warning")
    if follow_torchrun(cfg):
        return
    engine = Engine(cfg)
    prompt = engine.tokenize_chat([{"role": "user", "content": cfg.prompt}]) if cfg.chat else cfg.prompt
    t0 = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    print(out.text)
    n = len(out.token_ids)
    line = f"[specfw] prompt tokens: {out.prompt_tokens}, generated tokens: {n}, time: {dt:.2f} s, {n / dt:.2f} tokens/s"
    if out.meta.get("spec_verify_ct"):
        line += f", accept len: {out.meta['spec_accept_length']:.2f}"
    print(line + f", finish: {out.finish_reason}", file=sys.stderr)


def serve_task(cfg) -> None:
    from .config import validate
    from .server.app import run_server
    from .tuned import apply_tuned

    setup_logging(cfg.server.log_level)
    applied = apply_tuned(cfg)  # before validate: the tuned tree keys are checked like given ones
    if applied:
        logging.getLogger("specfw").info(applied)
    validate(cfg)
    if follow_torchrun(cfg):
        return
    run_server(cfg)


def bench_task(cfg) -> None:
    from .bench.run import bench_task as run

    setup_logging(cfg.server.log_level if cfg.server.log_level != "info" else "warning")
    run(cfg)


def tune_task(cfg) -> None:
    from .bench.tune import tune_task as run

    setup_logging(cfg.server.log_level if cfg.server.log_level != "info" else "warning")
    run(cfg)


def train_task(cfg) -> None:
    from .train.config import validate_train
    from .train.run import run_training

    validate_train(cfg)
    label = sweep_label()
    if label:
        print(label, flush=True)
    setup_logging("info")
    run_training(cfg)


def implemented_hooks(obj) -> list[str]:
    """The specfw hooks ``obj`` (an algorithm's factory class or a plugin module) implements with @hookimpl."""
    from .hookspecs import PROJECT

    return sorted(n for n in dir(obj) if n.startswith("specfw_") and hasattr(getattr(obj, n, None), f"{PROJECT}_impl"))


def plugins_command() -> None:
    from .plugins import plugin_manager

    pm = plugin_manager()
    print(f"{'algorithm':<14} {'package':<28} {'version':<10} module")
    for r in pm.describe():
        print(f"{r.name:<14} {r.package:<28} {r.version:<10} {r.module}")
        if r.description:
            print(f"{'':<14} {r.description}")
        hooks = implemented_hooks(r.factory)
        print(f"{'':<14} hooks: {', '.join(h.removeprefix('specfw_') for h in hooks) or '(none found on the factory)'}")
    if pm.trainers:
        print(f"\n{'trainer':<14} {'module':<28} description")
        for kind, t in sorted(pm.trainers.items()):
            print(f"{kind:<14} {t.module:<28} {t.description}")
    if pm.assists:
        print(f"\n{'draft assist':<14} {'module':<28} description")
        for name, a in sorted(pm.assists.items()):
            print(f"{name:<14} {a.module:<28} {a.description}")


def new_plugin_command(args: list[str]) -> None:
    from .new_plugin import write_plugin

    if not 1 <= len(args) <= 2:
        print("usage: specfw new-plugin NAME [DIR]", file=sys.stderr)
        sys.exit(2)
    try:
        root = write_plugin(*args)
    except ValueError as e:
        print(f"specfw new-plugin: error: {e}", file=sys.stderr)
        sys.exit(2)
    where = str(root) if root.is_absolute() else f"./{root}"
    print(f"wrote {root}: pip install -e '{where}[test]' && python -m pytest {where}/tests")


def from_sglang(rest: list[str]) -> list[str]:
    """``--from-sglang "<flags>"`` in ``rest`` replaced by the translated overrides (printed, with a
    line per flag not honoured); the other items of ``rest`` follow them and win."""
    from .sglang_flags import translate

    i = next(i for i, a in enumerate(rest) if a == "--from-sglang" or a.startswith("--from-sglang="))
    if rest[i] == "--from-sglang":
        if i + 1 >= len(rest):
            print("specfw serve: error: --from-sglang needs the SGLang flags as one quoted argument", file=sys.stderr)
            sys.exit(2)
        flags, others = rest[i + 1], rest[:i] + rest[i + 2 :]
    else:
        flags, others = rest[i].partition("=")[2], rest[:i] + rest[i + 1 :]
    t = translate(flags)
    for name, value in t.environ.items():  # SGLang's env vars given inline are honoured as if exported
        os.environ[name] = value
    for w in t.warnings:
        print(f"specfw serve --from-sglang: warning: {w}", file=sys.stderr)
    t.overrides += others
    print(f"equivalent: {t.command()}", file=sys.stderr)
    return t.overrides


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"specfw: unknown command '{command}' (choose from {', '.join(COMMANDS)})\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    if command == "new-plugin":
        new_plugin_command(rest)
        return
    if command == "cluster":
        from .cluster import ClusterError, run

        try:
            sys.exit(run(rest))
        except ClusterError as e:
            print(f"specfw cluster: error: {e}", file=sys.stderr)
            sys.exit(2)
    from .plugins import PluginError, plugin_manager

    try:
        plugin_manager()  # discovery errors (SPECFW_PLUGINS naming no installed plugin) end here, in one line
    except PluginError as e:
        print(f"specfw {command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if command == "plugins":
        plugins_command()
        return
    if command == "serve" and any(a == "--from-sglang" or a.startswith("--from-sglang=") for a in rest):
        rest = from_sglang(rest)
    sys.argv = [f"specfw {command}"] + rest
    tasks = {"generate": generate_task, "serve": serve_task, "train": train_task, "bench": bench_task, "tune": tune_task}
    _run_hydra(command, tasks[command])


if __name__ == "__main__":
    main()
