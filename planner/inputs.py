"""Reading user files and checking parsed documents, so that bad input is one line, never a hang.

Every cluster, model, plan, pipelines and profile file goes through `read_yaml` or `read_json`:
bounded size, UTF-8 text, no YAML aliases (a "billion laughs" file expands in the parser), no
integer literals longer than limits.MAX_NUMBER_CHARS, bounded nesting. `document_problems` then
walks the parsed tree: string keys, finite numbers, no control characters, only JSON types.
Field validators (cluster, models, plan) add the bounds and types of each field.
"""
import json
import math
import re
import sys

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

from planner.errors import SpecError
from planner.limits import (MAX_JSON_FILE_BYTES, MAX_NESTING, MAX_NUMBER_CHARS,
                            MAX_YAML_FILE_BYTES)

# Names that end up in host lists, file names and generated shell text (DESIGN: safe by
# construction): nodes, node groups, host names, partitions.
NAME_RE = re.compile(r"[A-Za-z0-9._-]+\Z")
NAME_RULE = "letters, digits, '.', '_' and '-'"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")    # tab, LF and CR are text
_MAX_REPORTED = 10


def is_int(v):
    """An integer that is not a bool (JSON/YAML `true` must not count as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    """A finite int or float that is not a bool."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (isinstance(v, int) or math.isfinite(v)))


def name_problem(value, where, what="name"):
    """None, or the one line saying why `value` is not a safe name."""
    if isinstance(value, str) and NAME_RE.match(value):
        return None
    return f"{where}: must be a non-empty {what} of {NAME_RULE}, got {value!r}"


def int_problem(value, where, lo, hi):
    """None, or the line saying `value` is not an integer in [lo, hi]."""
    if is_int(value) and lo <= value <= hi:
        return None
    kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
    if is_int(value) and value > hi:
        return (f"{where}: {_short(value)} is above the limit of {hi:,} (limits in "
                f"planner/limits.py)")
    return f"{where}: must be {kind}, got {_short(value)}"


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def document_problems(data, prefix=""):
    """One-line problems of a parsed document, independent of its schema (empty if none).

    Walks iteratively (no recursion) in document order; reports at most a few problems.
    """
    problems = []
    stack = [(data, prefix, 0)]
    while stack and len(problems) < _MAX_REPORTED:
        value, path, depth = stack.pop()
        where = path or "document"
        if depth > MAX_NESTING:
            problems.append(f"{where}: nested more than {MAX_NESTING} levels deep")
        elif isinstance(value, dict):
            children = []
            for k, v in value.items():
                if not isinstance(k, str):
                    problems.append(f"{where}: key {_short(k)} must be a string")
                    continue
                if _CONTROL.search(k):
                    problems.append(f"{where}: key {_short(k)} contains a control character")
                    continue
                children.append((v, f"{path}.{k}" if path else k, depth + 1))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend(reversed([(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]))
        elif isinstance(value, float):
            if not math.isfinite(value):
                problems.append(f"{where}: {value!r} is not a finite number")
        elif isinstance(value, str):
            if _CONTROL.search(value):
                problems.append(f"{where}: {_short(value)} contains a control character")
        elif not (value is None or isinstance(value, (bool, int))):
            problems.append(f"{where}: a {type(value).__name__} value is not allowed here; "
                            f"write a string, number, true/false, list or mapping")
    return problems


def read_text(path, what, limit):
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
        raise SpecError(f"{path}: {what} is not UTF-8 text (byte {e.start} is "
                        f"0x{raw[e.start]:02x}); save it as UTF-8")
    if "\x00" in text:
        raise SpecError(f"{path}: {what} contains a NUL character at offset {text.index(chr(0))} "
                        f"(UTF-16?); save it as UTF-8")
    return text


def read_json(path, what):
    """Parse a JSON file within the limits; SpecError lines name the file."""
    text = read_text(path, what, MAX_JSON_FILE_BYTES)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except RecursionError:
        raise SpecError(f"{path}: not valid JSON: nested too deeply (at most {MAX_NESTING} "
                        f"levels)")
    except ValueError:      # an integer beyond Python's conversion limit
        raise SpecError(f"{path}: not valid JSON: an integer of more than "
                        f"{sys.get_int_max_str_digits()} digits")
    problems = document_problems(data)
    if problems:
        raise SpecError([f"{path}: {p}" for p in problems])
    return data


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases (each `*name` could copy a whole subtree: billion laughs),
    without timestamps (dates stay strings), with bounded nesting and number length."""

    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise ComposerError(None, None, "aliases (*name) are not allowed; write the value "
                                "out", self.peek_event().start_mark)
        if self.depth >= MAX_NESTING:     # before Python's recursion limit, which is slow here
            raise ComposerError(None, None, f"nested more than {MAX_NESTING} levels deep",
                                self.peek_event().start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_bounded_int(self, node):
        if len(node.value) > MAX_NUMBER_CHARS:
            raise ConstructorError(None, None, f"a number longer than {MAX_NUMBER_CHARS} digits",
                                   node.start_mark)
        return self.construct_yaml_int(node)

    def construct_bounded_float(self, node):
        if len(node.value) > MAX_NUMBER_CHARS:
            raise ConstructorError(None, None, f"a number longer than {MAX_NUMBER_CHARS} digits",
                                   node.start_mark)
        return self.construct_yaml_float(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_bounded_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_bounded_float)
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)


def _yaml_error_line(e):
    """One line for any PyYAML error: line number and the problem, without the code excerpt."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if isinstance(e, yaml.reader.ReaderError):
        return f"not valid YAML: {e.reason} (character {e.character!r} at offset {e.position})"
    where = f"line {mark.line + 1}: " if mark is not None else ""
    text = problem or str(e)
    return f"{where}not valid YAML: {' '.join(str(text).split())}"


def parse_yaml(text, source):
    """Parse YAML text with the strict loader; SpecError lines name `source`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: {_yaml_error_line(e)}")
    except RecursionError:
        raise SpecError(f"{source}: not valid YAML: nested too deeply (at most {MAX_NESTING} "
                        f"levels)")


def read_yaml(path, what):
    """Parse a YAML file within the limits; SpecError lines name the file."""
    data = parse_yaml(read_text(path, what, MAX_YAML_FILE_BYTES), path)
    problems = document_problems(data)
    if problems:
        raise SpecError([f"{path}: {p}" for p in problems])
    return data
