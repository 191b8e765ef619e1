"""PPO's value model (ppo.py): its own copy of the policy's transformer with a zero-initialised scalar head on
every position, built from any decoder-only architecture AutoModel knows, loaded and saved as the policy is (a
transformers folder, the head beside it; with --lora-rank, adapters on a frozen copy). What the critic computes
for the algorithm, V(s_t) of every completion token, is ppo.token_values.
"""

import torch

from machinery import lora, models


class Critic(torch.nn.Module):
    """The value model: its own copy of an LM's transformer (no vocabulary head) with a scalar head on every
    position's last hidden state. It builds from any decoder-only architecture that AutoModel knows.

    The head starts at zero, so every first value is 0: in lm-human-preferences (language/model.py) the value
    head is zero-initialised (the N(0, 1/sqrt(H + 1)) init there is the reward head's). A head drawn at random
    would give values of about +-1 whose errors, whitened into advantages, push the policy at random.
    """

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1, device=backbone.device)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        position_ids = models.position_ids_from_mask(attention_mask)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.value_head(hidden.last_hidden_state).squeeze(-1).float()  # [B, L]

    def save_pretrained(self, folder, state_dict=None):
        """The backbone as a transformers folder (AutoModel reloads it), the head beside it; from `state_dict` if
        given."""
        models.save_backbone_and_head(self.backbone, state_dict or self.state_dict(), folder)


def load_critic(name, device, args=None):
    """A critic whose backbone starts from `name` (a causal LM, or a saved critic whose head comes back too); with
    --lora-rank in `args`, its own adapters on its own frozen copy of the backbone (docs/lora_and_memory.md)."""
    critic = Critic(models.load_backbone(name, device))
    models.load_head(critic.value_head, name, device)
    lora.wrap(critic.backbone, args, task_type=None) if args is not None else None
    return critic
