"""The codec's tuning: what the method (codec/) is run at and with. Levels (a scale on a
profile's steps), per-chunk rate control and per-token steps choose each chunk's steps; the
profile carries what calibration tuned for them (tuned.Tuning); the catalog prices every
scheme; the registry finds profiles. `named` gives the method's values by names.

It imports the method, never the pool (codec.pool): tuning is pure functions and a profile
lookup, usable in any process without starting one (tests/test_layering.py)."""
