"""The coordinator: the public Generate API, continuous batching and the speculative round loop."""
