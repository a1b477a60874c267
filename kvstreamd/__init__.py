"""kvstreamd: the daemon that stores, advertises, streams and hands over compressed KV caches,
and the model adapters, calibration and benchmarks around the codec."""
__version__ = "0.1.0"
