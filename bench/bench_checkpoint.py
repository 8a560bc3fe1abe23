"""Checkpoint benchmarks (numbers printed as ratios against baselines measured in the same run, nothing asserted).

1. Loop stall: how long the training loop is blocked by an asynchronous checkpoint (staging copy only)
   against a synchronous save of the same state (DCP write + upload + commit before training resumes).
   Goal: async stall <= 1/20 of the synchronous one.
2. Upload throughput: the checkpoint upload path (per-rank files, multipart, checksums, report) against a
   raw boto3 multipart upload of the same bytes to the same S3 server. Goal: >= 0.8.

Runs one FSDP rank (gloo) on CPU against a real S3-compatible server (moto) started here.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bench_checkpoint.py [--layers 6] [--width 384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from loom.devstack.servers import free_port, s3_server
from loom.workloads.common.s3 import DEFAULT_TRANSFER, S3Location, make_client
from loom.workloads.trainer.checkpoint.manager import CheckpointManager
from loom.workloads.trainer.config import TrainerConfig
from loom.workloads.trainer.engines import FSDPEngine
from loom.workloads.trainer.examples.chargpt import CharGPTTask
from loom.workloads.trainer.task import TaskContext


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONSAFEPATH="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="loom-bench-ckpt-") as tmp, s3_server(Path(tmp) / "s3") as s3:
        os.environ.update(s3.env())
        client = make_client(s3.url)
        client.create_bucket(Bucket="bench")
        config = TrainerConfig.model_validate({
            "engine": "fsdp",
            "training": {"maxSteps": 1000, "batchSize": 4, "device": "cpu",
                         "taskArgs": {"nLayer": args.layers, "nEmbd": args.width, "nHead": 6, "blockSize": 64}},
            "checkpoint": {"uri": "s3://bench/ckpt", "keepLast": 2, "stagingDir": str(Path(tmp) / "staging")},
        })
        task = CharGPTTask()
        ctx = TaskContext(0, 1, 0, "cpu", 0, 4, config.training.task_args)
        engine = FSDPEngine(config, task, task.build_model(ctx), torch.device("cpu"))
        data = task.build_data(ctx)
        for step in range(1, 3):  # optimizer state exists from here on
            engine.step(data.batch(step, 0, 1, 4))
        assert config.checkpoint is not None
        manager = CheckpointManager(config.checkpoint, 0, 1, "fsdp", "bench", client=client)
        trainer_state = {"step": 0, "scheduler": engine.scheduler.state_dict()}
        step = 10

        sync_stalls, async_stalls = [], []
        for _ in range(args.repeats):
            step += 1
            sync_stalls.append(manager.save(step, engine.checkpoint_state(), trainer_state, block=True))
            step += 1
            async_stalls.append(manager.save(step, engine.checkpoint_state(), trainer_state, block=False))
            manager.wait()
        checkpoint_bytes = manager.store.read_manifest(step).total_bytes()
        sync_s, async_s = statistics.median(sync_stalls), statistics.median(async_stalls)
        print(f"checkpoint size: {checkpoint_bytes / 2**20:.1f} MiB "
              f"({sum(p.numel() for p in engine.model.parameters()) / 1e6:.1f} M parameters + AdamW state)")
        print(f"loop stall, synchronous save (write+upload+commit): {sync_s * 1000:.1f} ms (median of {args.repeats})")
        print(f"loop stall, asynchronous save (staging copy only):  {async_s * 1000:.1f} ms")
        print(f"RATIO async/sync stall = {async_s / sync_s:.3f}  (goal <= 0.05)")

        # Upload throughput on identical bytes: the checkpoint path vs raw boto3 multipart.
        local = Path(tmp) / "upload"
        dcp.save(engine.checkpoint_state(), storage_writer=FileSystemWriter(str(local)))
        files = sorted(p for p in local.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        ours, raw = [], []
        for attempt in range(args.repeats):
            started = time.perf_counter()
            manager.store.upload_rank_files(900 + attempt, [(p, p.name) for p in files], 0, f"bench{attempt}")
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            for path in files:
                target = S3Location("bench", f"raw/{attempt}/{path.name}")
                client.upload_file(str(path), target.bucket, target.key, Config=DEFAULT_TRANSFER)
            raw.append(time.perf_counter() - started)
        ours_rate, raw_rate = total / statistics.median(ours), total / statistics.median(raw)
        print(f"upload: checkpoint path {ours_rate / 2**20:.1f} MiB/s, "
              f"raw boto3 multipart {raw_rate / 2**20:.1f} MiB/s ({total / 2**20:.1f} MiB)")
        print(f"RATIO checkpoint/raw upload throughput = {ours_rate / raw_rate:.2f}  (goal >= 0.8)")
        manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
