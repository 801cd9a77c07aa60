"""Environment report: what a run needs to be reproduced or compared.

``environment_report()`` returns a JSON-ready dict: python, platform, host; torch version, CUDA and
cuDNN versions, the devices (name, capability, memory); versions of key packages (those
installed); seeds and determinism settings (``torch.initial_seed()``, which is the seed set by
``torch.manual_seed`` or a random one chosen by torch; ``PYTHONHASHSEED``;
``torch.are_deterministic_algorithms_enabled()``; ``cudnn.deterministic``/``benchmark``;
``CUBLAS_WORKSPACE_CONFIG``). Cost: one listing of each ``sys.path`` folder, a few ms; no device work.
"""
from __future__ import annotations

import os
import platform
import re
import socket
import sys
from importlib import metadata
from typing import Any

import torch

PACKAGES = ("trackdiag", "numpy", "hydra-core", "omegaconf", "mlflow", "wandb", "matplotlib", "lightning",
            "transformers", "accelerate", "deepspeed", "triton", "scikit-learn", "torchvision", "timm")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed version of each of ``names`` (missing ones left out): from the ``<name>-<version>.dist-info``
    folders of ``sys.path``, listed once (``importlib.metadata.version`` scans every path entry per name: ~4 ms a
    name on a cold cache, most of it for the packages that are not installed); a name found only as ``.egg-info``
    is asked of ``importlib.metadata``."""
    dist_info, egg_info = _installed()
    out = {}
    for name in names:
        key = _normalized(name)
        if key in dist_info:
            out[name] = dist_info[key]
        elif key in egg_info:
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
    return out


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> tuple[dict[str, str], set[str]]:
    """(normalized name -> version of each ``.dist-info`` folder, normalized names of ``.egg-info`` entries) on
    ``sys.path``; the first entry of a name wins, as for imports."""
    dist_info: dict[str, str] = {}
    egg_info: set[str] = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip, a missing folder
            continue
        for name in names:
            if name.endswith(".dist-info"):
                dist, sep, version = name[: -len(".dist-info")].partition("-")
                if sep:
                    dist_info.setdefault(_normalized(dist), version)
            elif name.endswith(".egg-info"):
                egg_info.add(_normalized(name[: -len(".egg-info")].partition("-")[0]))
    return dist_info, egg_info


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
