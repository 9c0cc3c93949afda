"""Integrations of deltafuse's ops into model libraries (transformers)."""
