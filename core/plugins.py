"""Plugin registry: discovers distribution plugins through the ``specfw`` entry-point group
(built-ins included: ``plugins/*`` register exactly like a pip-installed package) and builds
the per-engine plugin manager for the configured algorithm.

Environment: ``SPECFW_PLUGINS=a,b`` loads only those entry points (a name that is not installed is
an error); ``SPECFW_DISABLE_PLUGINS=a,b`` skips them (unknown names warn).
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
from dataclasses import dataclass
from typing import Callable

import pluggy

from . import hookspecs

logger = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "specfw"


class PluginError(ValueError):
    pass


@dataclass
class Algorithm:
    name: str
    config_class: type
    factory: Callable
    description: str = ""
    package: str = "?"
    version: str = "?"
    module: str = "?"


@dataclass
class Trainer:
    """A draft trainer (``specfw train draft=<kind>``), registered by ``specfw_register_trainers``."""

    kind: str
    config_class: type
    factory: Callable
    description: str = ""
    demo_draft: object = None
    copy_tokenizer: bool = False
    module: str = "?"


@dataclass
class DraftAssist:
    """A draft assist (``speculative.draft_assist=<name>``), registered by ``specfw_register_draft_assists``."""

    name: str
    factory: Callable
    description: str = ""
    module: str = "?"


class PluginManager:
    """Process-wide registry of distribution plugins and the algorithms they register."""

    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.algorithms: dict[str, Algorithm] = {}
        self.trainers: dict[str, Trainer] = {}
        self.assists: dict[str, DraftAssist] = {}
        self._dists: dict[int, tuple[str, str, str]] = {}
        if load_entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        allow = {s.strip() for s in os.environ.get("SPECFW_PLUGINS", "").split(",") if s.strip()}
        block = {s.strip() for s in os.environ.get("SPECFW_DISABLE_PLUGINS", "").split(",") if s.strip()}
        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        names = {ep.name for ep in eps}
        if allow - names:
            raise PluginError(f"SPECFW_PLUGINS names {sorted(allow - names)}, which are not installed specfw entry points; installed: {sorted(names)}")
        if block - names:
            logger.warning("SPECFW_DISABLE_PLUGINS names %s, which are not installed specfw entry points; installed: %s", sorted(block - names), sorted(names))
        for ep in eps:
            if (allow and ep.name not in allow) or ep.name in block:
                continue
            try:
                obj = ep.load()
            except Exception as e:  # a broken third-party plugin must not take the server down
                logger.error("failed to load specfw plugin '%s' (%s): %s", ep.name, ep.value, e)
                continue
            dist = ep.dist
            try:
                self.register(obj, ep.name, package=dist.name if dist else "?", version=dist.version if dist else "?")
            except PluginError as e:  # likewise: report it, serve the other plugins
                logger.error("specfw plugin '%s' (%s) not registered: %s", ep.name, ep.value, e)

    def register(self, plugin, name: str | None = None, package: str = "?", version: str = "?") -> None:
        """Register a distribution plugin object and collect its algorithms and trainers."""
        check_marked(plugin, name or getattr(plugin, "__name__", type(plugin).__name__))
        self.pm.register(plugin, name=name)
        self.pm.check_pending()
        module = getattr(plugin, "__name__", type(plugin).__name__)

        def register_algorithm(algo_name: str, config_class: type, factory: Callable, description: str = "") -> None:
            from .speculative.config import SpecAlgoConfig

            if algo_name in self.algorithms or algo_name == "none":
                raise PluginError(
                    f"speculative algorithm '{algo_name}' is registered twice "
                    f"({self.algorithms[algo_name].module if algo_name in self.algorithms else 'core'} and {module})"
                )
            if not (isinstance(config_class, type) and issubclass(config_class, SpecAlgoConfig)):
                raise PluginError(f"algorithm '{algo_name}': config_class must subclass SpecAlgoConfig")
            if isinstance(factory, type):
                check_marked(factory, f"algorithm '{algo_name}' ({factory.__name__})")
            self.algorithms[algo_name] = Algorithm(algo_name, config_class, factory, description, package, version, module)

        def register_trainer(kind: str, config_class: type, factory: Callable, description: str = "", demo_draft=None, copy_tokenizer: bool = False) -> None:
            from .train.config import DraftTrainConfig

            if kind in self.trainers:
                raise PluginError(f"trainer '{kind}' is registered twice ({self.trainers[kind].module} and {module})")
            if not (isinstance(config_class, type) and issubclass(config_class, DraftTrainConfig)):
                raise PluginError(f"trainer '{kind}': config_class must subclass DraftTrainConfig")
            self.trainers[kind] = Trainer(kind, config_class, factory, description, demo_draft, copy_tokenizer, module)

        def register_assist(assist_name: str, factory: Callable, description: str = "") -> None:
            if assist_name in self.assists:
                raise PluginError(f"draft assist '{assist_name}' is registered twice ({self.assists[assist_name].module} and {module})")
            if isinstance(factory, type):
                check_marked(factory, f"draft assist '{assist_name}' ({factory.__name__})")
            self.assists[assist_name] = DraftAssist(assist_name, factory, description, module)

        impl = getattr(plugin, "specfw_register_algorithms", None)
        if impl is not None:
            impl(register=register_algorithm)
        impl = getattr(plugin, "specfw_register_trainers", None)
        if impl is not None:
            impl(register=register_trainer)
        impl = getattr(plugin, "specfw_register_draft_assists", None)
        if impl is not None:
            impl(register=register_assist)

    def unregister(self, name: str) -> None:
        plugin = self.pm.unregister(name=name)
        module = getattr(plugin, "__name__", type(plugin).__name__)
        for k in [k for k, a in self.algorithms.items() if a.module == module]:
            del self.algorithms[k]
        for k in [k for k, t in self.trainers.items() if t.module == module]:
            del self.trainers[k]
        for k in [k for k, a in self.assists.items() if a.module == module]:
            del self.assists[k]

    def describe(self) -> list[Algorithm]:
        return [self.algorithms[k] for k in sorted(self.algorithms)]

    def distribution_plugins(self) -> list:
        return [p for p in self.pm.get_plugins()]


def check_marked(obj, what: str) -> None:
    """Fail when ``obj`` defines a specfw hook without ``@hookimpl``: pluggy would silently skip it."""
    spec_names = {n for n in dir(hookspecs) if n.startswith("specfw_") and callable(getattr(hookspecs, n))}
    unmarked = sorted(n for n in spec_names if callable(getattr(obj, n, None)) and not hasattr(getattr(obj, n), f"{hookspecs.PROJECT}_impl"))
    if unmarked:
        raise PluginError(
            f"{what} defines {', '.join(unmarked)} without the @hookimpl marker, so specfw would "
            "never call it; decorate it with `@hookimpl` (from specfw.hookspecs import hookimpl)"
        )


_MANAGER: PluginManager | None = None


def plugin_manager() -> PluginManager:
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager()
    return _MANAGER


def build_worker(engine):
    """The speculative worker for ``engine.cfg.speculative``, or None for plain decoding."""
    spec_cfg = getattr(engine.cfg, "speculative", None)
    name = getattr(spec_cfg, "algorithm", "none") if spec_cfg is not None else "none"
    if name == "none":
        return None
    algos = plugin_manager().algorithms
    if name not in algos:
        raise PluginError(f"speculative.algorithm: '{name}' is not registered; installed: {sorted(algos) + ['none']}")
    from .speculative.worker import SpeculativeWorker

    return SpeculativeWorker(
        engine.runner,
        algos[name],
        plugin_manager(),
        engine_config=engine.cfg,
        tokenizer=engine.tokenizer,
        stats=engine.stats,
        target_path=engine.loaded.path,
        hf_config=engine.loaded.hf_config,
        shape=engine.tree_shape,
    )
