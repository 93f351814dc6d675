"""The model repository (Triton layout), model configuration and model lifecycle."""
