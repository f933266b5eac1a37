"""Write a Hugging Face checkpoint at a published shape with seeded random weights, and a byte-level
tokenizer that covers its whole vocabulary.

The GPU suite (``benchmarks/gpu/check.sh``) times a run at Qwen3-0.6B-Base's shape on a machine
that cannot download the model, and 1.2 GB is far over what can be carried to it; this makes an
equivalent checkpoint there in seconds. Rewards are all 0 on random weights: it measures speed,
never learning.

    python3 scripts/make_checkpoint.py --config qwen3-0.6b --out /tmp/qwen3-0.6b --device cuda

``--config``: ``qwen3-0.6b`` (the published configuration, kept as data in
``rlvr_fast/assets/configs``), ``tiny`` (the embedded model's shape) or a path to a config.json.
Weights: every matrix N(0, 0.02) (Hugging Face's ``initializer_range``), RMSNorm weights 1 and
biases 0, drawn on ``--device`` from a generator seeded with ``--seed``, stored in the config's
``torch_dtype``.
Tokenizer: the 256 byte symbols first, ``<|endoftext|>`` at the config's end-of-sequence id, and
a distinct string of byte symbols at every other id, so any id a random model samples decodes
(most to bytes that are not valid UTF-8, which decode as U+FFFD).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import rlvr_fast
from rlvr_fast.utils.files import replaced_directory
from rlvr_fast.models.checkpoint import write_model_files
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM

ASSETS = Path(rlvr_fast.__file__).parent / "assets"
NAMED_CONFIGS = {
    "qwen3-0.6b": ASSETS / "configs" / "qwen3-0.6b-base.json",
    "tiny": ASSETS / "tiny" / "config.json",
}
EOS = "<|endoftext|>"
INIT_STD = 0.02


def resolve_config(name_or_path: str) -> Path:
    path = NAMED_CONFIGS.get(name_or_path, Path(name_or_path))
    if not path.is_file():
        raise ValueError(
            f"--config {name_or_path!r}: neither a name ({', '.join(NAMED_CONFIGS)}) "
            "nor a config.json file"
        )
    return path


def byte_level_vocab(vocab_size: int, eos_id: int) -> dict[str, int]:
    """token -> id for every id below ``vocab_size``: the 256 byte symbols at the lowest free
    ids, EOS at ``eos_id``, then strings of 2, 3, ... byte symbols in order."""
    if vocab_size < 257 or not 0 <= eos_id < vocab_size:
        raise ValueError(
            f"a byte-level vocabulary needs vocab_size >= 257 and an EOS id below it, "
            f"got vocab_size {vocab_size}, eos id {eos_id}"
        )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    strings = itertools.chain(
        alphabet,
        ("".join(s) for n in itertools.count(2) for s in itertools.product(alphabet, repeat=n)),
    )
    ids = (i for i in range(vocab_size) if i != eos_id)
    vocab = dict(zip(strings, ids))
    vocab[EOS] = eos_id
    return vocab


def byte_level_tokenizer(vocab_size: int, eos_id: int) -> Tokenizer:
    """BPE without merges: text encodes to one id per byte; every id decodes."""
    tokenizer = Tokenizer(models.BPE(vocab=byte_level_vocab(vocab_size, eos_id), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return tokenizer


def random_model(
    config: ModelConfig, *, seed: int, device: torch.device, dtype: torch.dtype
) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.to_empty(device=device)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases
                param.zero_()
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
    return model.to(dtype).eval()


def write_tokenizer(directory: Path, config: ModelConfig) -> None:
    eos_id = config.eos_token_id[0] if config.eos_token_id else None
    if eos_id is None:
        raise ValueError("the config names no eos_token_id")
    byte_level_tokenizer(config.vocab_size, eos_id).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": config.max_position_embeddings,
            },
            indent=2,
        )
        + "\n"
    )
    (directory / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": eos_id, "pad_token_id": eos_id, "bos_token_id": config.bos_token_id},
            indent=2,
        )
        + "\n"
    )


def make_checkpoint(
    config_path: Path, out: Path, *, seed: int = 0, device: str | torch.device = "cpu"
) -> ModelConfig:
    config = ModelConfig.from_file(config_path)
    dtype = getattr(torch, config.torch_dtype)
    model = random_model(config, seed=seed, device=torch.device(device), dtype=dtype)
    with replaced_directory(out) as staging:  # weights and tokenizer appear together
        write_model_files(model, staging)
        write_tokenizer(staging, config)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", required=True, help=f"{' or '.join(NAMED_CONFIGS)}, or a path to a config.json"
    )
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the weights are drawn: cpu or cuda")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        config = make_checkpoint(
            resolve_config(args.config), args.out, seed=args.seed, device=args.device
        )
    except ValueError as err:
        print(f"make_checkpoint: error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size:,}, {config.num_parameters():,} parameters untied, "
        f"{config.torch_dtype}, seed {args.seed}, in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
