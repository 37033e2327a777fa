"""Register specfw's schemas and one ``speculative`` option per algorithm and one
``draft`` option (``specfw train``) per trainer in Hydra's ConfigStore."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from .config import GenerateConfig, SpecfwConfig, SpeculativeConfig
from .plugins import plugin_manager


def register_configs() -> ConfigStore:
    cs = ConfigStore.instance()
    cs.store(name="generate_schema", node=GenerateConfig)
    cs.store(name="serve_schema", node=SpecfwConfig)
    cs.store(group="speculative", name="none", node=SpeculativeConfig(algorithm="none"))
    from .train.config import TrainConfig
    cs.store(name="train_schema", node=TrainConfig)
    for t in plugin_manager().trainers.values():
        cs.store(group="draft", name=t.kind, node=t.config_class(kind=t.kind))
    for algo in plugin_manager().describe():
        cs.store(group="speculative", name=algo.name, node=algo.config_class(algorithm=algo.name),
                 provider=algo.package)
    return cs
