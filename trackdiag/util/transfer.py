"""The one device-to-host copy per logging step."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

import numpy as np
import torch


def to_host(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Copy every tensor in ``values`` to the host with ONE transfer per device.

    Tensors are flattened and concatenated on their device, copied once, and split back;
    Python numbers pass through. Returns 1-D float64 arrays (float32 on MPS).
    """
    out: dict[str, np.ndarray] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for key, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device[v.device].append((key, v))
        else:
            out[key] = np.asarray([float(v)], dtype=np.float64)
    for device, items in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64
        with torch.no_grad():  # floats join as they are (``cat`` promotes them; one conversion after it),
            parts = [t.reshape(-1) if t.is_floating_point() else t.reshape(-1).to(dtype) for _, t in items]
            flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(dtype)  # integers exactly, before
        host = flat.cpu().numpy()  # host sync: the only one of this logging step on this device
        pos = 0
        for key, t in items:
            n = t.numel()
            out[key] = host[pos : pos + n]
            pos += n
    return out
