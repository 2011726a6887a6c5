"""Integrations with other libraries. Hugging Face Transformers / TRL: see `integrations.hf`."""
