"""Reading user files and checking parsed documents, so that bad input is one line, never a hang.

Every cluster, model, plan, pipelines and profile file goes through `read_yaml` or `read_json`:
bounded size, UTF-8 text, no YAML aliases (a "billion laughs" file expands in the parser), no
integer literals longer than limits.MAX_NUMBER_CHARS, bounded nesting. `document_problems` then
walks the parsed tree: string keys, finite numbers, no control characters, only JSON types.
Field validators (cluster, models, plan) add the bounds and types of each field.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, TypeGuard

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

from planner.errors import SpecError
from planner.limits import (
    MAX_JSON_FILE_BYTES,
    MAX_NESTING,
    MAX_NUMBER_CHARS,
    MAX_REPORTED_PROBLEMS,
    MAX_SHOWN_CHARS,
    MAX_YAML_FILE_BYTES,
    MAX_YAML_NODES,
)

# Names that end up in host lists, file names and generated shell text (DESIGN: safe by
# construction): nodes, node groups, host names, partitions.
NAME_RE = re.compile(r"[A-Za-z0-9._-]+\Z")
NAME_RULE = "letters, digits, '.', '_' and '-'"
# In string values tab, LF and CR are text (descriptions, comments); keys become parts of the
# one-line paths in error messages, so they hold no control character at all.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_KEY_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def is_int(v: object) -> TypeGuard[int]:
    """An integer that is not a bool (JSON/YAML `true` must not count as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> TypeGuard[int | float]:
    """A finite int or float that is not a bool."""
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and (isinstance(v, int) or math.isfinite(v))
    )


def short(value: object) -> str:
    """repr(value), cut to limits.MAX_SHOWN_CHARS, for quoting a value in an error line."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def name_problem(value: object, where: str, what: str = "name") -> str | None:
    """None, or the one line saying why `value` is not a safe name."""
    if isinstance(value, str) and NAME_RE.match(value):
        return None
    return f"{where}: must be a non-empty {what} of {NAME_RULE}, got {short(value)}"


def int_problem(value: object, where: str, lo: int, hi: int) -> str | None:
    """None, or the line saying `value` is not an integer in [lo, hi]."""
    if is_int(value) and lo <= value <= hi:
        return None
    kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
    if is_int(value) and value > hi:
        return f"{where}: {short(value)} is above the limit of {hi:,} (limits in planner/limits.py)"
    return f"{where}: must be {kind}, got {short(value)}"


def _path_text(prefix: str, segments: Sequence[int | str]) -> str:
    """'a.b[3].c' from the walk's segments; formatted only when a problem is reported."""
    out = prefix
    for seg in segments:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            seg = seg if len(seg) <= MAX_SHOWN_CHARS else seg[: MAX_SHOWN_CHARS - 3] + "..."
            out = f"{out}.{seg}" if out else seg
    return out or "document"


_END = object()
_PLAIN_SCALARS = {int, bool, type(None)}


def document_problems(data: object, prefix: str = "") -> list[str]:
    """One-line problems of a parsed document, independent of its schema (empty if none).

    Walks in document order with a stack of iterators (no recursion, no per-element copies: a
    flat list of millions of values costs one pass) and stops after MAX_REPORTED_PROBLEMS.
    """
    problems: list[str] = []
    # one iterator of (key or index, value) per open level
    stack: list[Iterator[tuple[Any, Any]]] = [iter(((None, data),))]
    in_map = [False]  # whether that level is a mapping (keys to check)
    path: list[Any] = [None]  # the key or index being visited at each level
    while stack and len(problems) < MAX_REPORTED_PROBLEMS:
        item: Any = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            in_map.pop()
            path.pop()
            continue
        seg, value = item
        path[-1] = seg
        if in_map[-1] and not isinstance(seg, str):
            problems.append(f"{_path_text(prefix, path[1:-1])}: key {short(seg)} must be a string")
            continue
        if in_map[-1] and _KEY_CONTROL.search(seg):
            problems.append(
                f"{_path_text(prefix, path[1:-1])}: key {short(seg)} contains a control character"
            )
            continue
        if len(stack) - 1 > MAX_NESTING:
            problems.append(
                f"{_path_text(prefix, path[1:])}: nested more than {MAX_NESTING} levels deep"
            )
        elif isinstance(value, dict):
            stack.append(iter(value.items()))
            in_map.append(True)
            path.append(None)
        elif isinstance(value, list):
            if len(stack) < MAX_NESTING:  # a list of plain numbers: checked at C speed
                kinds = set(map(type, value))
                if kinds <= _PLAIN_SCALARS or (kinds == {float} and all(map(math.isfinite, value))):
                    continue
            stack.append(enumerate(value))
            in_map.append(False)
            path.append(None)
        elif isinstance(value, float):
            if not math.isfinite(value):
                problems.append(f"{_path_text(prefix, path[1:])}: {value!r} is not a finite number")
        elif isinstance(value, str):
            if _CONTROL.search(value):
                problems.append(
                    f"{_path_text(prefix, path[1:])}: {short(value)} contains a control character"
                )
        elif isinstance(value, LongNumber):
            problems.append(
                f"{_path_text(prefix, path[1:])}: a number of {len(value.text):,} "
                f"characters, above the limit of {MAX_NUMBER_CHARS} (limits in "
                f"planner/limits.py)"
            )
        elif not (value is None or isinstance(value, (bool, int))):
            problems.append(
                f"{_path_text(prefix, path[1:])}: a {type(value).__name__} value is "
                f"not allowed here; write a string, number, true/false, list or "
                f"mapping"
            )
    return problems


def read_text(path: str | os.PathLike[str], what: str, limit: int) -> str:
    """The file's text: at most `limit` bytes, UTF-8 (an optional BOM is dropped), no NUL."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise SpecError(f"{path}: cannot read {what}: {e.strerror}")
    if len(raw) > limit:
        raise SpecError(f"{path}: {what} is larger than the limit of {limit:,} bytes")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: {what} is not UTF-8 text (byte {e.start} is "
            f"0x{raw[e.start]:02x}); save it as UTF-8"
        )
    if "\x00" in text:
        raise SpecError(
            f"{path}: {what} contains a NUL character at offset {text.index(chr(0))} "
            f"(UTF-16?); save it as UTF-8"
        )
    return text


class _JSONRefusal(Exception):
    """Raised from json.loads hooks: an object the planner refuses (one line)."""


class LongNumber:
    """A JSON number literal longer than MAX_NUMBER_CHARS, kept unconverted (conversion time
    grows quadratically with the digits) so that document_problems refuses it with its path."""

    def __init__(self, text: str) -> None:
        self.text = text


def _json_int(text: str) -> int | LongNumber:
    return int(text) if len(text) <= MAX_NUMBER_CHARS else LongNumber(text)


def _json_float(text: str) -> float | LongNumber:
    # 1e999 becomes inf, reported with its path by document_problems
    return float(text) if len(text) <= MAX_NUMBER_CHARS else LongNumber(text)


def _json_constant(text: str) -> float:
    """NaN, Infinity, -Infinity: read as floats so that document_problems refuses them with the
    field's path (refusing here could not name the field)."""
    return float(text)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A dict, refusing a key given twice (json would silently keep the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _JSONRefusal(f"key {short(k)} appears twice in one object")
            seen.add(k)
    return out


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a JSON file within the limits; SpecError lines name the file."""
    text = read_text(path, what, MAX_JSON_FILE_BYTES)
    try:
        data = json.loads(
            text,
            parse_int=_json_int,
            parse_float=_json_float,
            parse_constant=_json_constant,
            object_pairs_hook=_json_object,
        )
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except _JSONRefusal as e:
        raise SpecError(f"{path}: not valid JSON here: {e}")
    except RecursionError:
        raise SpecError(f"{path}: not valid JSON: nested too deeply (at most {MAX_NESTING} levels)")
    problems = document_problems(data)
    if problems:
        raise SpecError([f"{path}: {p}" for p in problems])
    return data


# YAML 1.1 reads some plain scalars as numbers that nobody means: `1:0` (base 60: 60), `010`
# (octal: 8), `0x10`, `0b1`. They are refused, so a number always means its decimal reading.
# `_` between digits (`1_000`) is accepted as a digit separator, as Python reads it; `+5` and
# `-5` keep their sign; floats like `1.5`, `.5`, `1.0e+3` are accepted, `.inf`/`.nan` are read
# and then refused as not finite by document_problems.
_DECIMAL_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*(?:_[0-9]+)*)\Z")
_PLAIN_FLOAT = re.compile(
    r"[-+]?(?:[0-9]+(?:_[0-9]+)*)?\.[0-9_]*(?:[eE][-+][0-9]+)?\Z"
    r"|[-+]?\.(?:inf|Inf|INF)\Z|\.(?:nan|NaN|NAN)\Z"
)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases (each `*name` could copy a whole subtree: billion laughs),
    without explicit tags, duplicate keys, timestamps (dates stay strings) or surprising YAML 1.1
    numbers, and with bounded nesting, node count and number length."""

    depth = 0
    nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            # Any: the stubs type an event's mark as either of PyYAML's two Mark classes
            mark: Any = event.start_mark
            raise ComposerError(
                None, None, "aliases (*name) are not allowed; write the value out", mark
            )
        # an explicit tag (`!!int abc`, `!!python/...`, `!x`) would bypass the checks below
        tag = getattr(event, "tag", None)
        if tag is not None:
            shown = "!!" + tag[18:] if tag.startswith("tag:yaml.org,2002:") else tag
            raise ComposerError(
                None,
                None,
                f"explicit tags ({shown[:MAX_SHOWN_CHARS]}) are not allowed; write the plain value",
                event.start_mark,
            )
        if self.depth >= MAX_NESTING:  # before Python's recursion limit, which is slow here
            raise ComposerError(
                None, None, f"nested more than {MAX_NESTING} levels deep", event.start_mark
            )
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:  # counted while composing: bounds time and memory
            raise ComposerError(
                None,
                None,
                f"more than {MAX_YAML_NODES:,} values (limits in planner/limits.py)",
                event.start_mark,
            )
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: refused by the base class, one line
                continue
            if duplicate:
                raise ConstructorError(
                    None,
                    None,
                    f"key {short(key)} appears twice in one mapping",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        text = node.value
        if len(text) > MAX_NUMBER_CHARS:
            raise ConstructorError(
                None, None, f"a number longer than {MAX_NUMBER_CHARS} digits", node.start_mark
            )
        if not _DECIMAL_INT.match(text):
            raise ConstructorError(
                None,
                None,
                f"{short(text)} is a YAML 1.1 octal, hex, binary "
                f"or base-60 number; write it in decimal, or quote it for "
                f"text",
                node.start_mark,
            )
        return self.construct_yaml_int(node)

    def construct_bounded_float(self, node: yaml.ScalarNode) -> float:
        text = node.value
        if len(text) > MAX_NUMBER_CHARS:
            raise ConstructorError(
                None, None, f"a number longer than {MAX_NUMBER_CHARS} digits", node.start_mark
            )
        if not _PLAIN_FLOAT.match(text):
            raise ConstructorError(
                None,
                None,
                f"{short(text)} is a YAML 1.1 base-60 number; "
                f"write it in decimal, or quote it for text",
                node.start_mark,
            )
        return self.construct_yaml_float(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_bounded_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_bounded_float)
# (the stubs expect a method of the loader class itself here)
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)  # type: ignore[type-var]


def _yaml_error_line(e: yaml.YAMLError) -> str:
    """One line for any PyYAML error: line number and the problem, without the code excerpt."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if isinstance(e, yaml.reader.ReaderError):
        return f"not valid YAML: {e.reason} (character {e.character!r} at offset {e.position})"
    where = f"line {mark.line + 1}: " if mark is not None else ""
    text = problem or str(e)
    return f"{where}not valid YAML: {' '.join(str(text).split())}"


def parse_yaml(text: str, source: str | os.PathLike[str]) -> Any:
    """Parse YAML text with the strict loader; SpecError lines name `source`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: {_yaml_error_line(e)}")
    except RecursionError:
        raise SpecError(
            f"{source}: not valid YAML: nested too deeply (at most {MAX_NESTING} levels)"
        )
    except (ValueError, TypeError) as e:  # a constructor's own error: still one line
        raise SpecError(f"{source}: not valid YAML: {short(' '.join(str(e).split()))}")


def read_yaml(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a YAML file within the limits; SpecError lines name the file."""
    data = parse_yaml(read_text(path, what, MAX_YAML_FILE_BYTES), path)
    problems = document_problems(data)
    if problems:
        raise SpecError([f"{path}: {p}" for p in problems])
    return data
