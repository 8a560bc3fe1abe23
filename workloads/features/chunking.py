"""Cutting documents into chunks for embedding (pure).

A chunk is at most ``size`` characters; consecutive chunks share about ``overlap`` characters so a sentence cut at a
boundary is whole in one of them (a window starts at a word's beginning, so the overlap may be a little longer).
A cut moves back to the last whitespace in the chunk's second half, so words are
not split when the text has spaces; text without any is cut hard at ``size``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    document_id: str
    number: int  # 0, 1, ... within the document
    text: str

    @property
    def chunk_id(self) -> str:
        """The chunk's key in the store: ``<document id>#<n>``."""
        return f"{self.document_id}#{self.number}"


def chunk_text(text: str, size: int, overlap: int) -> list[str]:
    """``text`` cut into windows of at most ``size`` characters sharing ``overlap``; blank text has no chunks."""
    if size < 1 or not 0 <= overlap < size:
        raise ValueError(f"chunking needs size >= 1 and 0 <= overlap < size (got size {size}, overlap {overlap})")
    text = text.strip()
    chunks: list[str] = []
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
            if cut > start:
                end = cut
        piece = text[start:end].strip()
        if piece:
            chunks.append(piece)
        if end >= len(text):
            break
        start = _word_start(text, max(end - overlap, start + 1), start)
    return chunks


def _word_start(text: str, start: int, previous: int) -> int:
    """``start`` moved back to the beginning of the word it falls in (a little more overlap, no half word), but
    never back to ``previous`` (each window must move forward)."""
    if text[start - 1].isspace():
        return start
    space = text.rfind(" ", previous + 1, start)
    return space + 1 if space != -1 else start


def chunk_documents(documents: list[tuple[str, str]], size: int, overlap: int) -> list[Chunk]:
    """Every (document id, text) as its chunks, in order."""
    return [
        Chunk(document_id, number, piece)
        for document_id, text in documents
        for number, piece in enumerate(chunk_text(text, size, overlap))
    ]
