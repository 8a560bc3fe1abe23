"""GPU benchmark of the trainer's FSDP2 path (numbers printed, nothing asserted; CI has no GPU).

The bundled character-level GPT scaled to GPT-2-small shape (12 layers, 12 heads, 768 wide, 1024 context),
bf16 mixed precision through the same `FSDPEngine` the launcher uses, on one GPU:
- tokens/s and model FLOPs utilisation (MFU = achieved training FLOPs / the GPU's dense bf16 peak);
- checkpoint stall: the loop's blocking time for an asynchronous checkpoint (pinned, reused staging
  buffers) against a synchronous DCP save of the same state to local disk (no S3 on the GPU machine).

Needs only torch: `PYTHONPATH=<dir with loom -> repo links> python3 bench/bench_trainer_gpu.py`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from loom.workloads.trainer.checkpoint.staging import ReusableCPUStager
from loom.workloads.trainer.engines import FSDPEngine
from loom.workloads.trainer.examples.chargpt import GPT, CharGPTTask, GPTConfig

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(args: argparse.Namespace) -> SimpleNamespace:
    # Duck-typed TrainerConfig: the GPU machine may lack pydantic; FSDPEngine reads only these fields.
    return SimpleNamespace(
        fsdp=SimpleNamespace(sharding="full", mixed_precision="bf16", activation_checkpointing=args.ac),
        training=SimpleNamespace(learning_rate=3e-4, weight_decay=0.1, warmup_steps=10, max_steps=10_000,
                                 grad_clip=1.0),
    )


def run_variant(args: argparse.Namespace, compile_blocks: bool) -> None:
    task = CharGPTTask()
    torch.manual_seed(0)
    gpt = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block)
    model = GPT(gpt)
    flops_per_token = task.flops_per_token(model)
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    device = torch.device("cuda", 0)
    engine = FSDPEngine(_config(args), task, model, device)  # type: ignore[arg-type]
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (x, torch.roll(x, -1, dims=1))
        for x in (torch.randint(0, gpt.vocab_size, (args.batch, args.block), device=device, generator=generator)
                  for _ in range(4))
    ]
    for step in range(args.warmup):
        engine.step(batches[step % 4])
    torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(args.steps):
        loss = engine.step(batches[step % 4]).loss
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tokens_per_s = args.steps * args.batch * args.block / elapsed
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    mfu = tokens_per_s * flops_per_token / (peak * 1e12) if peak else float("nan")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    label = "compiled blocks" if compile_blocks else "eager"
    # Where the time goes: forward+backward alone vs the whole step (optimizer, clipping, FSDP hooks).
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for step in range(5):
        engine.task.loss(engine.model, batches[step % 4]).backward()
    torch.cuda.synchronize()
    fwd_bwd_ms = (time.perf_counter() - begin) / 5 * 1000
    engine.optimizer.zero_grad(set_to_none=True)
    print(f"[{label}] forward+backward only: {fwd_bwd_ms:.1f} ms/step")
    print(f"[{label}] {name}: {params:.1f}M params, batch {args.batch}x{args.block}, "
          f"step {elapsed / args.steps * 1000:.1f} ms, {tokens_per_s:,.0f} tokens/s, "
          f"MFU {mfu * 100:.1f}% (peak {peak} TFLOPS bf16), loss {float(loss):.3f}")

    if not args.checkpoint:
        return
    group = dist.new_group(backend="gloo")
    stager = ReusableCPUStager()
    with tempfile.TemporaryDirectory(prefix="loom-gpu-ckpt-") as tmp:
        sync_stalls, async_stalls = [], []
        for attempt in range(3):
            state = engine.checkpoint_state()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            dcp.save(state, storage_writer=FileSystemWriter(f"{tmp}/sync{attempt}"), process_group=group)
            sync_stalls.append(time.perf_counter() - begin)
            engine.step(batches[0])
            state = engine.checkpoint_state()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            future = dcp.async_save(state, storage_writer=FileSystemWriter(f"{tmp}/async{attempt}"),
                                    process_group=group, async_stager=stager)
            async_stalls.append(time.perf_counter() - begin)
            # Training continues while the write runs; measure how many steps fit before it is done.
            overlapped = 0
            while not future.done():
                engine.step(batches[overlapped % 4])
                overlapped += 1
            torch.cuda.synchronize()
            future.result()
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{tmp}/sync0") for f in fs)
    sync_s, async_s = statistics.median(sync_stalls), statistics.median(async_stalls[1:])
    print(f"[{label}] checkpoint {size / 2**30:.2f} GiB: synchronous save stalls {sync_s * 1000:.0f} ms, "
          f"async stalls {async_s * 1000:.0f} ms (first, allocating pinned buffers: {async_stalls[0] * 1000:.0f} ms); "
          f"RATIO async/sync = {async_s / sync_s:.3f} (goal <= 0.05); "
          f"{overlapped} training steps ran during the last background write")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument("--variants", default="eager,compile")
    parser.add_argument("--checkpoint", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_trainer_gpu: no CUDA device here; skipped (run it on a GPU machine)")
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    for variant in args.variants.split(","):
        run_variant(args, compile_blocks=variant == "compile")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
