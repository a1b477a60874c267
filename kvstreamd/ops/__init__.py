"""What operators run the fleet with: health thresholds, diagnosis and `kvstreamd doctor`, the
A/B outcome log and its report, preload, systemd notification. Imports the base modules, store/,
cluster/, client and models/ (tests/test_layering.py)."""
