"""Runtimes: what executes a loaded model version (ONNX Runtime, pipelines)."""
