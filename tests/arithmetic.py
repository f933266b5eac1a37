"""A fingerprint of this machine's arithmetic: which bits a training step of the embedded model
computes here.

Tests that compare bits with recorded values (the golden outputs, README's printed results) key
them by this fingerprint instead of by the machine's name: the bits of a step depend on the CPU
(the vector width torch's kernels pick, MKL's GEMM blocking, our C++ kernels' AVX2 or scalar
variants), on the torch release and on the thread count, none of which ``platform.machine()``
names. The fingerprint is the hash of one small fixed computation through the ops a training
step of the golden runs uses, on one thread:

- the rollout engine on the embedded model: paged prefill and decode through the C++ decoder,
  attention and the C++ draw (temperature + top-p, and greedy), every logit they produce hashed;
- the training pass: the model's forward and backward at the model's shapes (its GEMMs, RMSNorm,
  RoPE, SDPA, SiLU) under each loss the arms train with (the fused weighted NLL's CPU twin, arm
  1's sum-then-scale order, TRL's policy loss, eager log-softmax cross-entropy), their values and
  every gradient hashed;
- the optimizer: the gradient norm and clipping, one torch AdamW step and two zero-gradient steps
  of the C++ kernel, every parameter and moment hashed.

Triton kernels are absent: on a CPU a training step runs their torch and C++ twins (the
interpreter runs only in the kernels' own tests, which compare with references under
tolerances). Two machines with one fingerprint compute these bits alike; a step is built from
the same ops, so its bits agree too (a machine where they did not would show the fingerprint
missing an op, and the op belongs here).
"""

from __future__ import annotations

import functools
import hashlib

import torch

FINGERPRINT_THREADS = 1


class _Digest:
    def __init__(self) -> None:
        self.sha = hashlib.sha256()

    def tensor(self, name: str, value: torch.Tensor) -> None:
        self.sha.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        flat = value.detach().reshape(-1).contiguous().cpu()  # a 0-d tensor has no byte view
        self.sha.update(flat.view(torch.uint8).numpy().tobytes())

    def text(self, value: str) -> None:
        self.sha.update(value.encode())


def _rollouts(policy, prompt_ids: list[int], digest: _Digest) -> list[list[int]]:
    """Sampled and greedy completions of ``prompt_ids`` with every logit the engine computed
    hashed; the sampled ones."""
    from rlvr_fast import RolloutEngine, SamplingParams
    from rlvr_fast.rollouts.generation import generate, sample_group

    model = policy.decoder
    infer = model.infer
    logits_seen: list[torch.Tensor] = []

    @functools.wraps(infer)
    def recorded(*args, **kwargs):
        logits = infer(*args, **kwargs)
        logits_seen.append(logits.detach().clone())
        return logits

    model.infer = recorded
    try:
        engine = RolloutEngine.for_policy(policy, kv_blocks=64)
        sampled = sample_group(
            engine,
            prompt_ids,
            4,
            SamplingParams(max_new_tokens=12),
            generator=torch.Generator().manual_seed(0),
        )
        greedy = generate(engine, [prompt_ids], SamplingParams.greedy(12))
    finally:
        del model.infer  # the instance attribute; the class's method shows again
    for index, logits in enumerate(logits_seen):
        digest.tensor(f"logits{index}", logits)
    digest.text(repr((sampled.tokens, greedy.tokens)))
    return [list(c) for c in sampled.tokens if c]


def _training_pass(policy, prompt_ids: list[int], completions: list[list[int]], digest) -> None:
    """Every loss the arms train through, summed, backward; values and gradients hashed."""
    from rlvr_fast.ops import PolicyLossSettings
    from rlvr_fast.train.losses import (
        completion_token_nll,
        fused_grpo_loss,
        policy_loss,
        study_loss,
    )
    from rlvr_fast.ops.loss_types import loss_type

    model = policy.model
    advantages = torch.linspace(-1.0, 1.0, len(completions))
    token_weights = [torch.full((len(c),), float(a)) for c, a in zip(completions, advantages)]
    losses = {
        "weighted_nll": fused_grpo_loss(model, prompt_ids, completions, token_weights),
        "sum_then_scale": study_loss(
            model,
            prompt_ids,
            completions,
            loss_type("sum", order="sum_then_scale"),
            advantages,
            None,
        ),
        "policy_loss": policy_loss(
            model, prompt_ids, completions, advantages, PolicyLossSettings()
        )[0],
        "eager_nll": completion_token_nll(model, prompt_ids, completions).sum(),
    }
    total = torch.zeros(())
    for name, loss in losses.items():
        digest.tensor(name, loss)
        total = total + loss
    total.backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            digest.tensor(f"grad.{name}", parameter.grad)


def _optimizer_steps(policy, digest: _Digest) -> None:
    from rlvr_fast.ops.zero_grad_adamw import zero_grad_adamw_

    parameters = [p for p in policy.model.parameters() if p.grad is not None]
    digest.tensor("grad_norm", torch.nn.utils.clip_grad_norm_(parameters, 1.0))
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, weight_decay=0.0)
    optimizer.step()
    zero_grad_adamw_(optimizer, steps=2)
    for index, parameter in enumerate(parameters):
        digest.tensor(f"param{index}", parameter)
        for key, value in sorted(optimizer.state[parameter].items()):
            digest.tensor(f"state{index}.{key}", value)


@functools.cache
def arithmetic_fingerprint() -> str:
    """16 hex digits naming this machine's arithmetic (see the module's docstring)."""
    from rlvr_fast import load_policy, render_prompt, synthetic_problems

    threads = torch.get_num_threads()
    torch.set_num_threads(FINGERPRINT_THREADS)
    try:
        digest = _Digest()
        digest.text(f"torch {torch.__version__}")
        policy = load_policy("tiny")
        problem = synthetic_problems("train", 1, seed=2, levels=(1,))[0]
        prompt_ids = policy.tokenizer.encode(render_prompt(problem.question))
        completions = _rollouts(policy, prompt_ids, digest)
        _training_pass(policy, prompt_ids, completions, digest)
        _optimizer_steps(policy, digest)
    finally:
        torch.set_num_threads(threads)
    return digest.sha.hexdigest()[:16]


if __name__ == "__main__":
    print(arithmetic_fingerprint())
