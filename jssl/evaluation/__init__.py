"""Evaluation of learned features: feature collection, pooling, the kNN classifier (host and
device-sharded banks), linear heads, and the test phase and kNN monitor run during training."""
