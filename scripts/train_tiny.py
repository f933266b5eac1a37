"""Pre-train the embedded default checkpoint: a tiny Qwen3 base model for synthetic arithmetic.

Like Qwen3-0.6B-Base in the study, the result should be a *base* model whose greedy accuracy on
held-out problems is low (10-35%), with two visible modes: a short guess that jumps straight to
``\\boxed{}`` and a step-by-step derivation that is far more often right. The corpus makes that
happen: every document is the study's prompt for a synthetic problem followed by a correct worked
solution, written either as a derivation or as a bare guess. Every derivation opens with the same
line, so the mode is one first-token decision, and the guess is the more common style on levels
1, 2 and 4 (``GUESS_PROBABILITY``): greedy decoding guesses there and derives on level 3, while
temperature sampling mixes both modes, which gives RL room to move the policy towards deriving.

The loss is taken on the solution tokens only: the prompt is fixed boilerplate plus random
operands, which carry nothing to learn and, at this budget, slow the model down on the part that
matters (copying operands and one-digit facts).

Everything is seeded (tokenizer training, corpus, initialisation, batch order); on a 2-core CPU
the default run takes about 12 minutes (results depend on the thread count: ``--threads 2`` made
the shipped checkpoint). Output: a Hugging Face directory (config.json, model.safetensors,
tokenizer files, generation_config.json) plus ``model_card.json`` with the training settings and
the held-out greedy and sampled accuracy.

    python scripts/train_tiny.py --out rlvr_fast/assets/tiny
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems, worked_solution
from rlvr_fast.engine import SamplingParams
from rlvr_fast.rollouts.evaluation import evaluate
from rlvr_fast.utils.files import replaced_directory
from rlvr_fast.models.checkpoint import write_model_files
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.models.policy import load_policy

EOS = "<|endoftext|>"
# Probability that a document's solution is a bare guess, per synthetic level. Above 1/2 the
# greedy policy tends to guess on that level; below, it tends to derive.
GUESS_PROBABILITY = {1: 0.75, 2: 0.75, 3: 0.3, 4: 0.75}


def build_corpus(num_documents: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) pairs; the completion ends with the end-of-sequence token."""
    rng = random.Random(seed)
    problems = synthetic_problems("train", num_documents, seed=seed)
    documents = []
    for problem in problems:
        style = "guess" if rng.random() < GUESS_PROBABILITY[problem.level] else "derive"
        documents.append((render_prompt(problem.question), worked_solution(problem, style) + EOS))
    return documents


def tokenize_corpus(
    tokenizer: Tokenizer, documents: list[tuple[str, str]], loss_on: str
) -> list[tuple[list[int], int]]:
    """Token ids per document and the index of its first loss target.

    Prompt and completion are encoded separately, exactly as the sampler sees them (the prompt
    is encoded alone, the completion is generated token by token).
    """
    prompts = tokenizer.encode_batch([p for p, _ in documents])
    completions = tokenizer.encode_batch([c for _, c in documents])
    return [
        (p.ids + c.ids, len(p.ids) if loss_on == "completion" else 1)
        for p, c in zip(prompts, completions)
    ]


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with one token per digit, as Qwen's tokenizer does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def model_config(vocab_size: int, eos_id: int, args) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        model_type="qwen3",
        eos_token_id=[eos_id],
    )


def init_weights(model: Qwen3ForCausalLM, std: float = 0.02) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.normal_(param, std=std)


def batches(
    token_rows: list[tuple[list[int], int]], batch_size: int, rng: random.Random, pad_id: int
):
    """Length-bucketed, right-padded batches; yields (ids [B, T], target mask [B, T])."""
    order = sorted(range(len(token_rows)), key=lambda i: (len(token_rows[i][0]), rng.random()))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    for group in groups:
        width = max(len(token_rows[i][0]) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.bool)
        for row, index in enumerate(group):
            tokens, first_target = token_rows[index]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, first_target : len(tokens)] = True
        yield ids, mask


def train(
    model: Qwen3ForCausalLM, token_rows: list[tuple[list[int], int]], args, pad_id: int
) -> float:
    """AdamW with linear warm-up and cosine decay; returns the smoothed per-token loss.

    Right padding needs no attention mask: causal attention never lets a real token see a later
    pad. The summed token loss is divided by a constant (the batch size times the corpus's mean
    targets per document), not by each batch's own token count: with length-bucketed batches
    the per-batch mean would weight a short guess's tokens ten times more than a derivation's
    and skew the learned guess / derive choice away from the corpus frequencies.
    """
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    total = args.epochs * math.ceil(len(token_rows) / args.batch_size)
    warmup = max(1, total // 50)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))),
    )
    targets_per_document = sum(len(ids) - first for ids, first in token_rows) / len(token_rows)
    normaliser = args.batch_size * targets_per_document
    model.train()
    loss_avg = float("nan")
    with tqdm(total=total, desc="pre-train", unit="step") as bar:
        for _ in range(args.epochs):
            for ids, mask in batches(token_rows, args.batch_size, rng, pad_id):
                logits = model(ids[:, :-1])
                target_mask = mask[:, 1:]
                loss_sum = F.cross_entropy(
                    logits[target_mask], ids[:, 1:][target_mask], reduction="sum"
                )
                optimizer.zero_grad(set_to_none=True)
                (loss_sum / normaliser).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                token_loss = loss_sum.item() / int(target_mask.sum())
                loss_avg = (
                    token_loss if math.isnan(loss_avg) else 0.98 * loss_avg + 0.02 * token_loss
                )
                bar.set_postfix(loss=f"{loss_avg:.3f}")
                bar.update()
    model.eval()
    return loss_avg


def write_checkpoint(model, tokenizer: Tokenizer, eos_id: int, staging: Path) -> None:
    write_model_files(model, staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    (staging / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": 4096,
            },
            indent=2,
        )
        + "\n"
    )
    (staging / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "bos_token_id": None}, indent=2)
        + "\n"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--documents", type=int, default=40000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--eval-problems", type=int, default=500)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads; results depend on it (2 made the shipped model)",
    )
    parser.add_argument(
        "--loss-on",
        choices=("all", "completion"),
        default="completion",
        help="train on every token, or on completions only",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    documents = build_corpus(args.documents, args.seed)
    tokenizer = train_tokenizer([p + c for p, c in documents], args.vocab)
    eos_id = tokenizer.token_to_id(EOS)
    token_rows = tokenize_corpus(tokenizer, documents, args.loss_on)
    config = model_config(tokenizer.get_vocab_size(), eos_id, args)
    model = Qwen3ForCausalLM(config)
    init_weights(model)
    print(
        f"corpus: {len(documents)} documents, {sum(len(ids) for ids, _ in token_rows)} tokens; "
        f"model: {config.num_parameters()} parameters"
    )
    final_loss = train(model, token_rows, args, eos_id)

    with replaced_directory(args.out) as staging:
        write_checkpoint(model, tokenizer, eos_id, staging)
        held_out = synthetic_problems("test", args.eval_problems, seed=args.seed)
        policy = load_policy(staging)
        report = evaluate(policy, held_out, max_new_tokens=256, desc="greedy eval").summary()
        rollout_params = SamplingParams(max_new_tokens=256, temperature=0.8, top_p=0.9)
        sampled = evaluate(
            policy,
            held_out,
            params=rollout_params,
            desc="sampled eval",
            generator=torch.Generator().manual_seed(args.seed),
        ).summary()
        card = {
            "trained_by": "scripts/train_tiny.py",
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "guess_probability_by_level": GUESS_PROBABILITY,
            "sampled_with": "temperature 0.8, top-p 0.9",
            "parameters_untied": config.num_parameters(),
            "corpus_tokens": sum(len(ids) for ids, _ in token_rows),
            "final_train_loss": round(final_loss, 4),
            "greedy_test": report,
            "sampled_test": sampled,
            "train_seconds": round(time.time() - started, 1),
        }
        (staging / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card, indent=2))


if __name__ == "__main__":
    main()
