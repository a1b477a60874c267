"""`kvstreamd bench tables`: the CPU a codec worker spends building entropy tables, per profile.

- start: what a worker builds as it starts ([codec] warm_tables "first_use"/"start"): the
  decoders' tables of every stream at each level's steps, token classes included
  (codec.pool.warm.level_tables, one worker holding every stream);
- scale: one step scale of rate control's grid, every stream (what a chunk at a scale its
  worker has not coded yet costs inside a fetch);
- grid: every scale of the grid (CodecPool.warm_grid's background work; none for a profile not
  tuned for rate control).

Each repeat loads the profile afresh, so nothing is cached from the one before; the figures are
the process's CPU seconds (time.process_time), the median of the repeats.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from codec.profile import Profile
from codec.pool import warm
from codec.tuning import rate, registry
from codec.tuning.levels import LADDER


def _cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def measure(path: Path, repeats: int) -> dict:
    start, grid, scales = [], [], []
    for _ in range(repeats):
        prof = registry.register(Profile.load(path))
        start.append(_cpu(lambda: warm.level_tables(0, 1, [prof], tuple(LADDER))))
        scales = list(rate.grid_scales(prof))
        grid.append(_cpu(lambda: [warm.scale_tables(0, 1, prof.id, s) for s in scales]))
    g = statistics.median(grid)
    return {"profile": path.name, "model_id": prof.model_id, "streams": 2 * prof.layers, "levels": list(LADDER),
            "start_s": statistics.median(start), "grid_scales": len(scales), "grid_s": g,
            "scale_s": g / len(scales) if scales else None, "repeats": repeats}


def run(paths: list[Path] | None = None, repeats: int = 3, json_path: str | None = None) -> dict:
    paths = paths or sorted(registry.SHIPPED_DIR.glob("*" + registry.SUFFIX))
    report = {"bench": "tables", "measure": "CPU seconds of one process, median of repeats",
              "profiles": [measure(Path(p), repeats) for p in paths]}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    rows = ["| profile | streams | start (levels) | one grid scale | whole grid |", "|---|---|---|---|---|"]
    for p in report["profiles"]:
        scale = f"{p['scale_s']:.3f} s" if p["scale_s"] is not None else "-"
        grid = f"{p['grid_s']:.2f} s ({p['grid_scales']} scales)" if p["grid_scales"] else "- (not tuned)"
        rows.append(f"| {p['profile']} | {p['streams']} | {p['start_s']:.2f} s | {scale} | {grid} |")
    return "\n".join(rows)
