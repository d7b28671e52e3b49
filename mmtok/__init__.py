"""mmtok: turn image and audio corpora into discrete tokens for Megatron-LM."""

__version__ = "0.1.0"
