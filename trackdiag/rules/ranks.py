"""Cross-rank rules: replicas whose weights parted (``ranks_diverged``) and ranks reading the same data
(``ranks_same_data``). They read what the ``rank_sync`` probe published from the session's one
cross-rank gather; every rank judges the same record, so every rank raises the same alert at the same
step. Silent in single-process runs and for components that are not data parallel. Host only, no cost.
"""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule

#: the keys the rank_sync probe publishes per component (restated: rules never import probes)
LAYERS_DIFFER = "ranks/param_layers_differ"
PARAM_DIFF = "ranks/param_diff"
RANK_DIFF = "ranks/param_rank_diff"
SAME_BATCH = "ranks/same_batch"


class RanksDiverged(Rule):
    """Fires when the weights of a ``DistributedDataParallel`` model are not the same on every rank: the
    first differing layer in module order, the ranks off the median, and the last logging step at which
    they agreed. DDP keeps replicas identical only as long as every rank applies the same all-reduced
    gradient to the same weights; no healthy run parts them, so it is critical at once."""

    kind = "ranks_diverged"
    hint = ("The DDP replicas no longer hold the same weights, and nothing else will show it: each rank "
            "looks healthy on its own. Look for weights edited in place on some ranks only (loading a "
            "checkpoint, an EMA or re-init on one rank), a parameter replaced or added after wrapping in "
            "DDP (its gradient is never all-reduced: replace it before wrapping), gradients not synchronised "
            "(no_sync / require_backward_grad_sync=False around the step's last backward), or a per-rank "
            "optimizer state. Restart from a checkpoint saved on one rank and broadcast it.")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._agreed: dict[str, int] = {}  # component -> last logging step with identical weights
        self._fired: set[str] = set()  # components reported since they last agreed (replicas never re-converge alone)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            n = record.scalars.get(comp.key(LAYERS_DIFFER))
            if n is None:
                continue
            if n <= 0:
                self._agreed[comp.name] = record.step
                self._fired.discard(comp.name)
                continue
            if comp.name in self._fired:
                continue
            self._fired.add(comp.name)
            diff = record.tables.get(comp.key(PARAM_DIFF), {})
            layer, rel = next(iter(diff.items()), ("?", float("nan")))
            per_rank = record.tables.get(comp.key(RANK_DIFF), {})
            top = max(per_rank.values(), default=0.0)
            odd = [r for r, v in per_rank.items() if v > 0 and v >= 0.5 * top]
            who = (f"ranks {', '.join(odd)} disagree, no majority" if len(odd) == len(per_rank)
                   else f"rank(s) {', '.join(odd)} off the others")
            last = self._agreed.get(comp.name)
            since = (f"they last agreed at logging step {last}" if last is not None
                     else "they agreed at none of the logging steps (DDP made them equal when it wrapped the model)")
            name = f"{comp.name}: " if comp.name else ""
            msg = (f"{name}the weights differ across ranks: {int(n)} layer(s), first in module order '{layer}' "
                   f"(relative difference {rel:.3g}; {who}); {since}.")
            out.append(self.make(record.step, msg, rel, 0.0, layer if not comp.name else f"{comp.name}.{layer}",
                                 ["unambiguous"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"agreed": dict(self._agreed), "fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._agreed = {str(k): int(v) for k, v in state.get("agreed", {}).items()}
        self._fired = {str(k) for k in state.get("fired", ())}


class RanksSameData(Rule):
    """Fires when every rank's input batch had the same fingerprint at ``patience`` consecutive logging
    steps of a data-parallel component (DDP or FSDP2): the ranks compute the same gradient, and the run
    pays ``world`` times for one rank's progress. Usually a ``DistributedSampler`` left out (or its
    ``set_epoch`` with a per-rank seed), or a generated data set seeded alike on every rank.

    Args:
        patience: consecutive logging steps with identical batches on every rank.
    """

    kind = "ranks_same_data"
    hint = ("Every rank reads the same batches, so data parallelism adds nothing: give the DataLoader a "
            "DistributedSampler(dataset) (and call sampler.set_epoch(epoch)), or seed generated data and "
            "augmentation per rank (seed + rank). If every rank is meant to see the full batch (full-batch "
            "training), one rank does the same work; drop the others or shard the batch.")

    def __init__(self, *, patience: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.patience = max(int(patience), 1)
        self._streak: dict[str, tuple[int, int]] = {}  # component -> (consecutive identical logs, first step)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            same = record.scalars.get(comp.key(SAME_BATCH))
            if same is None:
                continue
            if same < 1.0:
                self._streak.pop(comp.name, None)
                continue
            n, first = self._streak.get(comp.name, (0, record.step))
            self._streak[comp.name] = (n + 1, first)
            if n + 1 == self.patience:
                world = int(record.scalars.get("diag/dist/world_size", 0)) or "all"
                name = f"{comp.name}: " if comp.name else ""
                msg = (f"{name}all {world} ranks fed the model identical batches at {n + 1} consecutive logging steps "
                       f"(since step {first}): no DistributedSampler, or data generated with the same seed on every "
                       f"rank. Fine only if every rank is meant to see the same full batch, which wastes the other ranks.")
                out.append(self.make(record.step, msg, float(n + 1), float(self.patience), comp.name or "batch",
                                     ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"streak": {k: list(v) for k, v in self._streak.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streak = {str(k): (int(v[0]), int(v[1])) for k, v in state.get("streak", {}).items()}
