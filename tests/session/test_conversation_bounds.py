"""A conversation's memory is bounded: beyond `max_items` items, or beyond `max_media_bytes` of user audio and
images, its oldest items go (the newest always stays); images travel to the pipeline with their user message."""

from __future__ import annotations

import numpy as np
import pytest

from voice_server.session.conversation import Conversation, Item


def test_oldest_items_go_beyond_the_item_count_and_the_media_bytes() -> None:
    conversation = Conversation(max_items=4, max_media_bytes=3000)
    for i in range(6):
        conversation.add(Item(f"t{i}", "user", f"turn {i}"))
    assert [item.item_id for item in conversation.items] == ["t2", "t3", "t4", "t5"]
    conversation.add(Item("img", "user", "look", images=(b"x" * 1000,)))
    conversation.add(Item("wav", "user", audio=np.zeros(400, np.float32)))  # 1600 bytes: 2600 in all
    assert [item.item_id for item in conversation.items] == ["t4", "t5", "img", "wav"]
    conversation.add(Item("img2", "user", images=(b"y" * 1000,)))  # 3600 bytes: the first image goes
    assert [item.item_id for item in conversation.items] == ["wav", "img2"]
    huge = Item("huge", "user", images=(b"z" * 5000,))
    conversation.add(huge)
    assert conversation.items == [huge], "the newest item stays even alone over the bound"


def test_images_go_with_their_user_message_only() -> None:
    conversation = Conversation()
    conversation.add(Item("u1", "user", "", images=(b"png",)))
    assert conversation.to_messages("") == [{"role": "user", "content": "", "images": [b"png"]}]
    with pytest.raises(ValueError, match="images belong to user messages"):
        Item("a1", "assistant", "hi", images=(b"png",))
