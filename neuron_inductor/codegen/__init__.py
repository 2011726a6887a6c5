"""Code generation: kernel IR -> NKI source (one template per kernel family) and the host wrapper."""
