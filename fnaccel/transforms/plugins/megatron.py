"""`MegatronLMPlugin`: Accelerate's Megatron-LM settings, with its field names and defaults.

Accepted and validated so that a config moves over and is checked; building
its engine raises `ConfigError` with the reason (Megatron-LM runs on CUDA GPUs
only). DeepSpeed, the engine fnaccel does drive, is `fnaccel.transforms.plugins.deepspeed`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from fnaccel._errors import ConfigError
from fnaccel.checks import require_bools, require_count, require_number

__all__ = ["MegatronLMPlugin", "megatron_refusal"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronLMPlugin:
    """Accelerate's Megatron-LM settings, validated; `transform` raises (CUDA only).

    >>> MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4).tp_degree
    2
    """

    tp_degree: int | None = None
    pp_degree: int | None = None
    num_micro_batches: int | None = None
    gradient_clipping: float | None = None
    sequence_parallelism: bool | None = None
    recompute_activations: bool | None = None
    use_distributed_optimizer: bool | None = None
    pipeline_model_parallel_split_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    is_train_batch_min: bool = True
    train_iters: int | None = None
    train_samples: int | None = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_warmup_fraction: float | None = None
    min_lr: float = 0
    consumed_samples: list[int] | None = None
    no_wd_decay_cond: Callable[..., bool] | None = None
    scale_lr_cond: Callable[..., bool] | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    tensorboard_dir: str | None = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: type | None = None
    custom_train_step_kwargs: Mapping[str, object] | None = None
    custom_model_provider_function: Callable[..., object] | None = None
    custom_prepare_model_function: Callable[..., object] | None = None
    other_megatron_args: Mapping[str, object] | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in (
            "tp_degree",
            "pp_degree",
            "num_micro_batches",
            "num_layers_per_virtual_pipeline_stage",
            "train_iters",
            "train_samples",
            "lr_decay_iters",
            "lr_decay_samples",
            "seq_length",
            "encoder_seq_length",
            "decoder_seq_length",
            "eval_iters",
            "eval_interval",
        ):
            require_count(owner, name, getattr(self, name))
        for name in ("pipeline_model_parallel_split_rank", "lr_warmup_iters", "lr_warmup_samples"):
            require_count(owner, name, getattr(self, name), least=0)
        for name in ("gradient_clipping", "start_weight_decay", "end_weight_decay", "min_lr", "lr_mult"):
            require_number(owner, name, getattr(self, name))
        require_bools(
            self,
            (
                "sequence_parallelism",
                "recompute_activations",
                "use_distributed_optimizer",
                "is_train_batch_min",
                "megatron_dataset_flag",
                "set_all_logging_options",
                "return_logits",
            ),
            (),
        )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            raise ConfigError(
                f"{owner}: lr_warmup_fraction must be within [0, 1], got {self.lr_warmup_fraction!r}"
            )
        for name, choices in (
            ("weight_decay_incr_style", ("constant", "linear", "cosine")),
            ("lr_decay_style", ("constant", "linear", "cosine", "inverse-square-root")),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{owner}: {name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if (self.pp_degree or 1) > 1 and self.num_micro_batches is None:
            raise ConfigError(f"{owner}: pp_degree {self.pp_degree} needs num_micro_batches")

    def transform(self) -> NoReturn:
        """Always raises: Megatron-LM's engine is for CUDA GPUs only.

        Measured on megatron-core 0.16 (its process groups do start on gloo):
        its ``DistributedDataParallel`` allocates the gradient buffer on
        ``torch.cuda.current_device()``, its ``DistributedOptimizer`` accepts
        only ``torch.cuda`` tensors, and its GPT model and pipeline schedules
        use CUDA streams; ``megatron/core`` calls CUDA directly 573 times.

        >>> MegatronLMPlugin(tp_degree=2).transform()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fnaccel._errors.ConfigError: MegatronLMPlugin: Megatron-LM's engine runs on CUDA GPUs only ...
        """
        raise ConfigError(f"{type(self).__name__}: {megatron_refusal()}")


def megatron_refusal() -> str:
    """Why this build runs no Megatron-LM engine, and what to use instead: the one
    message of `MegatronLMPlugin.transform` and ``fnaccel launch --use_megatron_lm``."""
    import torch

    cuda = (
        "this machine has CUDA, but this build of fnaccel does not drive Megatron-LM"
        if torch.cuda.is_available()
        else "this machine has no CUDA device"
    )
    installed = "installed" if importlib.util.find_spec("megatron") else "not installed"
    return (
        f"Megatron-LM's engine runs on CUDA GPUs only ({cuda}; megatron-core is {installed}): its "
        "DistributedDataParallel allocates gradient buffers on torch.cuda.current_device(), its "
        "DistributedOptimizer accepts only torch.cuda tensors and its model and pipeline schedules "
        "use CUDA streams. Train data-parallel with fa.ddp() or sharded with fa.fsdp()"
    )
