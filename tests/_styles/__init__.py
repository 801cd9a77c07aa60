"""The breadth corpus: training loops in many public styles, with trackdiag wired in as the README
shows, each runnable healthy or with planted faults (see ``_common`` for the contract).

``STYLE_NAMES`` lists the style modules; ``load(name)`` imports one (heavy dependencies such as
transformers and Lightning are imported inside each style's ``run``), ``all_styles()`` all of them.
"""
from __future__ import annotations

import importlib
from types import ModuleType

STYLE_NAMES: tuple[str, ...] = (
    "vae_sum",
    "gan",
    "actor_critic",
    "reinforce",
    "greedy_layerwise",
    "finetune_frozen",
    "two_opt_disjoint",
    "hf_causal_lm",
    "mixup_ema",
    "regression_mse",
    "full_batch",
    "ddpm",
    "recommender_sparse",
    "seq2seq_per_example",
    "contrastive_infonce",
    "triplet_metric",
    "normalizing_flow",
    "distillation",
    "lbfgs_closure",
    "trainer_owned_optimizer",
    "amp_bf16",
    "accelerate_cv",
    "lightning_ae",
    "multitask",
    "word2vec_sgns",
    "adversarial_fgsm",
    "moe_top1",
    "sam_two_pass",
    "checkpointed_warmup",
    "maml_second_order",
    "continual_replay",
)


def load(name: str) -> ModuleType:
    if name not in STYLE_NAMES:
        raise KeyError(f"unknown style {name!r}; known: {', '.join(STYLE_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def all_styles() -> dict[str, ModuleType]:
    return {n: load(n) for n in STYLE_NAMES}
