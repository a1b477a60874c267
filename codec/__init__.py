"""The CacheGen codec: KV tensor [L, 2, T, H, D] <-> bytes. Pure functions; no sockets, no
files but profiles, no asyncio. See docs/benchmarks.md for what each level costs and keeps."""
from .cachegen import encode
from .decoder import Decoder, decode
from .errors import CodecError
from .levels import LADDER, LEVELS, Level
from .profile import Profile
from .select import select_layers

__all__ = ["encode", "decode", "Decoder", "CodecError", "Profile", "Level", "LEVELS", "LADDER",
           "select_layers"]
