"""The RAG example's documents: the handbook shipped in examples/rag/loom-handbook.md, one document per section.

``python -m loom.workloads.features.example_documents --out DIR`` writes ``handbook.parquet``: one row per ``## ``
section, ``document_id`` (the section's title as a slug, e.g. ``inference-graphs``), ``text`` (the title and the
section's paragraphs), ``topic`` (the slug again: metadata a retrieval step can filter on) and ``event_timestamp``
(UTC, ``--at``, default now). ``loom dev up`` seeds it as s3://loom-features/handbook.parquet, which the vector
FeatureView of examples/rag/ reads and embeds.
"""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

HANDBOOK = Path(__file__).resolve().parents[2] / "examples" / "rag" / "loom-handbook.md"
FILE_NAME = "handbook.parquet"


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def sections(text: str) -> list[tuple[str, str]]:
    """(slug, text) of every ``## `` section, in order; the text is the title line and the section's paragraphs."""
    found: list[tuple[str, str]] = []
    title: str | None = None
    lines: list[str] = []
    for line in [*text.splitlines(), "## "]:
        if line.startswith("## "):
            body = " ".join(" ".join(lines).split())
            if title is not None and body:
                found.append((slug(title), f"{title}. {body}"))
            title, lines = line.removeprefix("## ").strip(), []
        elif title is not None:
            lines.append(line)
    return found


def documents(text: str, at: datetime) -> pd.DataFrame:
    rows = [{"document_id": doc_id, "text": body, "topic": doc_id, "event_timestamp": at}
            for doc_id, body in sections(text)]
    frame = pd.DataFrame(rows)
    frame["event_timestamp"] = pd.to_datetime(frame["event_timestamp"], utc=True)
    return frame


def write(folder: Path, at: datetime | None = None, source: Path = HANDBOOK) -> Path:
    path = folder / FILE_NAME
    documents(source.read_text(), at or datetime.now(UTC)).to_parquet(path, index=False)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--at", help="the rows' event time (ISO 8601, UTC); default now")
    args = parser.parse_args()
    at = datetime.fromisoformat(args.at.replace("Z", "+00:00")) if args.at else None
    print(write(args.out, at))


if __name__ == "__main__":
    main()
