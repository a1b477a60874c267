"""The CacheGen codec: KV tensor [L, 2, T, H, D] <-> bytes. See docs/benchmarks.md for what
each level costs and keeps. Three rooms, dependencies one way (pool -> tuning -> method):

- the method, here at the top level: what a chunk is turned into and back (rope, pca, anchor,
  quantize, steps, entropy, rans, bitstream, cachegen, decoder, gpu, layout, select, baselines)
  and the profile it runs on (profile: the fitted statistics and their file). Pure functions
  of tensors, values and a Profile; it imports neither tuning nor the pool.
- codec.tuning: what the method is run at and with -- levels, rate control, token steps, the
  profile's tuned values (tuned.Tuning), the schemes' costs (catalog) and where profiles are
  found (registry); `named` turns a level's name and a chunk's profile id into the method's
  values. It reads profile files and the environment, no processes.
- codec.pool: the codec across worker processes (parallel.CodecPool), with their shared-memory
  segments and signals. Imported by name only where a pool is wanted.

This package's face gathers what callers use from the first two: `encode`/`decode` by a
level's name and the profile a chunk names are tuning's (codec.tuning.named)."""
from .decoder import Decoder
from .errors import CodecError
from .profile import Profile
from .select import select_layers
from .tuning import registry
from .tuning.levels import LADDER, LEVELS, Level
from .tuning.named import decode, encode

__all__ = ["encode", "decode", "Decoder", "CodecError", "Profile", "Level", "LEVELS", "LADDER",
           "select_layers", "registry"]
