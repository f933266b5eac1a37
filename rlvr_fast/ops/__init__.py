"""Public fused ops; each wraps a kernel module in ``rlvr_fast.kernels``."""

from rlvr_fast.ops.weighted_nll import weighted_token_nll

__all__ = ["weighted_token_nll"]
