"""TRL 1.16's ``GRPOConfig`` fields with TRL's names, types and defaults, on
``transformers.TrainingArguments`` as TRL declares them, so ``HfArgumentParser`` and ``TrlParser``
build ``rlvr_fast.GRPOConfig`` from a command line or a YAML recipe exactly as they build TRL's.

``TRLFields`` declares only what TRL adds to (or changes in) ``TrainingArguments``; the help texts
are ours. The fields that are settings of rlvr_fast declared as TRL's (``TRL_SETTINGS`` of
``rlvr_fast.trl_compat.mapping``: the policy loss's clip, KL, sapo, vespo, entropy and mask
settings, the reference sync, num_iterations, the adaptive entropy control) are not written
here: ``TRLFields`` takes them from their one declaration, with its default and help. Which of the 191 fields rlvr_fast honours, which have no effect on what it computes, and
which it refuses at a value other than TRL's default, is ``rlvr_fast.trl_compat.support``'s table.
No annotation here may postpone its evaluation: the parsers read the types at run time.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from rlvr_fast.trl_compat.mapping import TRL_SETTINGS


def trl_field(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TRLOwnFields(TrainingArguments):
    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "transformers_continuous_batching_config",
        "generation_kwargs",
        "chat_template_kwargs",
    ]

    # TrainingArguments fields whose default or type TRL changes.
    learning_rate: float = trl_field(1e-6, "initial AdamW learning rate")
    logging_steps: float = trl_field(
        10, "optimizer steps between two logs (below 1: a fraction of the run's steps)"
    )
    gradient_checkpointing: bool = trl_field(
        True, "recompute activations in the backward pass instead of keeping them"
    )
    bf16: bool | None = trl_field(None, "bfloat16 mixed precision (None: on unless fp16 is set)")
    lr_scheduler_kwargs: dict | str | None = trl_field(
        None, "extra arguments of the learning-rate schedule"
    )
    use_liger_kernel: bool = trl_field(False, "patch the model with Liger's Triton kernels")
    torch_empty_cache_steps: int | None = trl_field(
        None, "steps between two torch.<device>.empty_cache() calls (None: never)"
    )
    remove_unused_columns: bool | None = trl_field(
        False, "drop dataset columns other than the prompt before calling reward functions"
    )

    # Model
    model_init_kwargs: dict[str, Any] | str | None = trl_field(
        None, "keyword arguments of from_pretrained when the model is given as a path"
    )
    trust_remote_code: bool = trl_field(False, "allow model code from the checkpoint")
    router_aux_loss_coef: float | None = trl_field(
        None, "weight of a mixture-of-experts router's auxiliary loss"
    )
    disable_dropout: bool = trl_field(False, "turn dropout off in the model")
    cast_lm_head_to_fp32: bool = trl_field(False, "compute the LM head in float32")

    # Data and generation
    num_generations: int | None = trl_field(8, "completions sampled per prompt (G)")
    num_generations_eval: int | None = trl_field(
        None, "completions per prompt in evaluation (None: num_generations)"
    )
    max_completion_length: int | None = trl_field(512, "cap on each completion's tokens")
    ds3_gather_for_generation: bool = trl_field(
        True, "gather DeepSpeed ZeRO-3 weights before generating"
    )
    shuffle_dataset: bool | None = trl_field(True, "shuffle the training prompts every epoch")
    pad_to_multiple_of: int | str | None = trl_field(
        "auto", "pad sequences to a multiple of this length"
    )
    generation_batch_size: int | None = trl_field(
        None, "completions generated at once over all processes (exclusive with the next)"
    )
    steps_per_generation: int | None = trl_field(
        None, "micro-batches each generation batch serves (None: gradient_accumulation_steps)"
    )
    temperature: float = trl_field(1.0, "sampling temperature")
    top_p: float = trl_field(1.0, "nucleus of top-p sampling")
    top_k: int = trl_field(0, "sample among the k most likely tokens (0: all)")
    min_p: float | None = trl_field(None, "drop tokens below min_p times the top probability")
    generation_kwargs: dict | str | None = trl_field(None, "extra generation settings")
    chat_template_kwargs: dict | str | None = trl_field(
        None, "extra arguments of the chat template"
    )
    repetition_penalty: float = trl_field(1.0, "penalty on tokens already in the sequence")
    cache_implementation: str | None = trl_field(None, "KV-cache class of transformers' generate")

    # vLLM
    use_vllm: bool = trl_field(False, "generate with vLLM")
    vllm_mode: str = trl_field("colocate", "vLLM beside training (colocate) or as a server")
    vllm_model_impl: str = trl_field("vllm", "vLLM's model implementation")
    vllm_enable_sleep_mode: bool = trl_field(False, "offload vLLM's weights between generations")
    vllm_structured_outputs_regex: str | None = trl_field(
        None, "regex that vLLM's completions must match"
    )
    vllm_server_base_url: str | None = trl_field(None, "URL of the vLLM server")
    vllm_server_host: str = trl_field("0.0.0.0", "host of the vLLM server")
    vllm_server_port: int = trl_field(8000, "port of the vLLM server")
    vllm_server_timeout: float = trl_field(240.0, "seconds to wait for the vLLM server")
    vllm_group_port: int = trl_field(51216, "port of the weight-update group of vLLM")
    vllm_gpu_memory_utilization: float = trl_field(0.3, "GPU memory share of colocated vLLM")
    vllm_max_model_length: int | None = trl_field(None, "context length of vLLM")
    vllm_tensor_parallel_size: int = trl_field(1, "tensor-parallel size of colocated vLLM")

    # Loss
    reward_weights: list[float] | None = trl_field(
        None, "weight of each reward function (None: 1 each)"
    )
    multi_objective_aggregation: str = trl_field(
        "sum_then_normalize", "sum rewards then normalise, or normalise each then sum"
    )
    scale_rewards: str = trl_field(
        "group", "divide advantages by the std of the group, the batch, or none"
    )
    loss_type: str = trl_field("dapo", "normalisation of the loss (dapo, grpo, dr_grpo, ...)")
    mask_truncated_completions: bool = trl_field(
        False, "leave completions cut at max_completion_length out of the loss"
    )
    max_tool_calling_iterations: int | None = trl_field(
        None, "cap on tool-calling rounds per completion"
    )
    vllm_importance_sampling_correction: bool = trl_field(
        True, "correct for vLLM's sampling distribution"
    )
    vllm_importance_sampling_mode: str = trl_field(
        "sequence_mask", "how vLLM's importance ratio is applied"
    )
    vllm_importance_sampling_clip_max: float | None = trl_field(
        3.0, "upper bound of vLLM's importance ratio"
    )
    vllm_importance_sampling_clip_min: float | None = trl_field(
        None, "lower bound of vLLM's importance ratio"
    )
    use_bias_correction_kl: bool = trl_field(True, "importance-weight the KL estimate")

    # Logging
    log_completions: bool = trl_field(False, "print and save a table of prompts and completions")
    log_multimodal: bool = trl_field(True, "log images with completions")
    num_completions_to_print: int | None = trl_field(
        None, "rows of the printed completions table (None: all)"
    )
    log_unique_prompts: bool = trl_field(False, "one row per prompt in logged tables")
    log_completions_hub_repo: str | None = trl_field(None, "Hub dataset to push completions to")
    use_transformers_continuous_batching: bool = trl_field(
        False, "generate with transformers' continuous batching"
    )
    transformers_continuous_batching_config: dict | str | None = trl_field(
        None, "settings of transformers' continuous batching"
    )
    use_transformers_paged: bool = trl_field(
        False, "deprecated name of use_transformers_continuous_batching"
    )
    vllm_importance_sampling_cap: float | None = trl_field(
        None, "deprecated name of vllm_importance_sampling_clip_max"
    )


TRLFields = dataclasses.make_dataclass(
    "TRLFields",
    [
        (name, hint, trl_field(f.default, f.metadata["help"]))
        for name, (f, hint) in TRL_SETTINGS.items()
    ],
    bases=(TRLOwnFields,),
    namespace={"__module__": __name__},
)
