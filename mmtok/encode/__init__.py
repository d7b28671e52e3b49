"""`mmtok encode` for images: one rank's share of a plan -> a durable Megatron part shard.

  work.py       the rank's batches of the plan, joined with the manifest columns it needs
  reader.py     the manifest rows a rank needs (bytes come from formats.manifest.MemberReader)
  loader.py     loader threads: decode, resize into pinned buffers, tokenize text, ahead of the device
  documents.py  token documents per plan mode (templates of text ids and image slots)
  chat.py       SFT conversations rendered with the tokenizer's chat template
  runner.py     the device loop, document assembly, background commits, progress and stats
  standin.py    a simulated image device for tests and benchmarks (not a codec)

Public entry point: `mmtok.encode.runner.encode_rank(plan_dir, out, codec, rank=, world_size=, device=, options=)`.
The part-shard format (commits, resume, carry) lives in `mmtok.formats.commitlog`.
"""
