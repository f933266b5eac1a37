"""``GenerativeJudge``: a local checkpoint as the utility of a coalition of paths (the paper's
generative reward model, GRM), scored through the rollout engine.

U(S) = p(yes) / (p(yes) + p(no)), the judge's next-token probabilities of its ``yes`` and ``no``
tokens after the prompt below (the probability that it says yes, given that it answers yes or
no: a base model puts most of its mass on other tokens, which says nothing about the verdict).
``yes`` and ``no`` are words whose first tokens are read; they must differ.

The serialisation of a coalition, written down (the paper leaves it open): ``template`` with
``{question}``, ``{reference}`` (the gold answer: the paper's GRM scores against it) and
``{paths}`` (once). ``{paths}`` becomes, for the paths of S in increasing player order numbered
by position k = 1..|S|, ``"Path {k}:\\n{text}\\n"`` each, concatenated; the empty coalition is
``"No paths.\\n"``. Token ids are the template's text before ``{paths}`` encoded once (the
shared prefix), then each header, each path's text and each ``"\\n"`` encoded on their own,
then the text after ``{paths}``: the same ids whichever way the coalition is scored.

``game(question, reference, texts)`` is a batched utility on the K paths' texts: ``values(masks)``
prefills the shared prefix once, forks it per coalition, extends each fork with its coalition's
paths and runs them in batched prefill passes (``RolloutEngine.prefill``), one call per
coalition size (the engine right-pads a pass to its longest row; one call for all 2^K
coalitions padded every singleton to the full set's length and ran slower on the CPU than one
coalition at a time); ``value(mask)`` scores one coalition on its own (prompt prefilled whole),
the one-at-a-time reference.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from rlvr_fast.engine import RolloutEngine

DEFAULT_TEMPLATE = (
    "You are checking solution paths to a math problem.\n"
    "Question:\n{question}\n"
    "Reference answer: {reference}\n"
    "{paths}"
    "Do these paths, taken together, reach the reference answer? Answer yes or no.\n"
    "Verdict:"
)
EMPTY_COALITION = "No paths.\n"


class GenerativeJudge:
    """``policy_or_path``: a ``Policy``, or a model name or directory for ``load_policy``;
    ``engine``: the engine to score on (default: the judge policy's own)."""

    def __init__(
        self,
        policy_or_path,
        template: str = DEFAULT_TEMPLATE,
        *,
        yes: str = " yes",
        no: str = " no",
        engine: RolloutEngine | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if template.count("{paths}") != 1:
            raise ValueError("the judge template needs {paths} exactly once")
        if not hasattr(policy_or_path, "tokenizer"):
            from rlvr_fast.models.policy import load_policy

            policy_or_path = load_policy(policy_or_path, device=device)
        self.policy, self.template = policy_or_path, template
        self.tokenizer = policy_or_path.tokenizer
        self.engine = engine or RolloutEngine.shared(policy_or_path)
        yes_ids, no_ids = self.tokenizer.encode(yes), self.tokenizer.encode(no)
        if not yes_ids or not no_ids or yes_ids[0] == no_ids[0]:
            raise ValueError(
                f"the judge's yes {yes!r} and no {no!r} must start with different "
                f"tokens, got {yes_ids[:1]} and {no_ids[:1]}"
            )
        self.yes_id, self.no_id = yes_ids[0], no_ids[0]

    def game(self, question: str, reference: str, texts: Sequence[str]) -> "JudgeGame":
        return JudgeGame(self, question, reference, list(texts))

    def probabilities(self, logits: torch.Tensor) -> np.ndarray:
        """p(yes) / (p(yes) + p(no)) per row of next-token logits [n, V]."""
        pair = logits.float()[:, [self.yes_id, self.no_id]]
        return torch.softmax(pair, dim=-1)[:, 0].double().cpu().numpy()


class JudgeGame:
    """The judge's utility on one step's paths (a batched utility for ``rlvr_fast.credit.shapley``)."""

    def __init__(
        self, judge: GenerativeJudge, question: str, reference: str, texts: list[str]
    ) -> None:
        self.judge, self.n = judge, len(texts)
        before, after = judge.template.split("{paths}")
        encode = judge.tokenizer.encode
        self.prefix_ids = encode(before.format(question=question, reference=reference))
        self.suffix_ids = encode(after.format(question=question, reference=reference))
        self.path_ids = [encode(text) for text in texts]
        self.newline_ids = encode("\n")
        self.empty_ids = encode(EMPTY_COALITION)

    def coalition_ids(self, mask: int) -> list[int]:
        """The token ids after the shared prefix for coalition ``mask`` (module docstring)."""
        members = [j for j in range(self.n) if mask >> j & 1]
        if not members:
            return self.empty_ids + self.suffix_ids
        ids: list[int] = []
        encode = self.judge.tokenizer.encode
        for position, j in enumerate(members, start=1):
            ids += encode(f"Path {position}:\n") + self.path_ids[j] + self.newline_ids
        return ids + self.suffix_ids

    def values(self, masks: np.ndarray) -> np.ndarray:
        engine = self.judge.engine
        masks = np.asarray(masks, dtype=np.int64)
        scores = np.empty(len(masks))
        prefix = engine.add(self.prefix_ids)
        forks = []
        try:
            # One batched prefill per coalition size: a pass is right-padded to its longest row,
            # and coalitions of one size have about the same length.
            for size in np.unique(np.bitwise_count(masks)):
                rows = np.flatnonzero(np.bitwise_count(masks) == size)
                forks = engine.fork(prefix, n=len(rows))
                for seq, mask in zip(forks, masks[rows]):
                    engine.extend(seq, self.coalition_ids(int(mask)))
                scores[rows] = self.judge.probabilities(engine.prefill(forks))
                for seq in forks:
                    engine.free(seq)
            return scores
        finally:
            for seq in [prefix, *forks]:
                engine.free(seq)

    def value(self, mask: int) -> float:
        engine = self.judge.engine
        seq = engine.add(self.prefix_ids + self.coalition_ids(mask))
        try:
            return float(self.judge.probabilities(engine.prefill([seq]))[0])
        finally:
            engine.free(seq)
