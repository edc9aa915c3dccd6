"""The client's error type, shared by every module (so that none imports another for it)."""
from __future__ import annotations

import grpc


class LceError(Exception):
    """An lce-serve request failed. `code` is the grpc.StatusCode, `details` the server's message
    (it names the problem, and the chunk or row where it applies). The original grpc.RpcError is
    the exception's __cause__ where there is one."""

    def __init__(self, code: grpc.StatusCode, details: str, rpc: str = ""):
        self.code = code
        self.details = details or ""
        self.rpc = rpc
        super().__init__(self._message())

    def _message(self) -> str:
        return f"{self.rpc + ': ' if self.rpc else ''}{self.code.name}: {self.details}"

    def annotate(self, note: str) -> None:
        """Adds `note`, in parentheses, to the details (and the message)."""
        self.details += f" ({note})"
        self.args = (self._message(),)


def _wrap(e: grpc.RpcError, rpc: str) -> LceError:
    code = e.code() if hasattr(e, "code") and callable(e.code) else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") and callable(e.details) else str(e)
    return LceError(code, details, rpc)
