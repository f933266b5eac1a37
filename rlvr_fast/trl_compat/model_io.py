"""The model and tokenizer a TRL script hands over, taken as TRL takes them.

``model`` is a local checkpoint path (or "tiny") or a loaded ``transformers`` causal LM of an
architecture rlvr_fast runs (Qwen3, Qwen2, Llama), or a ``peft.PeftModel`` of one (its base
weights here, its adapter: ``rlvr_fast.trl_compat.peft_model``). Its weights go into rlvr_fast's model, which
trains; ``trainer.model`` is a ``transformers`` model as TRL's is: the caller's (the trained
weights copied in whenever the policy is synced back: end of ``train()``, ``save_model``), or
for a path one built on the meta device (its config is there from the start, e.g. for a model
card) whose parameters become the policy's own tensors at the first sync (no second copy). Without ``processing_class`` the tokenizer and its chat template are loaded
from the model's directory, as TRL does, with the end-of-sequence token as pad token when the
tokenizer has none.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path

import torch

from rlvr_fast.models.checkpoint import build_model, packed_to_hf
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.policy import Policy, load_policy, resolve_model_path
from rlvr_fast.models.tokenizer import Tokenizer
from rlvr_fast.trl_compat.peft_model import base_state, peft_model_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_transformers_model(model) -> bool:
    return (
        hasattr(model, "state_dict")
        and hasattr(model, "config")
        and hasattr(model.config, "to_dict")
    )


def requested_dtype(args) -> torch.dtype | None:
    """``model_init_kwargs["dtype"]`` when it names one (None for none or "auto")."""
    requested = (
        (args.model_init_kwargs or {}).get("dtype")
        if isinstance(args.model_init_kwargs, dict)
        else None
    )
    if isinstance(requested, torch.dtype) or requested in (None, "auto"):
        return None if requested == "auto" else requested
    if requested not in DTYPES:
        raise ValueError(f"model_init_kwargs dtype {requested!r}: use one of {list(DTYPES)}")
    return DTYPES[requested]


def policy_dtype(args) -> torch.dtype:
    """The dtype the policy loads in: the one ``model_init_kwargs`` names, else float32. Under
    bf16 on CUDA (bf16-mixed) the stepping copies these weights into fp32 masters before it
    casts the model to bfloat16, so the masters start from the checkpoint's own values rather
    than their bf16 rounding."""
    return requested_dtype(args) or torch.float32


def model_directory(model) -> Path | None:
    """The local directory a model path or a loaded model's config names, if any."""
    if isinstance(model, (str, Path)):
        return resolve_model_path(model)
    name = getattr(model.config, "_name_or_path", "")
    return Path(name) if name and Path(name).is_dir() else None


def load_processing_class(model, processing_class):
    """The caller's processing class, else ``AutoTokenizer`` over the model's directory,
    padding and truncating on the left as TRL loads it."""
    if processing_class is not None:
        return processing_class
    directory = model_directory(model)
    if directory is None:
        raise ValueError(
            "processing_class is required for a model whose config names no local directory"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        directory, truncation_side="left", padding_side="left"
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_trl_policy(model, processing_class, *, device: torch.device, dtype) -> Policy:
    """rlvr_fast's policy from ``model`` (see the module docstring), with ``processing_class``'s
    tokenizer."""
    if isinstance(model, (str, Path)):
        policy = load_policy(model, device=device, dtype=dtype)
        policy.tokenizer = tokenizer_of(processing_class, policy.tokenizer.eos_token_ids)
        return policy
    if not is_transformers_model(model):
        raise TypeError(
            f"model must be a checkpoint path or a transformers model, got {type(model).__name__}"
        )
    # A PeftModel's base weights (its adapters start the LoRA run: trl_compat.peft_model).
    state = base_state(model) if peft_model_of(model) is not None else dict(model.state_dict())
    config = ModelConfig.from_hf_dict(model.config.to_dict())
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    ours = build_model(config, state, device=device, dtype=dtype, source=name)
    generation = getattr(model, "generation_config", None)
    eos = generation.eos_token_id if generation is not None else None
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return Policy(
        model=ours,
        tokenizer=tokenizer_of(processing_class, eos_ids),
        config=config,
        path=Path(name),
    )


def tokenizer_of(processing_class, eos_token_ids: list[int]) -> Tokenizer:
    """Our tokenizer over the processing class's own ``tokenizers`` backend; its end-of-sequence
    token is added to ``eos_token_ids`` as TRL does."""
    backend = getattr(processing_class, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("processing_class must be a fast tokenizer (one with backend_tokenizer)")
    eos = list(eos_token_ids)
    if processing_class.eos_token_id is not None and processing_class.eos_token_id not in eos:
        eos.insert(0, processing_class.eos_token_id)
    pad = processing_class.pad_token_id
    return Tokenizer(backend, eos, eos[0] if pad is None else pad)


def meta_transformers_model(directory: Path):
    """A ``transformers`` model of the checkpoint's config with no weights (meta device), with
    its generation config as ``from_pretrained`` reads it (the directory's, when it has one)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model


def synced_transformers_model(policy: Policy, hf_model, weights=None):
    """``hf_model`` holding the policy's weights, or ``weights`` of the same names in their
    place (a bf16-mixed run's fp32 masters). A model of a path (on the meta device until the
    first sync, then built here) is given the tensors themselves (``shared_transformers_model``):
    a sync makes no copy of the weights, which at the end of ``train()`` was the run's memory
    peak; a caller's own model gets a copy."""
    if hf_model in _SHARING:
        point_weights_to(policy, hf_model, weights)
        return hf_model
    if next(hf_model.parameters()).device.type == "meta":
        shared = shared_transformers_model(policy, hf_model.config, weights)
        shared.generation_config = hf_model.generation_config
        return shared
    tensors = hf_tensors(policy, weights)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(tensors[name])
    return hf_model


def shared_transformers_model(policy: Policy, config, weights=None):
    """A ``transformers`` model of ``config`` whose parameters are the policy's tensors (or
    ``weights``): views, the per-projection weights split out of our packed ones without a copy.
    Its buffers (RoPE's frequencies) are computed as ``from_config`` computes them."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        hf_model = AutoModelForCausalLM.from_config(config)
    point_weights_to(policy, hf_model, weights)
    hf_model.to(policy.device)
    _SHARING.add(hf_model)
    return hf_model


def point_weights_to(policy: Policy, hf_model, weights=None) -> None:
    """Make ``hf_model``'s parameters the policy's tensors (``shared_transformers_model``),
    again after a parameter of the policy was replaced by another tensor."""
    tensors = hf_tensors(policy, weights)
    for name, param in list(hf_model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        hf_model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(
            tensors[name], requires_grad=param.requires_grad
        )
    if policy.config.tie_word_embeddings:
        hf_model.tie_weights()


def hf_tensors(policy: Policy, weights=None) -> dict[str, torch.Tensor]:
    """The policy's weights (or ``weights`` in their place) by Hugging Face name, detached views
    of its own tensors (tied heads share the embedding there, so it covers both); with LoRA, the
    merged weights. KeyError when the transformers model has a name we do not."""
    state = {name: p.detach() for name, p in policy.decoder.named_parameters()}
    state.update({name: t.detach() for name, t in (weights or {}).items()})
    if policy.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return HFTensors(packed_to_hf(state, policy.config))


class HFTensors(dict):
    """Hugging Face name -> tensor; a name rlvr_fast's model lacks is a KeyError naming it."""

    def __missing__(self, name: str):
        raise KeyError(f"copy back: {name} has no counterpart in rlvr_fast's model")


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside hold their parameters on the meta device (each is allocated, never
    written, and dropped as it is registered) and their buffers as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        # A parameter already on the meta device stays the same object (a tied head).
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


# The transformers models whose parameters are a policy's tensors (shared_transformers_model).
_SHARING: weakref.WeakSet = weakref.WeakSet()
