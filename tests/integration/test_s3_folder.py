"""The folder store answers the workloads' S3 helpers as a real S3 server does (moto's), call for call: what local
mode's `--checkpoint-dir` relies on to run the trainer's unchanged checkpoint code against a folder."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from loom.devstack.servers import S3Endpoint
from loom.workloads.common.s3 import S3Location, download_tree, list_keys, make_client, upload_file


def exercise(client: Any, bucket: str, tmp: Path) -> dict[str, Any]:
    client.create_bucket(Bucket=bucket)
    source = tmp / "shard.bin"
    source.write_bytes(b"x" * 1000)
    upload_file(client, source, S3Location(bucket, "ckpt/step-000000004/__0_0.distcp"))
    client.put_object(Bucket=bucket, Key="ckpt/step-000000004/manifest.json", Body=b'{"step": 4}')
    client.put_object(Bucket=bucket, Key="ckpt/step-000000008/manifest.json", Body=b'{"step": 8}')
    client.put_object(Bucket=bucket, Key="ckptx/other", Body=b"not under ckpt/")
    listed = list(list_keys(client, S3Location(bucket, "ckpt")))
    manifest = client.get_object(Bucket=bucket, Key="ckpt/step-000000008/manifest.json")["Body"].read()
    mirrored = sorted(p.relative_to(tmp / "mirror").as_posix()
                      for p in download_tree(client, S3Location(bucket, "ckpt/step-000000004"), tmp / "mirror"))
    # As the checkpoint store's retention deletes a step: every key under it, in one batch.
    doomed = [{"Key": key} for key, _ in list_keys(client, S3Location(bucket, "ckpt/step-000000004"))]
    client.delete_objects(Bucket=bucket, Delete={"Objects": doomed, "Quiet": True})
    deleted = len(doomed)
    after = [key for key, _ in list_keys(client, S3Location(bucket, "ckpt"))]
    missing = None
    try:
        client.get_object(Bucket=bucket, Key="ckpt/nothing")
    except client.exceptions.ClientError as error:
        missing = error.response["Error"]["Code"]
    return {"listed": listed, "manifest": manifest, "mirrored": mirrored, "deleted": deleted, "after": after,
            "missing": missing}


@pytest.mark.slow
def test_the_folder_store_behaves_as_s3_for_the_workloads_calls(s3: S3Endpoint, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"folder-{uuid.uuid4().hex[:8]}"
    (tmp_path / "s3").mkdir()
    (tmp_path / "folder").mkdir()
    real = exercise(make_client(s3.url), bucket, tmp_path / "s3")
    folder = exercise(make_client(f"file://{tmp_path / 'store'}"), bucket, tmp_path / "folder")
    assert folder == real
    assert real["listed"] == [("ckpt/step-000000004/__0_0.distcp", 1000), ("ckpt/step-000000004/manifest.json", 11),
                              ("ckpt/step-000000008/manifest.json", 11)]
    assert real["after"] == ["ckpt/step-000000008/manifest.json"] and real["missing"] == "NoSuchKey"
    assert (tmp_path / "store" / bucket / "ckpt" / "step-000000008" / "manifest.json").read_bytes() == b'{"step": 8}'
