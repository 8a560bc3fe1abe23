"""A feature view's vector index: one sqlite-vec ``vec0`` table per view in a sqlite file beside the online store.

Feast 0.67's own sqlite vector search loads sqlite-vec only on Python 3.10, copies every vector of the view into a
scratch table on each query and ignores the metric, so Loom keeps the index itself: a persistent ``vec0`` table
created with the view's dimension and distance metric, written with the rows Feast writes to the online store
(:mod:`loom.workloads.features.vector_store`), and a ``meta`` row per view recording what the index holds
(dimension, metric, the embedding model whose vectors these are), so two models' vectors never share an index.

Python's ``sqlite3`` may be built without loadable extensions (pyenv's default); ``pysqlite3`` (its own SQLite,
extensions on) stands in then. Search is sqlite-vec's exact KNN (a full scan, no approximate index).
"""

from __future__ import annotations

import importlib
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# sqlite-vec's names for the metrics a vec0 column takes (`distance_metric=`).
VEC0_METRICS = {"cosine": "cosine", "l2": "l2", "l1": "L1"}

_NAME = re.compile(r"[^A-Za-z0-9_]")


def _sqlite_module() -> Any:
    """A DB-API sqlite module whose connections can load extensions."""
    import sqlite3

    if hasattr(sqlite3.Connection, "enable_load_extension"):
        return sqlite3
    try:
        return importlib.import_module("pysqlite3.dbapi2")
    except ImportError as exc:  # pragma: no cover - depends on how Python was built
        raise RuntimeError(
            "this Python's sqlite3 cannot load extensions and pysqlite3 is not installed; sqlite-vec needs one"
        ) from exc


def connect(path: str) -> Any:
    """A connection to the index file with sqlite-vec loaded (the folder is created)."""
    import sqlite_vec

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = _sqlite_module().connect(path, timeout=30.0, check_same_thread=False)
    db.enable_load_extension(True)
    sqlite_vec.load(db)
    db.enable_load_extension(False)
    db.execute("pragma journal_mode=wal")
    db.execute(
        "create table if not exists loom_vector_meta (view text primary key, dimension integer not null, "
        "metric text not null, model text, reembed integer not null default 0)"
    )
    return db


def table_name(project: str, view: str) -> str:
    return "vec_" + _NAME.sub("_", f"{project}__{view}")


def pack(vector: Sequence[float]) -> bytes:
    return struct.pack(f"{len(vector)}f", *vector)


def unpack(blob: bytes) -> list[float]:
    return list(struct.unpack(f"{len(blob) // 4}f", blob))


@dataclass(frozen=True)
class IndexMeta:
    """What a view's index holds."""

    dimension: int
    metric: str
    model: str | None  # the embedding model identity of every vector in it (None: vectors came precomputed)
    reembed: int  # the re-embedding generation that built it
    documents: int  # vectors in the index


class DimensionError(ValueError):
    """A vector's length differs from the index's dimension."""


class VectorIndex:
    """One view's vec0 table and its meta row in an open index connection."""

    def __init__(self, db: Any, project: str, view: str) -> None:
        self.db, self.view = db, view
        self.table = table_name(project, view)

    def meta(self) -> IndexMeta | None:
        row = self.db.execute(
            "select dimension, metric, model, reembed from loom_vector_meta where view = ?", (self.view,)
        ).fetchone()
        if row is None:
            return None
        return IndexMeta(int(row[0]), str(row[1]), row[2], int(row[3]), self.count())

    def count(self) -> int:
        try:
            return int(self.db.execute(f'select count(*) from "{self.table}"').fetchone()[0])
        except Exception:
            return 0

    def ensure(self, dimension: int, metric: str) -> None:
        """Create the table; one whose dimension or metric differs is dropped and made anew (its vectors could not
        be compared with the new ones)."""
        current = self.meta()
        if current is not None and (current.dimension, current.metric) == (dimension, metric):
            return
        with self.db:
            self.db.execute(f'drop table if exists "{self.table}"')
            self.db.execute(
                f'create virtual table "{self.table}" using vec0(doc_key text primary key, '
                f"embedding float[{dimension}] distance_metric={VEC0_METRICS[metric]})"
            )
            self.db.execute(
                "insert into loom_vector_meta(view, dimension, metric, model, reembed) values (?, ?, ?, null, 0) "
                "on conflict(view) do update set dimension = excluded.dimension, metric = excluded.metric, "
                "model = null, reembed = 0",
                (self.view, dimension, metric),
            )

    def record_model(self, model: str | None, reembed: int) -> None:
        with self.db:
            self.db.execute(
                "update loom_vector_meta set model = ?, reembed = ? where view = ?", (model, reembed, self.view)
            )

    def clear(self) -> None:
        with self.db:
            self.db.execute(f'delete from "{self.table}"')

    def upsert(self, rows: Iterable[tuple[str, Sequence[float]]], dimension: int) -> int:
        """Write (key, vector) rows, replacing a key's old vector; returns how many."""
        written = 0
        with self.db:
            for key, vector in rows:
                if len(vector) != dimension:
                    raise DimensionError(
                        f"feature view {self.view!r}: a vector of length {len(vector)} for an index of dimension "
                        f"{dimension}"
                    )
                self.db.execute(f'delete from "{self.table}" where doc_key = ?', (key,))
                self.db.execute(f'insert into "{self.table}"(doc_key, embedding) values (?, ?)', (key, pack(vector)))
                written += 1
        return written

    def delete(self, keys: Iterable[str]) -> int:
        removed = 0
        with self.db:
            for key in keys:
                removed += self.db.execute(f'delete from "{self.table}" where doc_key = ?', (key,)).rowcount or 0
        return removed

    def keys(self) -> set[str]:
        return {str(row[0]) for row in self.db.execute(f'select doc_key from "{self.table}"')}

    def vectors(self, keys: Sequence[str]) -> dict[str, list[float]]:
        """Stored vectors of ``keys`` (those present)."""
        found: dict[str, list[float]] = {}
        for key in keys:
            row = self.db.execute(f'select embedding from "{self.table}" where doc_key = ?', (key,)).fetchone()
            if row is not None:
                found[key] = unpack(row[0])
        return found

    def search(self, query: Sequence[float], k: int) -> list[tuple[str, float]]:
        """The ``k`` nearest keys and their distances, nearest first (exact KNN)."""
        rows = self.db.execute(
            f'select doc_key, distance from "{self.table}" where embedding match ? and k = ? order by distance',
            (pack(query), k),
        ).fetchall()
        return [(str(key), float(distance)) for key, distance in rows]

    def drop(self) -> None:
        with self.db:
            self.db.execute(f'drop table if exists "{self.table}"')
            self.db.execute("delete from loom_vector_meta where view = ?", (self.view,))
