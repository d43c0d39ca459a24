"""Limits on a YAML job file: its size, its nesting and the values its aliases stand for.

PyYAML builds one shared object per anchor, so loading an alias bomb (aliases of aliases: a
few KB standing for billions of values) is cheap, while every later walk over the result
(type checks, error messages, ``job.json``) meets the expanded tree. `expansion_problem` scans
the file's event stream, which the parser produces without recursion and without building
anything, and counts each alias as every value it stands for; a job over the limits is
refused before a single value is constructed. Merges (``<<: *base``) count like any alias.
"""

from __future__ import annotations

import yaml

__all__ = ["MAX_JOB_BYTES", "MAX_JOB_DEPTH", "MAX_JOB_VALUES", "expansion_problem"]

MAX_JOB_BYTES = 4 << 20
"""Largest job file, in bytes (4 MiB); a 64-adapter job is about 10 KB."""
MAX_JOB_VALUES = 250_000
"""Most values (scalars, lists and mappings, keys included) a job file may stand for once
every alias is expanded. A 64-adapter job has about 2,000 (4,500 resolved, every default
written out); PyYAML constructs about 100,000 values a second, so this costs <= 3 s."""
MAX_JOB_DEPTH = 64
"""Most nested lists and mappings; a job nests four deep (adapters, an adapter, dataset)."""

_OPENS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSES = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def expansion_problem(text: str, loader: type) -> tuple[int, str] | None:
    """Why the YAML ``text`` must not be loaded, as ``(line, problem)``; None when it may.

    Args:
        text: the YAML document.
        loader: the PyYAML loader class whose parser reads ``text``.

    Returns:
        The 1-based line and the problem: nesting deeper than `MAX_JOB_DEPTH`, more than
        `MAX_JOB_VALUES` values once aliases are expanded (the line of the value that crosses
        the limit), an alias inside the collection it names, or an undefined alias.

    Raises:
        yaml.YAMLError: on a syntax error (its mark names the line).
    """
    anchors: dict[str, int] = {}  # anchor -> values it stands for
    open_anchors: list[str | None] = []  # per open collection, its anchor
    starts: list[int] = []  # per open collection, the count before it opened
    count = 0
    for event in yaml.parse(text, Loader=loader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                return line, f"alias *{event.anchor} is inside the collection it names"
            if event.anchor not in anchors:
                return line, f"found undefined alias *{event.anchor}"
            count += anchors[event.anchor]
        elif isinstance(event, yaml.ScalarEvent):
            count += 1
            if event.anchor is not None:
                anchors[event.anchor] = 1
        elif isinstance(event, _OPENS):
            if len(starts) == MAX_JOB_DEPTH:
                return line, f"nested too deeply (more than {MAX_JOB_DEPTH} levels)"
            starts.append(count)
            open_anchors.append(event.anchor)
            count += 1
        elif isinstance(event, _CLOSES):
            anchor, start = open_anchors.pop(), starts.pop()
            if anchor is not None:
                anchors[anchor] = count - start
        if count > MAX_JOB_VALUES:
            return line, (
                f"the aliases expand to more than {MAX_JOB_VALUES} values (each use of an "
                f"alias counts every value it stands for; a job file needs a few thousand)"
            )
    return None
