"""lce_client: Python client of lce-serve, the fused linear-cross-entropy loss head service.

    from lce_client import Client
    c = Client("127.0.0.1:50051")
    logprobs, entropy = c.score(hidden, targets)          # numpy or torch in, same kind out
    r = c.forward_backward(hidden, targets)                # r.loss, r.per_token_loss, r.d_hidden
    d_hidden = c.backward(hidden, targets, grad_logprob, grad_entropy)
    c = Client("gpu-host:50051", data_plane=True)        # bulk bytes over the server's data plane (--data-port)

asyncio (many requests in flight from one event loop): lce_client.aio.Client, the same computations
as coroutines over grpc.aio.

PyTorch autograd (needs torch): lce_client.torch.RemoteLinearCrossEntropy and remote_logprobs, also
reachable as lce_client.RemoteLinearCrossEntropy / lce_client.remote_logprobs.
lce_client.hf: a Hugging Face causal LM's head served remotely (apply_remote_head). lce_client.rl: verl's linear_cross_entropy contract, TRL-style
per_token_logps, the fused policy loss. docs/INTEGRATIONS.md describes them.
"""
from ._arrays import bf16_bits_to_f32, f32_to_bf16_bits
from ._client import (DEFAULT_CHUNK_BYTES, DEFAULT_MIN_STREAM_BYTES, BackwardResult, Client, ForwardBackwardResult, HeadInfo, LceError, PolicyLossResult,
                      ScoreResult, ServerInfo, plan_chunks, token_accuracy)
from ._shm import Region, SharedMemorySession
from . import aio

from ._version import VERSION as __version__
__all__ = ["Client", "LceError", "HeadInfo", "ServerInfo", "ForwardBackwardResult", "BackwardResult", "PolicyLossResult",
           "ScoreResult", "token_accuracy",
           "DEFAULT_CHUNK_BYTES", "DEFAULT_MIN_STREAM_BYTES", "plan_chunks", "Region", "SharedMemorySession", "bf16_bits_to_f32", "f32_to_bf16_bits", "RemoteLinearCrossEntropy",
           "remote_logprobs", "remote_linear_cross_entropy"]

_TORCH_NAMES = {"RemoteLinearCrossEntropy", "remote_logprobs", "remote_linear_cross_entropy",
                "set_default_client", "get_default_client"}


def __getattr__(name):  # torch is optional: import it only when its wrappers are asked for
    if name in _TORCH_NAMES:
        from . import torch as _t

        return getattr(_t, name)
    raise AttributeError(f"module 'lce_client' has no attribute {name!r}")
