"""Training-step throughput of the chargpt example model (workloads/trainer/examples/chargpt.py) on this machine's
CPU and, where there is one, its GPU, in the same run: tokens per second of forward, backward and an AdamW step, at
the example's defaults and at a larger shape its taskArgs allow. The CPU is the baseline; the GPU's figure is given
as a ratio to it. Needs only torch (the model's module imports nothing else of Loom's at import time).

    python bench/bench_chargpt_device.py [--steps 30]

Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from loom.workloads.trainer.examples.chargpt import GPT, GPTConfig

SHAPES = {
    "example defaults (2 layers, 128 wide, 64 tokens)": GPTConfig(),
    "nLayer=6 nEmbd=384 nHead=6 blockSize=256": GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=256),
}
BATCH = 32


def tokens_per_second(config: GPTConfig, device: str, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, config.vocab_size, (BATCH, config.block_size), device=device)
    y = torch.randint(0, config.vocab_size, (BATCH, config.block_size), device=device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    )

    def step() -> None:
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up: allocator, kernels chosen
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return steps * BATCH * config.block_size / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, GPU: {gpu or 'none'}")
    for name, config in SHAPES.items():
        cpu = tokens_per_second(config, "cpu", max(3, args.steps // 10))
        line = f"{name}: CPU {cpu:,.0f} tokens/s"
        if gpu:
            cuda = tokens_per_second(config, "cuda", args.steps)
            line += f"; GPU (bf16 autocast) {cuda:,.0f} tokens/s = {cuda / cpu:.1f}x the CPU"
        print(line, flush=True)


if __name__ == "__main__":
    main()
