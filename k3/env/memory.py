"""Memory (report §4.2.1, the "memories" module): notes an agent keeps across the episodes of one task family.

One JSON file per family under the memory directory, `{"version": 1, "notes": {key: text}}`. Every change is
written to a temporary file and renamed over the old one, so a reader never sees half a file, and two episodes
writing at once lose at most one of their changes, never the file. Families never see each other's notes.
"""

from __future__ import annotations

import json
import os
import re

from k3.files import atomic_write_text

MEMORY_VERSION = 1


class MemoryStore:
    """The notes of one task family, kept in `<memory_dir>/<family>.json`."""

    def __init__(self, memory_dir: str, family: str, max_notes: int = 64, max_note_chars: int = 4000):
        if not family:
            raise ValueError("a memory store needs the task family's name, got an empty one")
        self.path = os.path.join(memory_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", family) + ".json")
        self.max_notes = max_notes
        self.max_note_chars = max_note_chars

    def notes(self) -> dict[str, str]:
        """Every note, by key; empty when nothing was written yet."""
        if not os.path.exists(self.path):
            return {}
        with open(self.path) as f:
            data = json.load(f)
        if not (isinstance(data, dict) and data.get("version") == MEMORY_VERSION
                and isinstance(data.get("notes"), dict)):
            raise ValueError(f"memory file {self.path} is not a version-{MEMORY_VERSION} memory file")
        return {str(k): str(v) for k, v in data["notes"].items()}

    def write(self, key: str, text: str) -> None:
        if len(text) > self.max_note_chars:
            raise ValueError(f"a note holds at most {self.max_note_chars} characters, got {len(text)}")
        notes = self.notes()
        if key not in notes and len(notes) >= self.max_notes:
            raise ValueError(f"memory is full ({self.max_notes} notes): delete one first")
        notes[key] = text
        self._save(notes)

    def delete(self, key: str) -> bool:
        notes = self.notes()
        if key not in notes:
            return False
        del notes[key]
        self._save(notes)
        return True

    def render(self) -> str:
        """The notes as text for a system prompt."""
        notes = self.notes()
        if not notes:
            return "(no notes yet)"
        return "\n".join(f"- {k}: {v}" for k, v in sorted(notes.items()))

    def _save(self, notes: dict[str, str]) -> None:
        atomic_write_text(self.path, json.dumps({"version": MEMORY_VERSION, "notes": notes}, indent=1, sort_keys=True))
