"""BA-PPO's critic for the embedded backend (paper A.9): V(s_t) for every response token."""
from __future__ import annotations

import copy

import torch

from bapo_vl.shared_images import last_hidden_state


class ValueModel(torch.nn.Module):
    """A copy of the policy's network with a scalar head on its last hidden state. The head starts at zero, so
    the first advantages are the plain (whitened) rewards."""

    def __init__(self, policy):
        super().__init__()
        self.body = copy.deepcopy(policy)
        self.body.requires_grad_(True)
        self.head = torch.nn.Linear(policy.get_input_embeddings().embedding_dim, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: dict, n_response: int) -> torch.Tensor:
        """(B, R) values of the states before each response token (same alignment as the policy's log-probs)."""
        hidden = last_hidden_state(self.body, {k: v for k, v in batch.items() if k != "P"})  # (B, L, H)
        return self.head(hidden[:, -n_response - 1:-1].float()).squeeze(-1)  # (B, R)
