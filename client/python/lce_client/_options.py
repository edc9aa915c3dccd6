"""ClientOptions: every setting of lce_client.Client (and aio.Client) in one object, checked once."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

from ._data_plane import MAX_SOCKETS as _MAX_DATA_PLANE_SOCKETS

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MIN_STREAM_BYTES = 8 << 20
# Streams (and connections) a large request is split over: one HTTP/2 connection carries ~1-2 GB/s on
# loopback (bench/RESULTS.md, 2026-11-27 session 6: 4 streams took a 16384-row train request from 178 to
# 138 ms end to end on one H200, and a TP-4 group's from 172 to 123).
DEFAULT_STREAMS = 4
# Streams a request over the data plane is split over (at most `streams`): one stream's chunks merge into the
# server's largest engine calls (bench/RESULTS.md, 2026-11-29 session 21, 4x H200, lce_cli: a 16384x4096 train
# request over the data plane 97.9-99.2 ms over 1 stream against 105.7-105.8 over 4; a TP-4 group's 39.5-40.9
# against 50.1-51.4).
DEFAULT_DATA_PLANE_STREAMS = 1


@dataclass(frozen=True)
class ClientOptions:
    """The settings of a Client, as its keyword arguments (Client's docstring says what each does):
    `Client(target, timeout=30)` and `Client(target, options=ClientOptions(timeout=30))` are the same
    client. `ClientOptions.of(**kwargs)` names an unknown setting in its TypeError."""

    timeout: Optional[float] = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    root_certificates: Optional[bytes] = None
    private_key: Optional[bytes] = None
    certificate_chain: Optional[bytes] = None
    tls: Optional[bool] = None
    token: Optional[str] = None
    head: str = ""
    channel_options: Sequence = ()  # extra gRPC channel options (Client's `options=` given a sequence)
    streams: int = DEFAULT_STREAMS
    min_stream_bytes: int = DEFAULT_MIN_STREAM_BYTES
    data_plane: bool = False
    data_plane_sockets: int = 4
    data_plane_streams: int = DEFAULT_DATA_PLANE_STREAMS
    first_chunk_bytes: int = 0
    last_chunk_bytes: int = 0
    grow_chunks: bool = False
    load_balancing: Optional[str] = None
    max_attempts: Optional[int] = None
    retry_backoff: float = 0.05
    admin_token: Optional[str] = None

    @classmethod
    def of(cls, **kwargs) -> "ClientOptions":
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown Client option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def replace(self, **kwargs) -> "ClientOptions":
        """These options with some changed (an unknown name: TypeError)."""
        ClientOptions.of(**kwargs)
        return dataclasses.replace(self, **kwargs)

    def check(self) -> None:
        """ValueError for a setting out of range."""
        _check_int("max_attempts", self.max_attempts, 1, allow_none=True)
        if not self.retry_backoff >= 0:
            raise ValueError(f"retry_backoff must be >= 0, got {self.retry_backoff!r}")
        if self.data_plane and self.load_balancing:
            raise ValueError("data_plane needs the replicas listed in `target`, not a round_robin name (a "
                             "data-plane session lives on one server)")
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        for name in ("first_chunk_bytes", "last_chunk_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: off), got {v!r}")
        if int(self.streams) < 1:
            raise ValueError("streams must be >= 1")
        _check_int("data_plane_streams", self.data_plane_streams, 1)
        if self.min_stream_bytes < 0:
            raise ValueError("min_stream_bytes must be >= 0")
        v = self.data_plane_sockets
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= _MAX_DATA_PLANE_SOCKETS:
            raise ValueError(f"data_plane_sockets must be an integer in [1, {_MAX_DATA_PLANE_SOCKETS}], got {v!r}")

    def attempts(self, replicas: int) -> int:
        """max_attempts, its default (None) resolved: 3 over replicas (several, or round_robin), 1 for one server."""
        if self.max_attempts is None:
            return 3 if replicas > 1 or self.load_balancing else 1
        return int(self.max_attempts)

    @property
    def secure(self) -> bool:
        """TLS: asked for (`tls`), or implied by any of the certificates."""
        if self.tls is not None:
            return bool(self.tls)
        return any(x is not None for x in (self.root_certificates, self.private_key, self.certificate_chain))


def _check_int(name: str, v, low: int, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
