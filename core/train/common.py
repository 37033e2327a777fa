"""What every draft trainer shares: the trained module's parameters and state, and loading a
published draft into it (``init_draft``)."""
from __future__ import annotations

import torch


def load_matching(module: torch.nn.Module, sd: dict) -> None:
    """Load ``sd`` into ``module`` (cast to each parameter's dtype); every tensor must be present with
    its shape, else a ConfigError naming ``init_draft`` and the first mismatch."""
    from ..config import ConfigError
    own = module.state_dict()
    for k, v in own.items():
        if k not in sd:
            raise ConfigError("init_draft", f"the draft has no tensor '{k}' (is it a draft of this kind?)")
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ConfigError("init_draft", f"tensor '{k}' has shape {tuple(sd[k].shape)}, this draft config "
                                            f"needs {tuple(v.shape)}")
    module.load_state_dict({k: sd[k].to(v.dtype) for k, v in own.items()})


class ModuleTrainer:
    """Base of the draft trainers: ``self.module`` is what the optimizer trains and checkpoints hold."""
    module: torch.nn.Module

    def parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, sd):
        self.module.load_state_dict(sd)
