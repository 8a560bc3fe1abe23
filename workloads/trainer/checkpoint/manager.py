"""Asynchronous sharded checkpoints: stage, write, upload and commit, with the loop blocked only for staging.

Save (every rank, same step):
  1. main thread: build the engine's DCP state dict and hand it to `dcp.async_save`, which copies it to
     CPU memory (the only part the training loop waits for) and writes this rank's shard files to a
     local staging directory from a background thread, over a dedicated gloo process group so its
     collectives never interleave with the training loop's;
  2. background: upload this rank's files (multipart, retried) and a per-rank report; every failed S3
     attempt is reported as it happens (`on_failure`), so an outage is visible while botocore retries;
  3. rank 0, background: wait for every rank's report, write the manifest (the commit point), apply
     retention, publish the new checkpoint.
Only one checkpoint is in flight; the next save first waits for the previous one.
"""

from __future__ import annotations

import logging
import pickle
import random
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ...common.s3 import S3Location, make_client
from ..config import CheckpointSpec
from .manifest import Manifest, step_of
from .retries import watch_failures
from .staging import ReusableCPUStager
from .store import CheckpointStore, S3CheckpointReader

log = logging.getLogger("loom.trainer.checkpoint")

TRAINER_STATE = "trainer_state.pt"


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.pt"


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class SaveRecord:
    step: int
    stall_s: float
    future: Future[Manifest | None]
    started: float = field(default_factory=time.monotonic)


@dataclass
class Restored:
    step: int
    uri: str
    trainer_state: dict[str, Any]
    committed_at: float  # when the checkpoint's manifest was written (epoch seconds)


class CheckpointManager:
    def __init__(
        self,
        spec: CheckpointSpec,
        rank: int,
        world_size: int,
        engine_name: str,
        session: str,
        on_commit: Callable[[Manifest, str], None] | None = None,
        client: Any = None,
        on_failure: Callable[[int | None, str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.engine_name = engine_name
        self.session = session
        self.on_commit = on_commit
        self.on_failure = on_failure
        self.store = CheckpointStore(client or make_client(spec.endpoint), S3Location.parse(spec.uri))
        self.uploading: int | None = None  # the step the checkpoint thread is uploading/committing
        if on_failure is not None:
            # Every failed S3 attempt, as it happens (botocore retries it before anyone sees an error).
            watch_failures(self.store.client, lambda error: on_failure(self.uploading, error))
        self.local_root = Path(spec.staging_dir) / session / f"rank-{rank:05d}"
        # A separate gloo group: DCP's planning/metadata collectives run in the background thread.
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # Every rank joins, so new_group never answers "not a member" (its non-group sentinel) here.
        self.group = group if isinstance(group, dist.ProcessGroup) else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-ckpt")
        self.in_flight: SaveRecord | None = None
        self.stager = ReusableCPUStager()
        self.last_saved_step: int | None = None
        self.last_save_time = time.monotonic()
        self.failures = 0

    # ---- when to save -------------------------------------------------------------------------
    def due_by_steps(self, step: int) -> bool:
        return bool(self.spec.every_steps and step % self.spec.every_steps == 0)

    def due_by_time(self, now: float | None = None) -> bool:
        """This rank's clock says a checkpoint is due. Clocks differ between ranks, so the loop combines
        every rank's answer in its per-step all-reduce: all ranks must enter a save together."""
        now = time.monotonic() if now is None else now
        return bool(self.spec.every_minutes and now - self.last_save_time >= self.spec.every_minutes * 60)

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], trainer_state: dict[str, Any], block: bool = False) -> float:
        """Start a checkpoint of `state` at `step`; returns how long the caller was blocked (seconds)."""
        started = time.perf_counter()
        self.wait()
        local_dir = self.local_root / f"step-{step:09d}"
        shutil.rmtree(local_dir, ignore_errors=True)
        local_dir.mkdir(parents=True)
        torch.save(capture_rng(), local_dir / rng_file(self.rank))
        if self.rank == 0:
            torch.save(trainer_state, local_dir / TRAINER_STATE, pickle_protocol=pickle.HIGHEST_PROTOCOL)
        writer = FileSystemWriter(str(local_dir), single_file_per_rank=True, sync_files=False)
        if self.spec.async_ and not block:
            response = dcp_async_save(state, storage_writer=writer, process_group=self.group,
                                      async_stager=self.stager)
            # torch answers with staging + upload futures only for stagers that stage in the background;
            # ours stages before async_save returns, so the upload future is all there is to wait for.
            written: Future[Any] = response if isinstance(response, Future) else response.upload_completion
        else:
            dcp_save(state, storage_writer=writer, process_group=self.group)
            written = Future()
            written.set_result(None)
        stall = time.perf_counter() - started
        future = self.executor.submit(self._finish, step, local_dir, written)
        self.in_flight = SaveRecord(step=step, stall_s=stall, future=future)
        self.last_save_time = time.monotonic()
        self.last_saved_step = step
        if block or not self.spec.async_:
            self.wait()
            stall = time.perf_counter() - started
        return stall

    def _finish(self, step: int, local_dir: Path, written: Future[Any]) -> Manifest | None:
        self.uploading = step
        try:
            return self._upload_and_commit(step, local_dir, written)
        finally:
            self.uploading = None

    def _upload_and_commit(self, step: int, local_dir: Path, written: Future[Any]) -> Manifest | None:
        written.result()
        files = sorted(p for p in local_dir.iterdir() if p.is_file())
        self.store.upload_rank_files(step, [(p, p.name) for p in files], self.rank, self.session)
        shutil.rmtree(local_dir, ignore_errors=True)
        if self.rank != 0:
            return None
        reports = self.store.wait_for_reports(step, self.session, self.world_size, timeout_s=600)
        manifest = self.store.commit(step, reports, self.world_size, self.engine_name)
        uri = self.store.location(step).uri
        deleted = self.store.apply_retention(self.spec.keep_last)
        log.info("checkpoint step %d committed at %s (%d bytes); retention removed %s",
                 step, uri, manifest.total_bytes(), deleted)
        if self.on_commit:
            self.on_commit(manifest, uri)
        return manifest

    def wait(self) -> Manifest | None:
        """Block until the in-flight checkpoint is committed (rank 0) or uploaded (other ranks)."""
        record, self.in_flight = self.in_flight, None
        if record is None:
            return None
        try:
            return record.future.result()
        except Exception as error:
            # A failed upload loses one checkpoint, not the run: the next one is attempted as scheduled.
            self.failures += 1
            log.exception("checkpoint step %d failed", record.step)
            if self.on_failure is not None:
                self.on_failure(record.step, type(error).__name__)
            return None

    def close(self) -> None:
        self.wait()
        self.executor.shutdown(wait=True)
        shutil.rmtree(self.local_root, ignore_errors=True)

    # ---- resume --------------------------------------------------------------------------------
    def resolve_resume(self) -> tuple[CheckpointStore, int] | None:
        """The checkpoint to resume from: newest complete under uri, an explicit one, or none."""
        resume = self.spec.resume
        if resume == "none":
            return None
        if resume == "latest":
            step = self.store.newest_complete()
            return (self.store, step) if step is not None else None
        location = S3Location.parse(resume)
        parent, _, name = location.key.rpartition("/")
        store = CheckpointStore(self.store.client, S3Location(location.bucket, parent))
        step = step_of(name)
        if step is None or step not in store.complete_steps():
            raise FileNotFoundError(f"resume checkpoint {resume} does not exist or is incomplete (no manifest)")
        return store, step

    def load(
        self, store: CheckpointStore, step: int, load_engine_state: Callable[[Callable[[dict[str, Any]], None]], None]
    ) -> Restored:
        manifest = store.read_manifest(step)
        local_dir = Path(self.spec.staging_dir) / self.session / "restore" / f"rank-{self.rank:05d}"
        shutil.rmtree(local_dir, ignore_errors=True)
        reader = S3CheckpointReader(store, step, manifest, local_dir)

        def load_into(state: dict[str, Any]) -> None:
            dcp_load(state, storage_reader=reader, process_group=self.group)

        load_engine_state(load_into)
        trainer_state = torch.load(store.fetch(step, manifest, TRAINER_STATE, local_dir), weights_only=False)
        if manifest.entry(rng_file(self.rank)) is not None:
            restore_rng(torch.load(store.fetch(step, manifest, rng_file(self.rank), local_dir), weights_only=False))
        else:
            # A rank that did not exist at save time (world grew): derive its RNG from seed, rank and step.
            seed = int(trainer_state.get("seed", 0)) + 1000 * self.rank + step
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        shutil.rmtree(local_dir, ignore_errors=True)
        self.last_saved_step = step
        return Restored(step=step, uri=store.location(step).uri, trainer_state=trainer_state,
                        committed_at=manifest.created_at)


def new_session_id() -> str:
    return uuid.uuid4().hex[:12]
