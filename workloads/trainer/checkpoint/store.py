"""The S3 layout of checkpoints and the operations on it.

    <prefix>/step-000000120/__0_0.distcp        DCP shard written by rank 0 (each rank only its own)
    <prefix>/step-000000120/.metadata           DCP global metadata (rank 0)
    <prefix>/step-000000120/rng-00001.pt        per-rank RNG state
    <prefix>/step-000000120/trainer_state.pt    step, data position, scheduler (rank 0)
    <prefix>/step-000000120/_reports/<session>/rank-00001.json   per-rank upload report
    <prefix>/step-000000120/manifest.json       written LAST by rank 0: the commit point
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ...common.s3 import S3Location, download_file, list_keys, sha256_file, upload_file
from .manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    RankReport,
    checkpoint_dir_name,
    complete_steps,
    merge_reports,
    steps_to_delete,
)


class _Waiting(Exception):
    """Not every rank has reported yet (retried by the poll in `wait_for_reports`)."""

    def __init__(self, reported: int) -> None:
        super().__init__(f"{reported} ranks reported")
        self.reported = reported

class CheckpointIntegrityError(RuntimeError):
    pass


class CheckpointStore:
    def __init__(self, client: Any, root: S3Location) -> None:
        self.client = client
        self.root = root

    def location(self, step: int) -> S3Location:
        return self.root.child(checkpoint_dir_name(step))

    def complete_steps(self) -> list[int]:
        return complete_steps((key for key, _ in list_keys(self.client, self.root)), self.root.key)

    def newest_complete(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def upload_rank_files(self, step: int, files: Iterable[tuple[Path, str]], rank: int, session: str) -> RankReport:
        """Upload this rank's files, then its report. Checksums are taken from the local files."""
        target = self.location(step)
        files = list(files)
        # Hash while uploading: hashlib releases the GIL, so checksums cost no extra wall time.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="loom-sha") as hashers:
            digests = [hashers.submit(sha256_file, path) for path, _ in files]
            for path, name in files:
                upload_file(self.client, path, target.child(name))
            entries = [
                FileEntry(path=name, size=path.stat().st_size, sha256=digest.result())
                for (path, name), digest in zip(files, digests, strict=True)
            ]
        report = RankReport(rank=rank, session=session, files=entries)
        report_key = target.child("_reports", session, f"rank-{rank:05d}.json")
        self.client.put_object(Bucket=report_key.bucket, Key=report_key.key, Body=report.model_dump_json().encode())
        return report

    def wait_for_reports(self, step: int, session: str, world_size: int, timeout_s: float) -> list[RankReport]:
        """Rank 0 waits until every rank of this session reported; stale reports of an earlier (torn)
        attempt at the same step live under another session id and are ignored."""
        reports_root = self.location(step).child("_reports", session)

        def reports() -> list[RankReport]:
            keys = [key for key, _ in list_keys(self.client, reports_root)]
            if len(keys) < world_size:
                raise _Waiting(len(keys))
            return [
                RankReport.model_validate_json(
                    self.client.get_object(Bucket=reports_root.bucket, Key=key)["Body"].read()
                )
                for key in keys
            ]

        # Polled at 0.05 s, doubling up to 1 s, until every rank reported or the timeout passed.
        polling = Retrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(_Waiting),
            reraise=True,
        )
        try:
            return polling(reports)
        except _Waiting as waiting:
            raise TimeoutError(f"only {waiting.reported}/{world_size} ranks reported checkpoint step {step}") from None

    def commit(self, step: int, reports: list[RankReport], world_size: int, engine: str) -> Manifest:
        manifest = merge_reports(reports, world_size, step, engine, time.time())
        key = self.location(step).child(MANIFEST_NAME)
        self.client.put_object(Bucket=key.bucket, Key=key.key, Body=manifest.model_dump_json(indent=1).encode())
        return manifest

    def read_manifest(self, step: int) -> Manifest:
        key = self.location(step).child(MANIFEST_NAME)
        body = self.client.get_object(Bucket=key.bucket, Key=key.key)["Body"].read()
        return Manifest.model_validate_json(body)

    def apply_retention(self, keep_last: int | None) -> list[int]:
        doomed = steps_to_delete(self.complete_steps(), keep_last)
        for step in doomed:
            location = self.location(step)
            # Manifest first: the checkpoint turns invisible before any of its shards disappear.
            manifest_key = location.child(MANIFEST_NAME)
            self.client.delete_object(Bucket=manifest_key.bucket, Key=manifest_key.key)
            keys = [key for key, _ in list_keys(self.client, location)]
            for start in range(0, len(keys), 1000):
                objects = [{"Key": k} for k in keys[start : start + 1000]]
                self.client.delete_objects(Bucket=location.bucket, Delete={"Objects": objects, "Quiet": True})
        return doomed

    def fetch(self, step: int, manifest: Manifest, name: str, local_dir: Path) -> Path:
        """Download one file of a checkpoint (once) and verify it against the manifest."""
        entry = manifest.entry(name)
        if entry is None:
            raise CheckpointIntegrityError(f"{name} is not part of checkpoint step {step}")
        target = local_dir / name
        if not (target.exists() and target.stat().st_size == entry.size):
            download_file(self.client, self.location(step).child(name), target)
        if target.stat().st_size != entry.size or sha256_file(target) != entry.sha256:
            target.unlink(missing_ok=True)
            raise CheckpointIntegrityError(f"{name} of checkpoint step {step} does not match its manifest")
        return target


class S3CheckpointReader(FileSystemReader):
    """A DCP reader that downloads only the shard files this rank's load plan touches.

    With a changed world size a rank reads slices of several saved shards; DCP's planner works out which,
    and this reader fetches exactly those files from S3 before handing over to the filesystem reader.
    """

    def __init__(self, store: CheckpointStore, step: int, manifest: Manifest, local_dir: Path) -> None:
        local_dir.mkdir(parents=True, exist_ok=True)
        store.fetch(step, manifest, ".metadata", local_dir)
        super().__init__(str(local_dir))
        self._store = store
        self._step = step
        self._manifest = manifest
        self._local_dir = local_dir

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):  # type: ignore[no-untyped-def]
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        for name in sorted(needed):
            self._store.fetch(self._step, self._manifest, name, self._local_dir)
        return super().read_data(plan, planner)


def describe(manifest: Manifest) -> str:
    return json.dumps({"step": manifest.step, "worldSize": manifest.world_size, "bytes": manifest.total_bytes()})
