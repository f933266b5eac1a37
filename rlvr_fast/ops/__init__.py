"""Public fused ops; each wraps a kernel module in ``rlvr_fast.kernels``."""

from rlvr_fast.ops.policy_loss import PolicyLossSettings, fused_policy_loss
from rlvr_fast.ops.weighted_nll import weighted_token_nll

__all__ = ["PolicyLossSettings", "fused_policy_loss", "weighted_token_nll"]
