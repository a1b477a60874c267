"""The CacheGen codec: KV tensor [L, 2, T, H, D] <-> bytes. Pure functions; no sockets, no
files but profiles, no asyncio. See docs/benchmarks.md for what each level costs and keeps."""
from .cachegen import decode, encode
from .errors import CodecError
from .levels import LADDER, LEVELS, Level
from .profile import Profile

__all__ = ["encode", "decode", "CodecError", "Profile", "Level", "LEVELS", "LADDER"]
