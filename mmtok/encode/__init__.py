"""`mmtok encode`: media -> codes, one rank at a time, for images and audio alike.

  loop.py           the modality-neutral rank loop: loader ahead -> device -> committer behind, one Meter
  work.py           images: the rank's batches of the plan (formats.plan.Plan), joined with the manifest rows
  loader.py         images: loader threads that decode, resize into pinned buffers and tokenize text
  runner.py         images through the loop: document templates (mmtok.documents), commits, progress, stats
  audio.py          audio through the same loop: Shar shards -> the audio token cache and sequences
  audio_batches.py  audio: bucketed batches of one Shar shard

A new image or audio codec lives in mmtok/codecs/; this package only runs it.
Public entry points: `mmtok.encode.runner.encode_image_rank(...)` and `mmtok.encode.audio.encode_audio_rank(...)`.
The part format (commits, resume, items, carry) is `mmtok.formats.commitlog`; which rank does what is
`mmtok.ranks`.
"""
