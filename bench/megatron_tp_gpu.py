#!/usr/bin/env python3
"""lce_client.megatron's output layer against Megatron-Core's own at tensor parallel K (NCCL on GPUs, or
gloo on CPUs), sequence parallelism on or off: per-token loss, d_hidden and the head's dW (max abs
differences), and the median time of a forward + backward of each (the loss sum's backward; the head
trained on the server, so the dW is the server's, compared once after one step where --check-dw).

Megatron's side: ``ColumnParallelLinear`` (its SP all-gather inside on GPUs) + ``vocab_parallel_cross_entropy``
on the rank's vocab shard; on CPUs Megatron's SP gather needs CUDA, so its side runs without SP on the
whole sequence and its d_hidden is cut to the rank's shard. Ours: the same shard, the head on the server
(serve_megatron_weight), train_head="server" (or "local": the shard's gradient from the server,
compared with Megatron's; with --ddp both layers in Megatron's DistributedDataParallel and their
main_grad compared).

GPUs, one process per GPU, a server already running (e.g. lce_server --backend=cuda, or a TP group):
  torchrun --nproc-per-node 2 bench/megatron_tp_gpu.py --target HOST:PORT --shape 8192x4096x151936 [--sp]
CPU check (starts a CPU lce_server when given no --target):
  python bench/megatron_tp_gpu.py --tp 2 --device cpu --shape 64x64x512 --sp
Writes megatron_tp_{K}{_sp}.json to $OUT (default .) and prints the numbers on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

HEAD = "megatron_bench"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="host:port of the lce_server (default: start a CPU one; --device cpu only)")
    ap.add_argument("--tp", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shape", default="4096x4096x151936", help="TOKENSxHIDDENxVOCAB (tokens = s*b, b = 1)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--check-dw", action="store_true", help="read the server's dW back (V*H*4 bytes) and compare")
    ap.add_argument("--train-head", choices=["server", "local"], default="server",
                    help="local: the shard's gradient comes back into the weight (GetGrad, V*H*4 bytes a rank)")
    ap.add_argument("--ddp", action="store_true",
                    help="wrap both layers in Megatron's DistributedDataParallel (CUDA) and compare main_grad")
    return ap.parse_args()


def layers(args, k, h, v):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=k)
    out = []
    for sp in (args.sp and k > 1 and args.device == "cuda", args.sp and k > 1):
        cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=k, params_dtype=DTYPES[args.dtype],
                                use_cpu_initialization=True, tensor_model_parallel_size=k, sequence_parallel=sp)
        torch.manual_seed(0)  # the same whole weight for both layers; each rank keeps its shard
        layer = tensor_parallel.ColumnParallelLinear(h, v, config=cfg, bias=False,
                                                     init_method=lambda w: torch.nn.init.normal_(w, std=0.02))
        out.append(layer.to(args.device))
    return out


def wrap_ddp(layer):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    wrapped = DistributedDataParallel(layer.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
    wrapped.zero_grad_buffer()
    return wrapped


def timed(fn, iters, device):
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(rank, k, init, target, args):
    warnings.simplefilter("ignore")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=init, rank=rank, world_size=k)
    try:
        result = bench(rank, k, target, args)
        if rank == 0:
            print(json.dumps(result, indent=1))
            path = os.path.join(os.environ.get("OUT", "."), f"megatron_tp_{k}{'_sp' if args.sp else ''}.json")
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        dist.destroy_process_group()


def bench(rank, k, target, args):
    import lce_client
    from megatron.core import tensor_parallel

    from lce_client.megatron import remote_output_layer, serve_megatron_weight

    n, h, v = (int(x) for x in args.shape.split("x"))
    ref, ours = layers(args, k, h, v)
    client = lce_client.Client(target, timeout=600)
    remote_output_layer(ours, client, head=HEAD, train_head=args.train_head)
    serve_megatron_weight(ours, client, HEAD, load=True)
    ddp = [wrap_ddp(layer) for layer in (ref, ours)] if args.ddp else []
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn((n, 1, h), generator=g).to(args.device, DTYPES[args.dtype])
    labels = torch.randint(0, v, (1, n), generator=g).to(args.device)
    sp_ref, sp_ours = ref.sequence_parallel, ours.sequence_parallel
    shard = slice(rank * n // k, (rank + 1) * n // k)
    x_ref = (hidden[shard] if sp_ref else hidden).clone().requires_grad_()
    x = (hidden[shard] if sp_ours else hidden).clone().requires_grad_()

    def megatron_step():
        logits, _ = ref(x_ref)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.T.contiguous()).T
        loss.sum().backward()
        return loss

    def our_step():
        loss = ours(x, output_cross_entropy_loss=True, labels=labels)
        loss.sum().backward()
        return loss

    want, got = megatron_step(), our_step()  # also the warm-up
    d_ref = x_ref.grad[shard] if sp_ours and not sp_ref else x_ref.grad
    result = dict(tp=k, sp=bool(args.sp and k > 1), shape=args.shape, dtype=args.dtype, device=args.device,
                  max_diff_loss=(got.float() - want.float()).abs().max().item(),
                  max_diff_d_hidden=(x.grad.float() - d_ref.float()).abs().max().item())
    if ddp:  # Megatron's DDP adds each weight's gradient into its main_grad
        for d in ddp:
            d.finish_grad_sync()
        result["max_diff_main_grad"] = (ours.weight.main_grad - ref.weight.main_grad).abs().max().item()
    elif args.train_head == "local":
        result["max_diff_weight_grad"] = (ours.weight.grad.float() - ref.weight.grad.float()).abs().max().item()
    if args.check_dw and args.train_head == "server":
        parts = [torch.empty_like(ref.weight.grad) for _ in range(k)]
        dist.all_gather(parts, ref.weight.grad.contiguous())
        if rank == 0:
            dw = torch.from_numpy(client.get_grad(head=HEAD))
            result["max_diff_dw"] = (dw - torch.cat(parts).float().cpu()).abs().max().item()
    for t in [x_ref, x] + ([] if ddp else [ref.weight, ours.weight]):
        t.grad = None
    result["megatron_ms"] = timed(megatron_step, args.iters, args.device)
    result["lce_ms"] = timed(our_step, args.iters, args.device)
    result["hidden_bytes_sent_per_step_by_group"] = n * h * hidden.element_size()
    if rank == 0:
        client.zero_grad(head=HEAD)
    return result


def main():
    from lce_client.local import run_on_ranks

    args = parse()
    if not args.target and args.device != "cpu" and "RANK" not in os.environ:
        raise SystemExit("--device cuda needs --target (a running server)")
    run_on_ranks(run, args.tp, args.target, (args,))


if __name__ == "__main__":
    main()
