"""Environment report: what a run needs to be reproduced or compared.

``environment_report()`` returns a JSON-ready dict: python, platform, host; torch version, CUDA and
cuDNN versions, the devices (name, capability, memory); versions of key packages (those
installed); seeds and determinism settings (``torch.initial_seed()``, which is the seed set by
``torch.manual_seed`` or a random one chosen by torch; ``PYTHONHASHSEED``;
``torch.are_deterministic_algorithms_enabled()``; ``cudnn.deterministic``/``benchmark``;
``CUBLAS_WORKSPACE_CONFIG``). Cost: package metadata look-ups, a few ms; no device work.
"""
from __future__ import annotations

import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

import torch

PACKAGES = ("trackdiag", "numpy", "hydra-core", "omegaconf", "mlflow", "wandb", "matplotlib", "lightning",
            "transformers", "accelerate", "deepspeed", "triton", "scikit-learn", "torchvision", "timm")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed version of each of ``names`` (missing ones left out)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def devices() -> list[dict[str, Any]]:
    """CUDA devices (name, compute capability, memory) or, without CUDA, the CPU."""
    if not torch.cuda.is_available():
        return [{"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}]
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({"type": "cuda", "index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1)})
    return out


def environment_report() -> dict[str, Any]:
    """See module docstring."""
    cudnn = torch.backends.cudnn
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
        "devices": devices(),
        "packages": package_versions(),
        "seeds": {
            "torch_initial_seed": torch.initial_seed(),
            "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"),
        },
        "determinism": {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(cudnn.deterministic),
            "cudnn_benchmark": bool(cudnn.benchmark),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        },
    }


def flatten(report: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """One level of ``key -> text`` for a two-column table (``packages.numpy -> 2.1``)."""
    out: dict[str, str] = {}
    for k, v in report.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                out[f"{prefix}{k}[{i}]"] = ", ".join(f"{a}={b}" for a, b in item.items()) if isinstance(item, dict) else str(item)
        else:
            out[f"{prefix}{k}"] = "" if v is None else str(v)
    return out
