"""Skills (report §4.2.1, the "skills" module): instruction files an agent loads when it needs them.

A skill is a Markdown file `<skills_dir>/<name>.md`. Its description is the `description:` line of an optional
front-matter block (between two `---` lines at the top), else its first non-empty line. The system prompt lists
every skill by name and description; the `load_skill` tool returns a skill's body. Loading on demand keeps the
prompt short however many skills there are.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    body: str


def parse_skill(name: str, text: str) -> Skill:
    """A skill from its file's text: the front matter's description (if any) and the body after it."""
    body, description = text, ""
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        if end != -1:
            for line in text[4:end].splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "description":
                    description = value.strip()
            body = text[end + 4:].lstrip("\n")
    if not description:
        description = next((ln.strip().lstrip("#").strip() for ln in body.splitlines() if ln.strip()), "")
    return Skill(name, description, body)


class SkillLibrary:
    """The skills in one directory. A missing directory is an empty library."""

    def __init__(self, skills_dir: str):
        self.dir = skills_dir
        self._skills: dict[str, Skill] = {}
        if os.path.isdir(skills_dir):
            for fname in sorted(os.listdir(skills_dir)):
                name, ext = os.path.splitext(fname)
                if ext == ".md" and _NAME.match(name):
                    with open(os.path.join(skills_dir, fname)) as f:
                        self._skills[name] = parse_skill(name, f.read())

    def names(self) -> list[str]:
        return list(self._skills)

    def get(self, name: str) -> Skill | None:
        return self._skills.get(name)

    def render(self) -> str:
        """The listing for a system prompt: one line per skill, name and description."""
        if not self._skills:
            return "(no skills)"
        return "\n".join(f"- {s.name}: {s.description}" for s in self._skills.values())
