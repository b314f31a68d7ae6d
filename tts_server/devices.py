"""`--devices`: which devices get an engine (one engine thread and one set of slots each).

Pure policy (no torch): the caller passes how many GPUs are visible. On the CPU, `--devices 0,1`
runs that many CPU engines side by side, labelled cpu:0, cpu:1 (for tests of the multi-engine
paths on machines without GPUs; they share the cores).
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory_plan import StartupError


@dataclass(frozen=True)
class Placement:
    device: str  # what torch.device() takes: "cpu", "cuda", "cuda:1"
    label: str  # the metrics' `device` label and the name in logs: "cpu", "cuda", "cuda:1", "cpu:0"


def resolve_placements(device: str, devices: str | None, num_gpus: int) -> list[Placement]:
    """One Placement per engine. `device` is --device (auto | cpu | cuda | cuda:N), `devices` is
    --devices (None: one engine on --device; "all"; or "0,1,..."). Raises StartupError with one
    line for a combination that cannot run."""
    if devices is None:
        dev = ("cuda" if num_gpus else "cpu") if device == "auto" else device
        return [Placement(dev, dev)]
    kind = ("cuda" if num_gpus else "cpu") if device == "auto" else device
    if kind not in ("cpu", "cuda"):
        raise StartupError(f"--device {device} and --devices {devices} both choose GPUs: give "
                           f"--devices alone (with --device auto or cuda)")
    if kind == "cuda" and num_gpus == 0:
        raise StartupError(f"--devices {devices}: no GPU is visible (CUDA_VISIBLE_DEVICES?)")
    spec = devices.strip().lower()
    if spec == "all":
        if kind == "cpu":
            raise StartupError("--devices all needs GPUs and none is visible; on the CPU give "
                               "engine numbers, e.g. --devices 0,1")
        indices = list(range(num_gpus))
    else:
        try:
            indices = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise StartupError(f"--devices {devices!r}: expected 'all' or GPU numbers such as "
                               f"0,1") from None
        if not indices:
            raise StartupError("--devices is empty: expected 'all' or GPU numbers such as 0,1")
        if len(set(indices)) != len(indices) or min(indices) < 0:
            raise StartupError(f"--devices {devices!r}: each GPU number once, none negative")
        if kind == "cuda" and max(indices) >= num_gpus:
            raise StartupError(f"--devices {devices}: GPU {max(indices)} does not exist "
                               f"({num_gpus} visible: 0..{num_gpus - 1})")
    if kind == "cpu":
        return [Placement("cpu", f"cpu:{i}") for i in indices]
    return [Placement(f"cuda:{i}", f"cuda:{i}") for i in indices]
