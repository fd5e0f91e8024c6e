"""engines.text.chat_messages over content parts: text joined for a text-only engine, which refuses
media naming the message and part; canonical parts, in order, for an engine that takes media."""

from __future__ import annotations

import pytest
from support import media_files as mf

from omni_mesh.engines.text import chat_messages
from omni_mesh.errors import InvalidInput
from omni_mesh.media import MediaError


def test_a_text_only_engine_refuses_a_media_part_naming_message_and_part() -> None:
    inputs = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, mf.image_url(mf.image("png"))]},
    ]}
    with pytest.raises(InvalidInput, match=r"inputs\.messages\[1\]\.content\[1\]: a image_url part.*text only"):
        chat_messages(inputs)


def test_text_parts_still_make_the_text_of_a_text_only_engine() -> None:
    inputs = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]}
    assert chat_messages(inputs) == [{"role": "user", "content": "Hello"}]


def test_unknown_part_types_are_refused_not_dropped() -> None:
    inputs = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}]}
    for media in (False, True):
        with pytest.raises(InvalidInput, match=r"messages\[0\]\.content\[0\]: a part of type 'file'"):
            chat_messages(inputs, media=media)


def test_an_engine_that_takes_media_gets_canonical_parts_in_order() -> None:
    wav, png, mp4 = mf.wav(0.2), mf.image("png"), mf.video(2)
    inputs = {"messages": [{"role": "user", "content": [
        mf.input_audio(wav), {"type": "text", "text": "and"}, mf.image_url(png), mf.video_url(mp4),
    ]}]}
    assert chat_messages(inputs, media=True) == [{"role": "user", "content": [
        {"type": "audio", "data": wav, "format": "wav"},
        {"type": "text", "text": "and"},
        {"type": "image", "data": png, "format": "png"},
        {"type": "video", "data": mp4, "format": "mp4"},
    ]}]
    alone = {"messages": [{"role": "user", "content": [mf.input_audio(wav)]}]}  # media alone is a valid message
    assert chat_messages(alone, media=True)[0]["content"][0]["type"] == "audio"


def test_a_bad_part_names_where_it_is() -> None:
    inputs = {"messages": [{"role": "user", "content": ["x", {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}]}]}
    with pytest.raises(InvalidInput, match=r"content\[0\]: a part of type None"):
        chat_messages(inputs, media=True)
    inputs["messages"][0]["content"] = [mf.input_audio(b"not a wav file at all")]
    with pytest.raises(MediaError, match=r"inputs\.messages\[0\]\.content\[0\]: input_audio\.data: not a wav"):
        chat_messages(inputs, media=True)
