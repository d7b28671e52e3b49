"""Omni SFT: conversations -> chat-formatted token sequences with image and audio blocks.

  pack.py   `mmtok pack`: JSONL/Parquet conversations whose media are paths/cells/base64 -> WebDataset tars
  build.py  `mmtok sft`: renders every conversation with the chat template and fills its media slots from
            the image items and the audio token cache another stage wrote

Conversation records (every input form) are `mmtok.formats.conversations`; the message schema and the chat
template renderer are `mmtok.formats.chat` (scan and audio convert read them too).
"""
