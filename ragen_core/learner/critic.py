"""The critic of PPO (GAE): a scalar value head on a transformer's last hidden state.

``build_critic(policy, optim, seed)`` makes the critic that ``learner.optim.critic`` asks for: a copy
of the policy's transformer body (or of ``critic_model_path``) with a fresh head, trained on its own,
or a head on the policy's own body (``shared_backbone``), of which only the head is trained.

Token alignment (docs/architecture.md, "Trajectory schema"): ``ValueModel`` returns the value of the
state *after* each position; the learner reads a token's value at the position before it.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ragen_core.config.learner import OptimConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["ValueModel", "backbone", "build_critic"]


def backbone(model: nn.Module) -> nn.Module:
    """The transformer body (no LM head) of a causal LM, also through a peft wrapper."""
    if hasattr(model, "get_base_model"):  # peft
        model = cast("PeftModel", model).get_base_model()
    return cast("PreTrainedModel", model).base_model


class ValueModel(nn.Module):
    """Critic: a scalar head ``nn.Linear(hidden, 1)`` on a transformer's last hidden state.

    ``forward(input_ids) -> (B, L)``: value of the state *after* each position (a token's value is
    read at the position before it, see the module docstring). With ``shared`` the backbone is the
    policy's (not a submodule of the critic: not saved, not trained by the critic; features are
    detached).
    """

    def __init__(
        self,
        backbone: nn.Module,
        hidden_size: int,
        *,
        shared: bool = False,
        seed: int = 0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        param = next(backbone.parameters())
        self.shared = shared
        if shared:
            self._shared_backbone = (backbone,)  # a tuple: not registered as a submodule
        else:
            self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1, device=param.device, dtype=param.dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = torch.randn(self.head.weight.shape, generator=gen, dtype=torch.float64) * init_std
            self.head.weight.copy_(weight)
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shared:
            with torch.no_grad():
                hidden = self._shared_backbone[0](input_ids=input_ids, use_cache=False).last_hidden_state
        else:
            hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        return cast(torch.Tensor, self.head(hidden.to(self.head.weight.dtype)).squeeze(-1))


def build_critic(policy: nn.Module, optim: OptimConfig, seed: int) -> ValueModel:
    """The critic of ``optim.critic`` for ``policy`` (a plain causal LM: built before LoRA wraps it,
    so a separate critic copies plain weights); its head is initialised from ``seed``."""
    hidden: int = cast("PreTrainedModel", policy).config.hidden_size
    init_std = float(getattr(policy.config, "initializer_range", 0.02))
    if optim.critic == "shared_backbone":
        return ValueModel(backbone(policy), hidden, shared=True, seed=seed, init_std=init_std)
    if optim.critic_model_path is not None:
        from transformers import AutoModel

        param = next(policy.parameters())
        body = AutoModel.from_pretrained(optim.critic_model_path, dtype=param.dtype).to(param.device)
        return ValueModel(body, body.config.hidden_size, seed=seed, init_std=init_std)
    return ValueModel(copy.deepcopy(backbone(policy)), hidden, seed=seed, init_std=init_std)
