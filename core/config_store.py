"""Register specfw's schemas and one ``speculative`` option per algorithm (under its name, its
upper-case SGLang spelling and SGLang's aliases) and one ``draft`` option (``specfw train``) per
trainer in Hydra's ConfigStore."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from .config import GenerateConfig, SpecfwConfig, SpeculativeConfig
from .plugins import plugin_manager


def register_configs() -> ConfigStore:
    cs = ConfigStore.instance()
    cs.store(name="generate_schema", node=GenerateConfig)
    cs.store(name="serve_schema", node=SpecfwConfig)
    cs.store(group="speculative", name="none", node=SpeculativeConfig(algorithm="none"))
    from .bench.config import BenchConfig, TuneConfig
    from .train.config import TrainConfig

    cs.store(name="bench_schema", node=BenchConfig)
    cs.store(name="tune_schema", node=TuneConfig)

    cs.store(name="train_schema", node=TrainConfig)
    for t in plugin_manager().trainers.values():
        cs.store(group="draft", name=t.kind, node=t.config_class(kind=t.kind))
    for algo in plugin_manager().describe():
        for name in dict.fromkeys([algo.name, algo.name.upper(), *SGLANG_ALIASES.get(algo.name, ())]):
            cs.store(group="speculative", name=name, node=algo.config_class(algorithm=algo.name), provider=algo.package)
    return cs


# SGLang's --speculative-algorithm names select the same options: speculative=EAGLE3 is eagle3,
# and NEXTN (SGLang: the target's own NextN layers through the EAGLE worker) is mtp
SGLANG_ALIASES = {"mtp": ("nextn", "NEXTN")}
