"""The `conversations` kind: the audio slots of SFT conversations (`mmtok.formats.conversations`), in units of
at most CONVERSATION_UNIT_CLIPS clips of one input."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mmtok.audio.sources.units import ClipSpec, Unit, decode_audio, skip_record
from mmtok.errors import Skip
from mmtok.formats.chat import ConversationError
from mmtok.formats.conversations import Conversation, Located, audio_clip_id, locate, read_conversations
from mmtok.formats.skips import SkipRecord
from mmtok.media.audio import AudioReason

CONVERSATION_UNIT_CLIPS = 64  # clips per conversation unit: a worker's task, small enough for many tasks


@dataclass
class ConversationUnit(Unit):
    clips: list[tuple[_LocatedLoader, ClipSpec]] = field(default_factory=list)

    def payloads(self):
        for loader, spec in self.clips:
            yield loader, [spec]


@dataclass
class _LocatedLoader:
    located: Located  # plain data, so the loader pickles to a worker

    def __call__(self) -> tuple[np.ndarray, int, str | None]:
        try:
            data = self.located.read()
        except OSError as err:  # located at collection, gone or cut short since
            raise AudioReason("missing_media", f"cannot read the audio ({err})") from None
        return decode_audio(data, self.located.where)


def conversation_units(inputs: list[Path], media_roots: Sequence[Path] = ()) -> tuple[list[Unit], list[SkipRecord]]:
    """The audio clips of every conversation of `inputs` (read together: ids are unique across them), in
    input, conversation and slot order, as units of at most CONVERSATION_UNIT_CLIPS clips of one input;
    and what could not be located or listed, as skip records. Audio files resolve only inside each
    input's directory or `media_roots` (`mmtok.formats.conversations.locate`)."""
    units: list[ConversationUnit] = []
    dropped: list[SkipRecord] = []
    unit_input = None
    for conversation in read_conversations(inputs, media_roots):
        for item in _conversation_clips(conversation):
            if isinstance(item, SkipRecord):
                dropped.append(item)
                continue
            if conversation.input != unit_input or len(units[-1].clips) == CONVERSATION_UNIT_CLIPS:
                units.append(ConversationUnit(origin=conversation.origin))
                unit_input = conversation.input
            units[-1].clips.append(item)
    return units, dropped


def _conversation_clips(conversation: Conversation) -> Iterator[tuple[_LocatedLoader, ClipSpec] | SkipRecord]:
    """(loader, whole-payload clip) of each audio slot in media order; a slot that names a cache clip
    (`cut`) yields nothing, one that cannot be located the skip record of its clip id; a conversation whose
    media cannot be listed is one skip record of its conversation id."""
    try:
        media = conversation.media()
    except ConversationError as err:
        yield skip_record(conversation.id, conversation.origin, err.reason, err.detail)
        return
    for ref in media:
        if ref.slot.kind != "audio":
            continue
        clip_id = audio_clip_id(conversation.id, ref.slot.index)
        try:
            located = locate(conversation, media, ref.slot)
        except Skip as skip:
            yield skip_record(clip_id, conversation.origin, skip.reason, skip.detail)
            continue
        if located.kind == "cut":
            continue  # encoded already, by the pretraining conversion
        yield _LocatedLoader(located), ClipSpec(id=clip_id, source_id=conversation.id, clip=ref.slot.index,
                                                origin=located.where)
