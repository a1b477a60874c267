"""What a codec pool's worker builds ahead of the chunks it will code: the tables of its share
of each profile's streams at each level's steps (at start, and when it learns a profile), and at
every scale rate control may give a chunk (codec.tuning.rate, in the background: CodecPool._warm_grid).
Worker k of n always codes run k of a chunk's streams (parallel.split), so it builds that run's
tables only. Every function here runs in a worker."""
from __future__ import annotations

import numpy as np

from .. import decoder
from ..profile import Profile
from ..tuning import levels, named, registry


def split(streams: int, workers: int) -> list[range]:
    """Streams 0..streams in one consecutive run per worker: worker k always gets run k, so
    the tables of a stream are built in one worker only."""
    return [range(int(part[0]), int(part[-1]) + 1) for part in np.array_split(np.arange(streams), workers) if len(part)]


def learn_profile(index: int, workers: int, path: str, warm_levels: tuple[str, ...]) -> None:
    """A profile file registered in a running worker, and warmed as at its start (add_profile)."""
    level_tables(index, workers, [registry.register(Profile.load(path))], warm_levels)


def level_tables(index: int, workers: int, known: list[Profile], warm_levels: tuple[str, ...]) -> None:
    # Worker `index` gets run `index` of every chunk's streams: it builds the decoders' tables
    # of those up front rather than stalling the first chunks that reach it, and no others
    # (a Llama-3-8B-shaped stream's tables are ~11 MB; every worker holding all of them cost
    # ~0.7 GB a worker, docs/benchmarks.md "bench scale").
    for prof in known:
        for coded in coded_layer_sets(prof):
            runs = split(2 * coded.layers, workers)
            if index < len(runs):
                for level in warm_levels:
                    named.warm(decoder.for_profile(coded), level, runs[index])


def coded_layer_sets(prof: Profile) -> list[Profile]:
    """The profiles a worker's chunks come coded with: the whole, and for a hybrid model the
    subset of its full-attention layers too (a chunk before the last window holds those only:
    codec.layout), whose decoder keeps step tables of its own. A subset's entropy models are
    its whole's (Profile.subset), so warming it builds only what the split gives this worker
    beyond its share of the whole."""
    full = tuple(i for i, w in enumerate(prof.layer_windows) if w is None)
    return [prof] if len(full) in (0, prof.layers) else [prof, prof.subset(full)]


def scale_tables(index: int, workers: int, profile_id: bytes, scale: float) -> None:
    """Worker `index`'s share of the entropy tables chunks of `profile_id` coded at `scale`
    (codec.tuning.rate: a chunk's own scale) decode with, built before such a chunk comes."""
    prof = registry.find(profile_id)
    for coded in coded_layer_sets(prof):
        runs = split(2 * coded.layers, workers)
        if index < len(runs):
            steps = levels.get(levels.LADDER[0]).steps(coded, scale)  # every level of the ladder: base_step x scale
            for s in runs[index]:
                coded.rans_models(s // 2, s % 2, float(steps[s // 2, s % 2]))


def table_steps(profile_id: bytes) -> list[tuple[int, float]]:
    """(stream, step) of every rANS table this worker holds for the profile."""
    profile = registry.find(profile_id)
    return sorted((2 * key[1] + key[2], key[3]) for key in profile._models if key[0] == "rans")


def streams_with_tables(profile_id: bytes) -> list[int]:
    profile = registry.find(profile_id)
    return sorted({2 * key[1] + key[2] for key in profile._models})


