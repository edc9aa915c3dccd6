"""lce_client.ClientOptions (lce_client/_options.py): the keyword arguments of Client and aio.Client
and an options object build the same client; bad settings are refused as before. No server: a
client connects on its first call."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

import lce_client
from lce_client import ClientOptions

SETTINGS = dict(timeout=7.0, chunk_bytes=1 << 16, head="h", streams=3, min_stream_bytes=1 << 10, first_chunk_bytes=4096,
                last_chunk_bytes=8192, grow_chunks=True, max_attempts=2, retry_backoff=0.5, data_plane_sockets=2)
ATTRIBUTES = ("timeout", "chunk_bytes", "head", "streams", "min_stream_bytes", "first_chunk_bytes", "last_chunk_bytes",
              "grow_chunks", "max_attempts", "retry_backoff", "data_plane_sockets", "targets", "target")


def _settings_of(c) -> dict:
    return {name: getattr(c, name) for name in ATTRIBUTES}


def _check_same(by_keywords, by_object) -> None:
    assert _settings_of(by_keywords) == _settings_of(by_object)
    assert _settings_of(by_keywords)["streams"] == 3 and by_keywords.targets == ["127.0.0.1:1", "127.0.0.1:2"]
    assert by_keywords.client_options == by_object.client_options == ClientOptions(**SETTINGS)


def test_keywords_and_options_object_build_the_same_client():
    by_keywords = lce_client.Client("127.0.0.1:1,127.0.0.1:2", **SETTINGS)
    by_object = lce_client.Client("127.0.0.1:1,127.0.0.1:2", options=ClientOptions(**SETTINGS))
    _check_same(by_keywords, by_object)
    by_keywords.close()
    by_object.close()


def test_keywords_and_options_object_build_the_same_aio_client():
    async def main():  # grpc.aio channels belong to an event loop
        by_keywords = lce_client.aio.Client("127.0.0.1:1,127.0.0.1:2", **SETTINGS)
        by_object = lce_client.aio.Client("127.0.0.1:1,127.0.0.1:2", options=ClientOptions(**SETTINGS))
        _check_same(by_keywords, by_object)
        assert by_keywords._sync.client_options == by_keywords.client_options  # its other calls' client
        await by_keywords.aclose()
        await by_object.aclose()

    asyncio.run(main())


def test_keywords_beside_an_options_object_change_those_settings():
    c = lce_client.Client("127.0.0.1:1", options=ClientOptions(timeout=5.0, streams=2), streams=4)
    assert (c.timeout, c.streams) == (5.0, 4)
    c.close()


def test_options_given_as_a_sequence_are_the_grpc_channel_options():
    c = lce_client.Client("127.0.0.1:1", options=[("grpc.keepalive_time_ms", 1234)])
    assert ("grpc.keepalive_time_ms", 1234) in c._options
    assert c.client_options.channel_options == [("grpc.keepalive_time_ms", 1234)]
    c.close()


def test_max_attempts_default_depends_on_the_replicas():
    assert ClientOptions().attempts(replicas=1) == 1
    assert ClientOptions().attempts(replicas=2) == 3
    assert ClientOptions(load_balancing="round_robin").attempts(replicas=1) == 3
    assert ClientOptions(max_attempts=5).attempts(replicas=1) == 5


def test_unknown_setting_is_named():
    with pytest.raises(TypeError, match="unknown Client option.*bogus"):
        lce_client.Client("127.0.0.1:1", bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        ClientOptions().replace(bogus=1)


@pytest.mark.parametrize("bad, message", [
    (dict(streams=0), "streams must be >= 1"),
    (dict(chunk_bytes=0), "chunk_bytes must be positive"),
    (dict(first_chunk_bytes=-1), "first_chunk_bytes must be an integer >= 0"),
    (dict(data_plane_sockets=17), r"data_plane_sockets must be an integer in \[1, 16\]"),
    (dict(data_plane_streams=0), "data_plane_streams must be an integer >= 1"),
    (dict(max_attempts=0), "max_attempts must be an integer >= 1"),
    (dict(retry_backoff=-1.0), "retry_backoff must be >= 0"),
    (dict(data_plane=True, load_balancing="round_robin"), "data_plane needs the replicas listed"),
])
def test_bad_settings_are_refused_either_way(bad, message):
    with pytest.raises(ValueError, match=message):
        lce_client.Client("127.0.0.1:1", **bad)
    with pytest.raises(ValueError, match=message):
        lce_client.Client("127.0.0.1:1", options=ClientOptions(**bad))


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientOptions().timeout = 1.0
