"""Dense attention shared by the full-sequence forward and the caches."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hq, Tq, D], k / v [B, Hkv, Tk, D]; causal when no mask is given and Tq > 1."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=mask is None and q.shape[2] > 1,
                                          enable_gqa=q.shape[1] != k.shape[1])
