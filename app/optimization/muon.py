"""--optimizer muon: Muon for the weight matrices of the model's layers and AdamW for every other parameter, as one
optimizer.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations; it is defined for 2-D
weights only, and its authors and the models trained with it (Moonlight, Kimi K2, GLM-4.5) step the embeddings, the
output layer, norms and biases with AdamW. torch has both optimizers but nothing that runs two as one, which the run
needs: the schedule sets one learning rate on every parameter group, clipping and the gradient norm read every
group, and a checkpoint holds one optimizer's state (under each parameter's name, whatever the strategy). So the two
torch optimizers here share one state and one list of parameter groups, those of this optimizer; each steps its own.
Under FSDP2 the matrices are DTensors sharded by rows, on which torch's Muon computes the whole matrix's update.
"""

from __future__ import annotations

from typing import Any

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over `matrix_groups`, AdamW over `other_groups`, one state and one list of groups (Muon's first)."""

    def __init__(self, matrix_groups: list[dict], other_groups: list[dict], *, lr: float, momentum: float,
                 adamw_options: dict[str, Any]) -> None:
        # match_rms_adamw scales each matrix's orthogonal update to the RMS of an AdamW step, so one lr serves both
        self.muon = torch.optim.Muon(matrix_groups, lr=lr, momentum=momentum, nesterov=True,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(other_groups, lr=lr, **adamw_options)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point both optimizers at this one's groups and state (again after load_state_dict replaces them)."""
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()
