"""Rules for media bytes that several stages share (scan/encode/bench/codec commands):
image decoding and RGB conversion (`images`), the target-shape rule (`resize`), audio preprocessing
(`audio`: mono, resampling, peak normalisation). No stage logic, no files."""
