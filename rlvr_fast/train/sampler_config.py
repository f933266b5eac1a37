"""TRL's sampler options (``rlvr_fast.engine.token_sampler``), a base of ``TrainConfig``: off by
default, and written to config.json only when set, so that runs which do not set them keep the
config.json (and the resume signature) they had before the options existed."""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.utils.settings import setting


@dataclass
class SamplerOptionsConfig:
    top_k: int = setting(
        0,
        "sample among the k most likely tokens, top-p then renormalised over them (0: off)",
        lambda v: v >= 0,
        "top_k must be >= 0, got {value}",
        written_when_set=True,
    )
    min_p: float = setting(
        0.0,
        "drop tokens below min_p times the most likely token's probability (0: off)",
        lambda v: 0 <= v <= 1,
        "min_p must be in [0, 1], got {value}",
        written_when_set=True,
    )
    repetition_penalty: float = setting(
        1.0,
        "divide (multiply, when negative) the logits of tokens already in the prompt or the "
        "completion by this (1: off)",
        lambda v: v > 0,
        "repetition_penalty must be > 0, got {value}",
        written_when_set=True,
    )

    @property
    def sampler_options(self) -> dict:
        """top_k, min_p and repetition_penalty as ``SamplingParams`` takes them."""
        return dict(top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty)
