"""What a chunk from a peer must be before any of it is decoded or sized: at a level the fetch
asked for, the key it asked for, and a bitstream whose header declares the plan's chunk (its
token range, the model's profile, its shape). Reading a header allocates nothing; a size a
peer declares is believed only once it is the size that was asked for."""
from __future__ import annotations

from dataclasses import dataclass

from codec import baselines, bitstream as bs
from codec.tuning import catalog, levels as codec_levels, registry
from codec.errors import CodecError
from codec.profile import Profile


class Refused(CodecError):
    """A chunk that is not the one asked for; `reason` names the check that refused it."""

    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason = reason  # level_not_asked, wrong_key, wrong_level, wrong_range, wrong_model, ...


@dataclass(frozen=True)
class Wanted:
    """Chunk i of a fetch as its plan asked for it."""

    key: bytes
    start: int  # token range [start, end) of the prompt
    end: int
    model_id: str
    layer_ids: tuple[int, ...]  # the profile layers asked for (all, but for a hybrid model's window)
    heads: int
    head_dim: int
    levels: tuple[str, ...]  # the levels the fetch accepts
    all_layers: int = 0  # the profile's layer count

    @classmethod
    def of(cls, keys: list[bytes], bounds: list[tuple[int, int]], i: int, profile: Profile,
           levels: list[str], layers: tuple[int, ...] | None = None) -> Wanted:
        s, e = bounds[i]
        ids = tuple(layers) if layers is not None else tuple(range(profile.layers))
        return cls(keys[i], s, e, profile.model_id, ids, profile.heads, profile.head_dim, tuple(levels), profile.layers)

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.end - self.start, self.heads, self.head_dim)


def admit(payload: bytes | memoryview, level: str, chunk: Wanted, key: bytes | None = None) -> None:
    """None if `payload`, said by its sender to be `level` (and the chunk of `key`, when it
    said), is the chunk asked for; else Refused naming what is not."""
    if level not in chunk.levels or level not in catalog.SCHEMES:
        raise Refused("level_not_asked", f"it is at level {level!r}, which the fetch did not ask for "
                                         f"(it asked for {', '.join(chunk.levels) or 'text only'})")
    if key is not None and key != chunk.key:
        raise Refused("wrong_key", f"it is the chunk of key {key.hex()[:16]}, not of the key asked, "
                                   f"{chunk.key.hex()[:16]}")
    if not catalog.SCHEMES[level].is_level:
        _baseline(payload, level, chunk)
    else:
        _bitstream(payload, level, chunk)


def _baseline(payload: bytes | memoryview, level: str, chunk: Wanted) -> None:
    try:
        code, shape, _ = baselines.header(payload)
    except CodecError as e:
        raise Refused("bad_header", f"its {level} header does not parse: {e}") from None
    if code != baselines.SCHEMES[level].code:
        raise Refused("wrong_level", f"its header is baseline scheme {code}, not {level}'s "
                                     f"{baselines.SCHEMES[level].code}")
    if shape != chunk.shape:
        raise Refused("wrong_shape", f"its header declares shape {list(shape)}, the chunk's is {list(chunk.shape)}")
    if level == "zstd-fp16":
        want = 2 * chunk.layers * 2 * (chunk.end - chunk.start) * chunk.heads * chunk.head_dim
        try:
            declared = baselines.ZstdFP16.declared_bytes(payload)
        except CodecError as e:
            raise Refused("bad_header", str(e)) from None
        if declared not in (None, want):  # None: the decode stops at the shape's bytes
            raise Refused("wrong_shape", f"its zstd frame declares {declared} bytes, the chunk's fp16 KV is {want}")


def _bitstream(payload: bytes | memoryview, level: str, chunk: Wanted) -> None:
    try:
        h = bs.unpack(payload, check_crc=False)  # the header and tables only; the decoder checks the crc
    except CodecError as e:
        raise Refused("bad_header", f"its bitstream does not parse: {e}") from None
    code = codec_levels.LEVELS[level].code
    if h.level != code:
        raise Refused("wrong_level", f"its bitstream is level code {h.level}, not {level}'s {code}")
    if (h.start, h.start + h.tokens) != (chunk.start, chunk.end):
        raise Refused("wrong_range", f"it holds tokens [{h.start}, {h.start + h.tokens}), not the chunk's "
                                     f"[{chunk.start}, {chunk.end})")
    try:
        prof = registry.find(h.profile_id)
    except CodecError as e:
        raise Refused("unknown_profile", str(e)) from None
    if prof.model_id != chunk.model_id:
        raise Refused("wrong_model", f"it was coded with profile {h.profile_id.hex()} for model "
                                     f"{prof.model_id!r}, not for {chunk.model_id!r}")
    if h.shape != chunk.shape:
        raise Refused("wrong_shape", f"its bitstream declares shape {list(h.shape)}, the chunk's is "
                                     f"{list(chunk.shape)}")
    if h.held_layers() != chunk.layer_ids:
        raise Refused("wrong_layers", f"it holds layers {list(h.held_layers())}, not the {list(chunk.layer_ids)} asked")
