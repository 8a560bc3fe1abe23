"""The pure parts of vector FeatureViews: chunking, the re-embedding decision, metadata filters, the workload's
vector config checks, and the operator's rendering of spec.vector into the workload config."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from loom.workloads.features.chunking import chunk_documents, chunk_text
from loom.workloads.features.config import FeatureViewConfig
from loom.workloads.features.embedding import ReembedNeeded, reembed_decision, same_model
from loom.workloads.features.vector_index import IndexMeta

TEXT = "The quick brown fox jumps over the lazy dog. " * 6


def test_chunks_cover_the_text_in_order_within_size() -> None:
    chunks = chunk_text(TEXT, 40, 10)
    assert all(len(c) <= 40 for c in chunks)
    assert chunks[0].startswith("The quick")
    assert chunks[-1].endswith("lazy dog.")
    # Every word of the text is in some chunk, in order: rejoined without the overlaps, the chunks are the text.
    words = TEXT.split()
    seen = [w for c in chunks for w in c.split()]
    position = 0
    for word in seen:
        if position < len(words) and word == words[position]:
            position += 1
    assert position >= len(words) - 1


def test_consecutive_chunks_overlap_and_cut_at_spaces() -> None:
    chunks = chunk_text(TEXT, 40, 10)
    for before, after in itertools.pairwise(chunks):
        assert after.split()[0] in before.split()  # the overlap repeats at least the boundary word
    assert all(not c.startswith(" ") and not c.endswith(" ") for c in chunks)
    assert len(chunk_text(TEXT, 40, 0)) < len(chunks)


def test_text_without_spaces_is_cut_hard_and_short_text_is_one_chunk() -> None:
    assert chunk_text("x" * 50, 16, 4) == ["x" * 16, "x" * 16, "x" * 16, "x" * 14]
    assert chunk_text("  a short note  ", 100, 10) == ["a short note"]
    assert chunk_text("   ", 100, 10) == []


def test_bad_chunking_is_refused() -> None:
    with pytest.raises(ValueError, match="overlap"):
        chunk_text(TEXT, 10, 10)


def test_chunk_ids_number_each_document_from_zero() -> None:
    chunks = chunk_documents([("a", "one two three four five six"), ("b", "seven")], 16, 4)
    assert [c.chunk_id for c in chunks] == ["a#0", "a#1", "a#2", "b#0"]
    assert [c.text for c in chunks] == ["one two three", "three four five", "five six", "seven"]


def meta(model: str | None, reembed: int = 0, documents: int = 5) -> IndexMeta:
    return IndexMeta(dimension=8, metric="cosine", model=model, reembed=reembed, documents=documents)


def test_reembed_decision() -> None:
    assert reembed_decision(None, "m1", 0) == "fresh"
    assert reembed_decision(meta(None), "m1", 0) == "fresh"
    assert reembed_decision(meta("m1", documents=0), "m2", 0) == "fresh"
    assert reembed_decision(meta("m1"), "m1", 0) == "keep"
    assert reembed_decision(meta("m1", reembed=1), "m2", 2) == "rebuild"
    with pytest.raises(ReembedNeeded, match=r"'m1'.*'m2'.*reembed to 2"):
        reembed_decision(meta("m1", reembed=1), "m2", 1)


def test_a_model_known_without_its_source_is_the_same_model_by_name() -> None:
    assert same_model("m@s3://a", "m@s3://a")
    assert not same_model("m@s3://a", "m@s3://b")  # another model under the same name
    assert same_model("m@s3://a", "m") and same_model("m", "m@s3://a")  # the source not known this time
    assert not same_model("m@s3://a", "n")
    assert reembed_decision(meta("m@s3://a"), "m", 0) == "keep"
    with pytest.raises(ReembedNeeded):
        reembed_decision(meta("m@s3://a"), "m@s3://b", 0)


def view(**vector: object) -> dict[str, object]:
    return {
        "name": "docs",
        "entities": [{"name": "chunk_id", "valueType": "String"}],
        "features": [
            {"name": "text", "dtype": "String"},
            {"name": "embedding", "dtype": "Array(Float32)"},
            {"name": "score", "dtype": "Float32"},
        ],
        "source": {"path": "/data/docs.parquet"},
        "vector": {"field": "embedding", "dimension": 8, **vector},
    }


def test_vector_config_checks_the_fields() -> None:
    assert FeatureViewConfig.model_validate(view(textField="text")).vector is not None
    with pytest.raises(ValidationError, match=r"vector field 'score' must be a feature of dtype Array\(Float32\)"):
        FeatureViewConfig.model_validate(view(field="score"))
    with pytest.raises(ValidationError, match="text field 'score' must be a String feature"):
        FeatureViewConfig.model_validate(view(textField="score"))
    embedding = {"url": "http://e", "model": "m", "outputPath": "/data/x.parquet"}
    with pytest.raises(ValidationError, match=r"needs vector\.textField"):
        FeatureViewConfig.model_validate(view(embedding=embedding))
    with pytest.raises(ValidationError, match="overlap"):
        FeatureViewConfig.model_validate(
            view(textField="text", embedding={**embedding, "chunking": {"size": 100, "overlap": 100}})
        )
