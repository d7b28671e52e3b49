"""Curation before the GPUs: perceptual hashes, duplicate groups."""
