"""The memory plan of one rank of a sharded run (``shard="fsdp"``, ``rlvr_fast.train.sharding``):
the unsharded plan's terms with what FSDP2 shards divided by the world size W, and what sharding
adds.

- Sharded over the W ranks: the fp32 master weights, the AdamW moments (or Adafactor's factors),
  the gradients and the optimizer step's temporaries (each rank steps its own shards). In fp32
  and bf16-true, where the optimizer steps the weights themselves, the trained weights' shards
  are a term of their own.
- Whole on every rank: the engine's copy of the weights in the compute dtype (the unsharded
  plan's weights term, renamed), which rollouts decode from and which is refreshed from the
  shards after each step; the activations, the loss and the KV cache.
- Added: the gather transient, the largest FSDP group (one decoder layer, or the root: the
  embedding, the final norm and an untied LM head) gathered whole in the compute dtype for a
  pass, with its whole gradient in fp32 before the reduce-scatter; and the reduce-scatter's
  buckets, that gradient again as the collective's input (FSDP2 copies it into one flat buffer);
  both during backward. The engine's refresh after the optimizer step gathers one group at a
  time into the engine's copy (FSDP2's all-gather buffer and the group copied out of it, 2 x e
  bytes a parameter of the group, the gradients already freed), under the gather transient,
  and building the shards at startup holds no second full copy: neither adds a term.
- Dropped: the unit-gradient sum. The plan is of pooled steps; a sharded step of
  ``combine_questions=unit_norm`` questions holds 1/W of the gradients more (its sum of unit
  gradients, ``OptimizerStepping.accumulate_sharded_unit_gradients``), which it does not count.
"""

from __future__ import annotations

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.train.memory_plan import BACKWARD, Term
from rlvr_fast.train.memory_terms import PRECISIONS

# Terms, by the start of their names, that each rank holds 1/W of.
SHARDED_TERMS = (
    "fp32 master weights",
    "AdamW moments",
    "Adafactor",
    "gradients",
    "AdamW step temporaries",
)


def sharded_terms(config: ModelConfig, run, terms: list[Term]) -> list[Term]:
    """``terms`` (the unsharded plan's) as one rank of ``run.world_size``
    sharded ranks holds them."""
    world = run.world_size
    precision = PRECISIONS[run.precision]
    out = []
    for term in terms:
        if term.name == "unit-gradient sum":
            continue
        if term.name.startswith("weights ("):
            out.append(Term(f"engine's full copy, {term.name}", term.bytes, term.how))
            if not precision.master:
                shards = -(-term.bytes // world)
                how = f"{term.how} / {world} ranks"
                out.append(Term("trained weights' shards", shards, how))
            continue
        if term.name.startswith(SHARDED_TERMS):
            out.append(
                Term(
                    f"{term.name}, 1/{world}",
                    -(-term.bytes // world),
                    f"{term.how} / {world} ranks",
                    counted=term.counted,
                    phase=term.phase,
                )
            )
            continue
        out.append(term)
    group, where = largest_group(config, run.untied)
    e = precision.compute
    out.append(
        Term(
            "gather transient",
            group * (e + 4),
            f"the largest group ({where}): {group / 1e6:,.1f}M x ({e} B gathered + 4 B gradient)",
            phase=BACKWARD,
        )
    )
    buckets = f"{group / 1e6:,.1f}M x 4 B"
    out.append(Term("reduce-scatter buckets", group * 4, buckets, phase=BACKWARD))
    return out


def largest_group(config: ModelConfig, untied: bool) -> tuple[int, str]:
    """The parameters of the largest FSDP group, and which it is: a decoder layer, or the root
    (the embedding, the final norm and an untied LM head)."""
    layers = config.num_hidden_layers
    embedding = config.vocab_size * config.hidden_size
    head = embedding if (untied or not config.tie_word_embeddings) else 0
    per_layer = config.num_parameters(untied=untied) - embedding - head - config.hidden_size
    per_layer //= layers
    root = embedding + head + config.hidden_size
    return (root, "the root") if root >= per_layer else (per_layer, "a decoder layer")
