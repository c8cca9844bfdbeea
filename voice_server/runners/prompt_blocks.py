"""Multimodal blocks in a prompt's token ids: finding them and expanding their placeholders.

A block is `start, placeholder..., end`: Qwen3-Omni writes audio as `audio_start, audio, audio_end`,
an image as `vision_start, image, vision_end` and a video as `vision_start, video, vision_end` (image
and video share their delimiters; the placeholder says which). The chat template writes one placeholder
per block; the encoder stage expands it to the item's token count (a prompt may also bring that exact
count already). Every refusal is an `AdmissionError` naming `payload.token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from voice_server.scheduling import AdmissionError


@dataclass(frozen=True)
class BlockKind:
    name: str
    """"audio", "image", "video": in messages (`image block 0 has ...`)."""
    item: str
    """What fills one block, in messages: "clip", "image", "video"."""
    delimiter: str
    """The delimiters' name, in messages: "audio" (audio_start/audio_end), "vision"."""
    start_id: int
    placeholder_id: int
    end_id: int


@dataclass(frozen=True)
class Block:
    kind: BlockKind
    start: int
    """Index of the block's first placeholder."""
    num_placeholders: int


def find_blocks(token_ids: Sequence[int], kinds: Sequence[BlockKind]) -> list[Block]:
    """The blocks of `kinds` (which share their start and end ids, or are one kind), in order."""
    start_id, end_id = kinds[0].start_id, kinds[0].end_id
    if any((k.start_id, k.end_id) != (start_id, end_id) for k in kinds):
        raise ValueError("find_blocks: kinds found together must share their start and end ids")
    by_placeholder = {k.placeholder_id: k for k in kinds}
    names, delimiter = " or ".join(k.name for k in kinds), kinds[0].delimiter
    article = "an" if delimiter[0] in "aeiou" else "a"
    blocks: list[Block] = []
    i = 0
    while i < len(token_ids):
        if token_ids[i] in by_placeholder or token_ids[i] == end_id:
            raise AdmissionError(f"payload.token_ids[{i}]: {names} placeholder or {delimiter}_end outside "
                                 f"{article} {delimiter} block")
        if token_ids[i] != start_id:
            i += 1
            continue
        kind = by_placeholder.get(token_ids[i + 1]) if i + 1 < len(token_ids) else None
        end = i + 1
        while kind is not None and end < len(token_ids) and token_ids[end] == kind.placeholder_id:
            end += 1
        if kind is None or end == len(token_ids) or token_ids[end] != end_id:
            raise AdmissionError(f"payload.token_ids[{i}]: {delimiter} block {len(blocks)} must be "
                                 f"{delimiter}_start, {names} placeholder(s), {delimiter}_end")
        blocks.append(Block(kind, i + 1, end - i - 1))
        i = end + 1
    return blocks


def expand_blocks(token_ids: list[int], blocks: Sequence[Block], counts: Sequence[int]) -> list[int]:
    """`token_ids` with each block's placeholders made `counts[i]` long (blocks as `find_blocks` gave them)."""
    expanded: list[int] = []
    done = 0
    numbers: dict[str, int] = {}
    for block, count in zip(blocks, counts, strict=True):
        number = numbers[block.kind.name] = numbers.get(block.kind.name, -1) + 1
        if block.num_placeholders not in (1, count):
            raise AdmissionError(f"payload.token_ids: {block.kind.name} block {number} has {block.num_placeholders} "
                                 f"placeholders; give 1 or its {block.kind.item}'s exact count {count}")
        expanded += token_ids[done:block.start] + [block.kind.placeholder_id] * count
        done = block.start + block.num_placeholders
    return expanded + token_ids[done:]


def checked_token_ids(value: object, vocab_size: int, reason: str) -> list[int]:
    """`payload.token_ids` when a payload brings items for its blocks (`reason`: "with audio")."""
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < vocab_size for t in value):
        raise AdmissionError(f"payload.token_ids: {reason}, must be a list of token ids in [0, {vocab_size})")
    return value
