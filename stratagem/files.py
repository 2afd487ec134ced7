"""Files the tool reads and writes: bounded, typed reads; writes only to files it made itself.

Reads (`read_text`, `read_yaml`, `read_json`): a regular file only (a FIFO, a device such as /dev/zero, a
socket, a directory or a pipe such as /dev/stdin is refused without reading it), at most `max_bytes`, strict
UTF-8, nested at most MAX_DEPTH levels and at most MAX_NODES values once YAML aliases are expanded (an alias
bomb or a self-referencing document is refused). Every refusal is one `StratagemError` line naming the file.

Writes (`check_owned`, `write_owned`, `check_inside`): a file is replaced only when it does not exist, when
stratagem wrote it and it is unchanged since (`is_ours`: the sha256 digest stratagem keeps in the file's first
line, or second after a `#!` line, or in a `.NAME.stratagem` file beside a CSV, matches the whole file: a file
that merely mentions stratagem, or one the user edited, is not ours) or when the user passes --force. A symbolic link is never written through (with --force the link itself
is replaced); a path inside an output directory never goes through a link. A write goes to a temporary file
beside the target, renamed into place only when complete; a failure (disk full, `File too large`, read-only
directory) is one line and leaves the target and its directory as they were.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from stratagem.errors import StratagemError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "OWN_MAX_BYTES", "DIGEST", "JSON_DIGEST_KEY", "Style",
           "read_bytes", "read_text", "read_yaml", "read_json", "parse_yaml", "check_structure", "style_for", "stamp",
           "sidecar", "is_ours", "check_owned", "check_dir", "stamped", "write_owned", "check_inside",
           "disk_error"]

MAX_BYTES = 16 << 20
"""Largest file read by default: a scenario is kilobytes, a calibration file with its runs tens of kilobytes."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists accepted (a scenario nests 4 levels)."""
MAX_NODES = 1_000_000
"""Most values a document may hold once YAML aliases are expanded (what pydantic and hashing will walk)."""
OWN_MAX_BYTES = 256 << 20
"""Largest file read in full to prove it is stratagem's (an HTML report embedding plotly.js is a few MiB)."""
DIGEST = "stratagem-sha256:"
"""Prefix of the digest stratagem keeps in every file it writes: sha256 of the file with the 64 hex digits read
as zeros (or, in a `.NAME.stratagem` file beside a CSV, of the whole CSV)."""
JSON_DIGEST_KEY = "stratagem_digest"
"""The first key of a JSON object stratagem writes; `read_json` drops it."""
Style = Literal["hash", "html", "json", "sidecar"]
"""Where a file keeps its digest: a `# ` comment line (YAML, shell, TOML), a `<!-- -->` comment line (HTML,
Markdown), the first key of a JSON object, or a `.NAME.stratagem` file beside it (CSV and other formats without
comments)."""
_STYLES: dict[str, Style] = {".html": "html", ".htm": "html", ".md": "html", ".markdown": "html", ".json": "json",
                             ".yaml": "hash", ".yml": "hash", ".sh": "hash", ".toml": "hash", ".py": "hash"}
_ZERO = "0" * 64
_DIGEST_RE = re.compile(re.escape(DIGEST) + "([0-9a-f]{64})")

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n:,} bytes"


def disk_error(e: OSError) -> str:
    """An OSError as a few words: disk full, file too large (ulimit -f), read-only, permission, or strerror."""
    known = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "file too large (a size limit such as "
             "ulimit -f)", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
             errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}
    return known.get(e.errno or 0, e.strerror or str(e))


# ---- reads -----------------------------------------------------------------------------------------------------

def read_bytes(path: str | Path, what: str, max_bytes: int = MAX_BYTES, hint: str = "") -> bytes:
    """The bytes of a regular file of at most `max_bytes`; anything else is one line `what (path): ...`.
    Never blocks (a FIFO is refused before it is opened) and never reads more than max_bytes + 1."""
    p = Path(path)
    fix = f"; {hint}" if hint else ""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise StratagemError(f"{what} ({p}): file not found{fix}") from None
    except OSError as e:
        raise StratagemError(f"{what} ({p}): cannot read: {disk_error(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StratagemError(f"{what} ({p}): is {_kind(st.st_mode)}, not a regular file{fix}")
    if st.st_size > max_bytes:
        raise StratagemError(f"{what} ({p}): {st.st_size:,} bytes, over the {_size(max_bytes)} this file can be{fix}")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise StratagemError(f"{what} ({p}): cannot read: {disk_error(e)}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file opened is the one checked (no swap in between)
        if not stat.S_ISREG(st.st_mode):
            raise StratagemError(f"{what} ({p}): is {_kind(st.st_mode)}, not a regular file{fix}")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise StratagemError(f"{what} ({p}): cannot read: {disk_error(e)}") from None
    if len(data) > max_bytes:
        raise StratagemError(f"{what} ({p}): over the {_size(max_bytes)} this file can be{fix}")
    return data


def read_text(path: str | Path, what: str, max_bytes: int = MAX_BYTES, hint: str = "") -> str:
    """`read_bytes` decoded as strict UTF-8 (a binary file is one line, not a traceback)."""
    raw = read_bytes(path, what, max_bytes, hint)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StratagemError(f"{what} ({path}): not a text file (not UTF-8 at byte {e.start}){'; ' + hint if hint else ''}") \
            from None


def check_structure(data: Any, what: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Refuse a document nested deeper than max_depth or holding more than max_nodes values (aliases expanded:
    what a walk over it visits). Iterative: a self-referencing document ends at the depth limit."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > max_nodes:
            raise StratagemError(f"{what}: more than {max_nodes:,} values once YAML aliases (*name) are expanded; "
                                 "write the values out")
        if isinstance(node, dict | list | tuple):
            if depth > max_depth:
                raise StratagemError(f"{what}: nested more than {max_depth} levels deep; a stratagem file nests a "
                                     "few levels")
            children: Iterable[Any] = node.values() if isinstance(node, dict) else node
            if isinstance(node, dict):
                stack.extend((k, depth + 1) for k in node)
            stack.extend((c, depth + 1) for c in children)


def parse_yaml(text: str, what: str) -> Any:
    """YAML (safe loader) -> data, checked by `check_structure`; a syntax error names the line."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise StratagemError(f"{what}: not valid YAML{where}") from None
    except RecursionError:
        raise StratagemError(f"{what}: nested too deeply to read; a stratagem file nests a few levels") from None
    check_structure(data, what)
    return data


def read_yaml(path: str | Path, what: str, max_bytes: int = MAX_BYTES, hint: str = "") -> Any:
    """A bounded YAML file (`read_text` + `parse_yaml`); errors name `what (path)`."""
    return parse_yaml(read_text(path, what, max_bytes, hint), f"{what} ({path})")


def read_json(path: str | Path, what: str, max_bytes: int = MAX_BYTES, hint: str = "") -> Any:
    """A bounded JSON file (`read_text` + json + `check_structure`); errors name `what (path)`."""
    import json

    text = read_text(path, what, max_bytes, hint)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise StratagemError(f"{what} ({path}): not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise StratagemError(f"{what} ({path}): nested too deeply to read") from None
    check_structure(data, f"{what} ({path})")
    if isinstance(data, dict):
        data.pop(JSON_DIGEST_KEY, None)
    return data


# ---- writes ----------------------------------------------------------------------------------------------------

def style_for(path: str | Path) -> Style:
    """Where a file named `path` keeps its digest, from its suffix (`Style`); a sidecar when the format has no
    comments stratagem knows."""
    return _STYLES.get(Path(path).suffix.lower(), "sidecar")


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def stamp(text: str, style: Style) -> str:
    """`text` with its digest line: line 1 (line 2 after a `#!` line) for "hash" and "html", the first key of a
    JSON object for "json"; unchanged for "sidecar" (see `sidecar`). The digest is sha256 of the result with
    its 64 hex digits read as zeros (`is_ours` checks it against the whole file)."""
    if style == "sidecar":
        return text
    if style == "json":
        body = text.lstrip()
        if not body.startswith("{"):
            raise ValueError("a JSON file stratagem stamps is an object")
        rest = body[1:]
        sep = "" if rest.lstrip().startswith("}") else ","
        out = f'{{"{JSON_DIGEST_KEY}": "{DIGEST}{_ZERO}"{sep}{rest}'
    else:
        line = f"# {DIGEST}{_ZERO} (written by stratagem; edit it and stratagem will not replace it without --force)" \
            if style == "hash" else f"<!-- generator: stratagem, {DIGEST}{_ZERO} -->"
        if text.startswith("#!"):
            first, _, rest = text.partition("\n")
            out = f"{first}\n{line}\n{rest}"
        else:
            out = f"{line}\n{text}"
    return out.replace(DIGEST + _ZERO, DIGEST + _digest(out.encode("utf-8")), 1)


def sidecar(path: str | Path) -> Path:
    """The file beside `path` that holds its digest when its format has no comments (`Style` "sidecar")."""
    p = Path(path)
    return p.with_name(f".{p.name}.stratagem")


def _read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file (never through a link, never a FIFO or device) of at most `limit`, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        try:
            raw = f.read(limit + 1)
        except OSError:
            return None
    return raw if len(raw) <= limit else None


def _digest_line(raw: bytes) -> bytes:
    """The line that holds a stamped file's digest: the first, or the second after a `#!` line."""
    lines = raw.split(b"\n", 2)
    return lines[1] if raw.startswith(b"#!") and len(lines) > 1 else lines[0]


def is_ours(path: str | Path) -> bool:
    """Whether `path` is a regular file (not a link) that stratagem wrote and nobody changed since: the digest in
    its digest line (`stamp`) or in its sidecar matches the whole file. A file that only mentions stratagem, an
    edited copy of stratagem's output or a file over OWN_MAX_BYTES is not ours."""
    p = Path(path)
    raw = _read_regular(p, OWN_MAX_BYTES)
    if raw is None:
        return False
    found: list[str] = _DIGEST_RE.findall(_digest_line(raw).decode("utf-8", errors="replace"))
    if len(found) == 1:
        zeroed = raw.replace((DIGEST + found[0]).encode(), (DIGEST + _ZERO).encode(), 1)
        return _digest(zeroed) == found[0]
    side = _read_regular(sidecar(p), 4096)
    if side is None:
        return False
    found = _DIGEST_RE.findall(side.decode("utf-8", errors="replace"))
    return len(found) == 1 and _digest(raw) == found[0]


def check_dir(directory: str | Path, path: str | Path, option: str) -> None:
    """`directory` exists and a file can be created in it (tried: a read-only or immutable directory, or one
    on a read-only file system, is found now, not after the work)."""
    d = Path(directory)
    if not d.is_dir():
        raise StratagemError(f"{option} ({path}): directory {d} does not exist; create it or choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".stratagem-probe.", suffix=".tmp")
    except OSError as e:
        raise StratagemError(f"{option} ({path}): cannot write in {d}: {disk_error(e)}; choose another "
                             "path") from None
    os.close(fd)
    os.unlink(probe)


def check_owned(path: str | Path, force: bool = False, option: str = "-o", style: Style | None = None) -> Path:
    """`path` may be written: it does not exist, or is stratagem's unchanged output (`is_ours`), or `force`;
    never a directory, device or FIFO; a symbolic link only with `force` (the link is replaced, not its target);
    its directory exists and is writable; a digest sidecar in its way (`style` "sidecar", by default from the
    suffix) is stratagem's. Call it before the work that produces the file."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise StratagemError(f"{option} ({p}): cannot use: {disk_error(e)}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISLNK(st.st_mode) and p.is_dir()):
            raise StratagemError(f"{option} ({p}): is a directory; give a file name such as {p / 'out'}")
        if stat.S_ISLNK(st.st_mode):
            if not force:
                raise StratagemError(f"{option} ({p}): is a symbolic link; stratagem does not write through links: "
                                     "choose another path, or pass --force to replace the link (not its target)")
        elif not stat.S_ISREG(st.st_mode):
            raise StratagemError(f"{option} ({p}): is {_kind(st.st_mode)}; give the path of a file")
        elif not force and not is_ours(p):
            raise StratagemError(f"{option} ({p}): exists and was not written by stratagem, or was edited since "
                                 f"(no matching {DIGEST} digest); choose another path, or pass --force to replace it")
    if (style or style_for(p)) == "sidecar" and not force:
        side = sidecar(p)
        if os.path.lexists(side) and not _DIGEST_RE.fullmatch((_read_regular(side, 4096) or b"").decode(
                "utf-8", errors="replace").strip()):
            raise StratagemError(f"{option} ({p}): {side} (where stratagem keeps the digest of {p.name}) exists and "
                                 "was not written by stratagem; remove it, or pass --force to replace it")
    check_dir(parent, p, option)
    return p


def stamped(path: str | Path, text: str, style: Style | None = None) -> list[tuple[Path, bytes]]:
    """What writing `text` to `path` as stratagem's own puts on disk: (path, bytes) with the digest (`stamp`),
    preceded by its sidecar for a format without comments (written first, so an interrupted write leaves a
    digest that matches nothing: refused, never wrongly taken as ours)."""
    p = Path(path)
    kind = style or style_for(p)
    body = stamp(text, kind).encode("utf-8")
    if kind != "sidecar":
        return [(p, body)]
    return [(sidecar(p), f"{DIGEST}{_digest(body)}\n".encode()), (p, body)]


def check_inside(root: str | Path, rel: str, option: str = "-o") -> Path:
    """root/rel, refusing a `rel` that leaves root (`..`, absolute) or passes through a symbolic link below
    root (a link would take the write out of the directory given)."""
    base = Path(root)
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise StratagemError(f"{option} ({root}): {rel!r} is not a path inside it")
    cur = base
    for part in parts[:-1]:
        cur = cur / part
        if cur.is_symlink():
            raise StratagemError(f"{option} ({root}): {cur} is a symbolic link; stratagem does not write through "
                                 "links: remove it or choose another directory")
    return base.joinpath(*parts)


def write_owned(path: str | Path, text: str, force: bool = False, option: str = "-o", mode: int = 0o644,
                style: Style | None = None) -> Path:
    """Write `text` to `path` as stratagem's own (`stamped`: with its digest) after `check_owned`: through a
    temporary file in the same directory, renamed into place when complete; any OSError (disk full, quota, size
    limit) is one line, the temporary files removed and `path` unchanged."""
    p = check_owned(path, force, option, style)
    parent = p.parent if str(p.parent) else Path(".")
    staged: list[tuple[str, Path]] = []
    try:
        for dest, raw in stamped(p, text, style):
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{dest.name}.", suffix=".tmp")
            staged.append((tmp, dest))
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
        for tmp, dest in staged:
            os.replace(tmp, dest)
    except OSError as e:
        raise StratagemError(f"{option} ({p}): cannot write: {disk_error(e)}; nothing was changed") from None
    finally:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
    return p
