"""`mmtok encode`: the rank loop every modality runs, and the image pieces plugged into it.

  loop.py       the modality-neutral rank loop: loader ahead -> device -> committer behind, one Meter

  work.py       the rank's batches of the plan (formats.plan.Plan), joined with the manifest rows they need
  loader.py     loader threads: decode, resize into pinned buffers, tokenize text, ahead of the device
  documents.py  token documents per plan mode (templates of text ids and image slots; SFT renders
                with mmtok.chat, which the scan also reads for a conversation's image order)
  runner.py     images through the loop: document assembly, commits, progress and stats
(audio plugs into the same loop from mmtok.audio.encode)

Public entry point: `mmtok.encode.runner.encode_rank(plan_dir, out, codec, rank=, world_size=, device=, options=)`.
The part format (commits, resume, items, carry) lives in `mmtok.formats.commitlog`.
"""
