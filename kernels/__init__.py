"""Attention kernels: bifurcated (shared-prefix) attention and the standard expanded-KV baseline."""
