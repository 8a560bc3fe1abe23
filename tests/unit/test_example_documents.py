"""The RAG example's documents: the shipped handbook cut into one document per section, written as parquet."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from loom.workloads.features.example_documents import FILE_NAME, HANDBOOK, sections, write


def test_one_document_per_section_with_a_slug_id() -> None:
    text = ("# Title\n\nintro is not a section\n\n## Inference graphs\n\nOne  line,\nand another.\n\n"
            "## Empty\n\n## A/B\nx\n")
    assert sections(text) == [("inference-graphs", "Inference graphs. One line, and another."), ("a-b", "A/B. x")]


def test_the_shipped_handbook_as_parquet(tmp_path: Path) -> None:
    at = datetime(2026, 11, 29, tzinfo=UTC)
    path = write(tmp_path, at)
    assert path.name == FILE_NAME
    frame = pd.read_parquet(path)
    assert list(frame.columns) == ["document_id", "text", "topic", "event_timestamp"]
    assert len(frame) == len(sections(HANDBOOK.read_text())) >= 5
    assert frame["document_id"].is_unique and (frame["document_id"] == frame["topic"]).all()
    assert "inference-graphs" in set(frame["document_id"])
    assert (frame["event_timestamp"] == pd.Timestamp(at)).all()


def test_loom_dev_up_seeds_it_where_the_rag_example_reads_it() -> None:
    import yaml

    from loom.devstack import backing

    class Recorder:
        def __init__(self) -> None:
            self.keys: list[tuple[str, str]] = []

        def upload_file(self, path: str, bucket: str, key: str) -> None:
            assert Path(path).exists()
            self.keys.append((bucket, key))

    recorder = Recorder()
    backing._seed_features(recorder)
    [view] = [d for d in yaml.safe_load_all((HANDBOOK.parent / "handbook-docs.yaml").read_text())
              if d and d["kind"] == "FeatureView"]
    bucket, key = view["spec"]["source"]["path"].removeprefix("s3://").split("/", 1)
    assert (bucket, key) in recorder.keys
    assert (bucket, key) == (backing.FEATURES_BUCKET, FILE_NAME)
