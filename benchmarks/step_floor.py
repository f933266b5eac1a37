"""What a GRPO step of the drop-in must execute, phase by phase, and the floor that puts on its
time on this machine: the GEMMs at the model's own matrix shapes, each timed in this process.

Two counts of one step's FLOPs, both from its ledger line:

- ``ledger_flops``: the ledger's own accounting (the seed's Full FLOPs, ``flops_full``),
  2 P per prefill token (``pref``: the prompt once per completion), 2 P per generated token
  (``gen``) and 6 P per trained token (``bwd_full``: every completion with its own copy of the
  prompt), P all parameters (the embedding too, the LM head on every row), no recompute. Split as
  prefill 2 pref P, decode 2 gen P, forward 2 bwd_full P, backward 4 bwd_full P, which sum to
  ``flops_full``.
- ``executed_work``: the multiplications the step needs, as the drop-in runs it. Rollout: the
  engine's prefill (``prefill_run`` tokens, one LM head row per prompt) and decode
  (``decode_rows`` rows, an LM head row each, at G x prompts rows per decode step). Forward: per
  prompt one packed pass over the prompt once and its G completions (``prompt_len`` + sum of
  ``lengths`` less one per completion: a last token is a target only) through every decoder layer, and the fused policy loss's four LM head
  GEMMs on the completion tokens only (the logits, their recompute, the gradients of the hidden
  states and of the head: ``rlvr_fast.ops.policy_loss``). Backward: the decoder layers' two
  gradient GEMMs per projection, and with activation checkpointing their forward once more up
  to the last tensor backward needs (all but each layer's MLP output projection).
  Attention's score and value products count the causal pairs only (the prompt's keys for every
  completion token, a completion's own earlier tokens), forward once, backward twice. The
  embedding lookup and the norms multiply nothing. Optimizer: no GEMM; the gradient clip's norm
  (reads the gradients) and scale (reads and writes them) and the fused AdamW step (reads the
  weights, gradients and two moments, writes the weights and moments): 40 bytes per parameter
  in fp32, at the machine's streaming rate (``stream_rate``).

Each phase's floor is the sum over its GEMMs of the time this process measures for that GEMM
(its rows, its layout: forward X W^T, gradient of the input dY W, gradient of the weight dY^T X),
attention's products at the phase's GEMM rate; reward has no floor (grading text).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from rlvr_fast.models.checkpoint import empty_model
from rlvr_fast.models.config import ModelConfig

LAYOUTS = ("forward", "grad_input", "grad_weight")
# The fused policy loss's LM head GEMMs per completion token (rlvr_fast.ops.policy_loss): logits
# in pass 1, logits again in pass 2, then d hidden and d W.
POLICY_LOSS_HEAD_GEMMS = (("forward", 2), ("grad_input", 1), ("grad_weight", 1))
# Gradient clip (norm: read g; scale: read and write g) and fused AdamW (read p, g, m, v; write
# p, m, v), fp32.
OPTIMIZER_BYTES_PER_PARAMETER = 4 + 8 + 28
PHASES = ("rollout", "reward", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class Gemm:
    """``calls`` GEMMs of a [rows, inner] activation with an [inner -> cols] weight, in
    ``layout``: all of them 2 rows inner cols FLOPs each."""

    rows: int
    inner: int
    cols: int
    layout: str = "forward"
    calls: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.inner * self.cols * self.calls

    @property
    def key(self) -> tuple[int, int, int, str]:
        return self.rows, self.inner, self.cols, self.layout


@dataclass
class PhaseWork:
    """A phase's GEMMs, its attention products (FLOPs) and the bytes it must stream."""

    gemms: list[Gemm] = field(default_factory=list)
    attention_flops: int = 0
    streamed_bytes: int = 0

    @property
    def flops(self) -> int:
        return sum(g.flops for g in self.gemms) + self.attention_flops


@dataclass(frozen=True)
class ModelShapes:
    """The (in, out) features of one decoder layer's projections and of the LM head, read from
    the model built on the meta device, and what attention needs."""

    layer_projections: tuple[tuple[int, int], ...]
    lm_head: tuple[int, int]
    layers: int
    query_features: int  # heads x head_dim: the width of attention's two products

    @classmethod
    def of(cls, config: ModelConfig) -> ModelShapes:
        model = empty_model(config)
        layer = model.model.layers[0]
        projections = tuple(
            (m.in_features, m.out_features) for m in layer.modules() if isinstance(m, nn.Linear)
        )
        head = model.lm_head
        return cls(
            projections,
            (head.in_features, head.out_features),
            config.num_hidden_layers,
            config.num_attention_heads * config.head_dim,
        )

    def layer_gemms(self, rows: int, layout: str, passes: int = 1) -> list[Gemm]:
        """Every decoder layer's projections over ``rows`` tokens, ``passes`` times."""
        if layout == "forward":
            return [
                Gemm(rows, i, o, layout, self.layers * passes) for i, o in self.layer_projections
            ]
        # Gradients: dX = dY W is a [rows, out] x [out, in] GEMM; dW = dY^T X an [out, rows] x
        # [rows, in] one; both 2 rows in out FLOPs.
        return [Gemm(rows, o, i, layout, self.layers * passes) for i, o in self.layer_projections]

    def recompute_gemms(self, rows: int) -> list[Gemm]:
        """A checkpointed layer's forward again in backward, up to the last tensor backward
        needs (torch's non-reentrant recompute stops early there): every projection but the
        layer's last, whose output nothing saves (the MLP's down projection feeds the residual
        sum)."""
        return [Gemm(rows, i, o, "forward", self.layers) for i, o in self.layer_projections[:-1]]

    def head_gemms(self, rows: int, layout: str = "forward", calls: int = 1) -> list[Gemm]:
        hidden, vocab = self.lm_head
        if layout == "forward":
            return [Gemm(rows, hidden, vocab, layout, calls)] if rows else []
        return [Gemm(rows, vocab, hidden, layout, calls)] if rows else []

    def attention_flops(self, pairs: int) -> int:
        """QK^T and PV over ``pairs`` (query, key) pairs, every layer."""
        return 2 * 2 * self.query_features * pairs * self.layers


def causal_pairs(prompt_len: int, lengths: list[int]) -> int:
    """(query, key) pairs of a prompt and its completions attending causally, the prompt shared:
    the prompt's own, and each completion token's to the prompt and its completion's earlier
    tokens (itself included)."""
    pairs = prompt_len * (prompt_len + 1) // 2
    for n in lengths:
        pairs += n * prompt_len + n * (n + 1) // 2
    return pairs


def questions_of(record: dict) -> list[dict]:
    """The per-prompt records of a ledger line (one, or a multi-question line's)."""
    return record["questions"] if record.get("questions") else [record]


def ledger_flops(record: dict) -> dict[str, int]:
    """The ledger's Full FLOPs of the step, split by phase (they sum to ``flops_full``)."""
    p = record["params"]
    return {
        "prefill": 2 * record["pref"] * p,
        "decode": 2 * record["gen"] * p,
        "forward": 2 * record["bwd_full"] * p,
        "backward": 4 * record["bwd_full"] * p,
    }


def executed_work(
    record: dict, shapes: ModelShapes, group: int, checkpointing: bool
) -> dict[str, PhaseWork]:
    """What the step executes, phase by phase (the module docstring's count)."""
    questions = questions_of(record)
    rows = group * len(questions)  # decode rows per step, every row alive
    rollout = PhaseWork()
    rollout.gemms += shapes.layer_gemms(record["prefill_run"], "forward")
    rollout.gemms += shapes.head_gemms(len(questions))
    decode_steps = -(-record["decode_rows"] // rows)
    rollout.gemms += shapes.layer_gemms(rows, "forward", decode_steps)
    rollout.gemms += shapes.head_gemms(rows, calls=decode_steps)
    forward, backward = PhaseWork(), PhaseWork()
    for question in questions:
        pairs = causal_pairs(question["prompt_len"], question["lengths"])
        rollout.attention_flops += shapes.attention_flops(pairs)
        if question["bwd_full"]:
            completions = sum(question["lengths"])
            # A completion's last token is only a target: it is never fed.
            tokens = question["prompt_len"] + sum(n - 1 for n in question["lengths"] if n)
            forward.gemms += shapes.layer_gemms(tokens, "forward")
            for layout, calls in POLICY_LOSS_HEAD_GEMMS:
                forward.gemms += shapes.head_gemms(completions, layout, calls)
            forward.attention_flops += shapes.attention_flops(pairs)
            backward.gemms += shapes.layer_gemms(tokens, "grad_input")
            backward.gemms += shapes.layer_gemms(tokens, "grad_weight")
            backward.attention_flops += 2 * shapes.attention_flops(pairs)
            if checkpointing:
                backward.gemms += shapes.recompute_gemms(tokens)
                backward.attention_flops += shapes.attention_flops(pairs)
    optimizer = PhaseWork(streamed_bytes=OPTIMIZER_BYTES_PER_PARAMETER * record["params"])
    return {"rollout": rollout, "forward": forward, "backward": backward, "optimizer": optimizer}


def time_gemm(gemm: Gemm, repeats: int = 3, budget: float = 0.2) -> float:
    """Seconds of one GEMM of ``gemm``'s shape and layout (fp32, this process's threads): the
    minimum over at least ``repeats`` calls and ``budget`` seconds of calls, after a warm-up
    call (on a shared machine a call's time is the GEMM's plus whatever else ran; the minimum
    is the one least disturbed)."""
    m, k, n = gemm.rows, gemm.inner, gemm.cols
    if gemm.layout == "grad_weight":  # [m, n]^T x [m, k]: dY^T X
        a, b = torch.randn(m, n).T, torch.randn(m, k)
    elif gemm.layout == "grad_input":  # [m, k] x [k, n], the weight [k, n] stored as is
        a, b = torch.randn(m, k), torch.randn(k, n)
    else:  # X W^T, W stored [n, k] as nn.Linear holds it
        a, b = torch.randn(m, k), torch.randn(n, k).T
    torch.mm(a, b)
    best, spent, calls = float("inf"), 0.0, 0
    while calls < repeats or spent < budget:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def stream_rate(megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes per second a copy of ``megabytes`` streams (read + write), the best of ``repeats``."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


class GemmTimer:
    """Each distinct GEMM timed once in this process; a phase's floor from those times."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int, int, str], float] = {}
        self.stream_bytes_per_second: float | None = None

    def gemm_seconds(self, gemm: Gemm) -> float:
        if gemm.key not in self.seconds:
            self.seconds[gemm.key] = time_gemm(gemm)
        return self.seconds[gemm.key] * gemm.calls

    def floor(self, work: PhaseWork) -> float:
        """Seconds the phase cannot go below: its GEMMs at their measured times, attention's
        products at the phase's GEMM rate, its streamed bytes at the copy rate."""
        gemm_flops = sum(g.flops for g in work.gemms)
        seconds = sum(self.gemm_seconds(g) for g in work.gemms)
        if work.attention_flops and gemm_flops:
            seconds += work.attention_flops * seconds / gemm_flops
        if work.streamed_bytes:
            if self.stream_bytes_per_second is None:
                self.stream_bytes_per_second = stream_rate()
            seconds += work.streamed_bytes / self.stream_bytes_per_second
        return seconds

    def rate(self, work: PhaseWork) -> float | None:
        """The phase's GEMMs' FLOPs per second as timed here (None: it has none)."""
        seconds = sum(self.gemm_seconds(g) for g in work.gemms)
        return sum(g.flops for g in work.gemms) / seconds if seconds else None
