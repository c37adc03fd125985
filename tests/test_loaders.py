"""Dataset loaders on fixture files written here and on the real Beauty and MovieLens files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from recspec.data import load_dataset
from recspec.data.loaders import detect_format
from recspec.errors import RecspecError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def recbole_dir(tmp_path: Path) -> Path:
    d = tmp_path / "mini"
    write(d / "mini.inter", "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
          "1\t10\t4\t100\n1\t20\t3\t200\n2\t10\t5\t150\n2\t30\t1\t300\n")
    write(d / "mini.item", "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
          "10\tToy Story\t1995\tAnimation Comedy\n20\tHeat\t1995\tAction\n30\tAlien\t1979\tHorror Sci-Fi\n")
    write(d / "mini.user", "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
          "1\t24\tM\ttechnician\t1\n2\t53\tF\tother\t2\n")
    return d


def test_recbole_atomic(recbole_dir: Path) -> None:
    d = load_dataset(recbole_dir)
    assert d.source_format == "recbole"
    assert (d.num_users, d.num_items, len(d.interactions)) == (2, 3, 4)
    assert d.item_ids == ["10", "20", "30"]
    assert d.item_info.text(2) == "Alien (1979); genres: Horror, Sci-Fi"
    assert d.user_info.occupations == ["technician", "other"]
    assert d.user_info.ages == [24, 53]
    np.testing.assert_array_equal(d.interactions.ratings, [4, 3, 5, 1])
    np.testing.assert_array_equal(d.interactions.timestamps, [100, 200, 150, 300])


def test_unknown_user_ids(recbole_dir: Path) -> None:
    d = load_dataset(recbole_dir)
    np.testing.assert_array_equal(d.user_positions(["2", "1"]), [1, 0])
    with pytest.raises(RecspecError, match="unknown user id"):
        d.user_positions(["1", "99"])


def test_grouplens(tmp_path: Path) -> None:
    d = tmp_path / "ml-100k"
    write(d / "u.data", "1\t1\t5\t874965758\n1\t2\t3\t876893171\n2\t1\t4\t888550871\n")
    flags = ["0"] * 19
    flags[3] = flags[4] = "1"
    write(d / "u.item", f"1|Toy Story (1995)|01-Jan-1995||http://x|{'|'.join(flags)}\n"
          f"2|GoldenEye (1995)|01-Jan-1995||http://x|{'|'.join(['0'] * 19)}\n")
    write(d / "u.user", "1|24|M|technician|85711\n2|53|F|other|94043\n")
    ds = load_dataset(d)
    assert ds.source_format == "grouplens"
    assert ds.item_info.titles == ["Toy Story", "GoldenEye"]
    assert ds.item_info.years == ["1995", "1995"]
    assert ds.item_info.genres[0] == ["Animation", "Children's"]
    assert ds.user_info.genders == ["M", "F"]


def test_atspeed_format(tmp_path: Path) -> None:
    d = tmp_path / "beauty"
    write(d / "sequential_train.txt", "1 1 2\n2 3\n3\n")
    write(d / "sequential_valid.txt", "1 3\n2\n3\n")
    write(d / "sequential_test.txt", "1 2\n2 1 2\n3\n")
    write(d / "item_index.json", json.dumps({str(i): [f"<a_{i}>", "<b_0>"] for i in range(4)}))
    ds = load_dataset(d)
    assert ds.source_format == "atspeed"
    assert ds.item_ids == ["0", "1", "2", "3"]  # item 4 of the index has no interaction but is an item
    assert ds.num_users == 3 - 1  # user 3 has no interaction at all
    np.testing.assert_array_equal(ds.given_split, [0, 0, 0, 1, 2, 2, 2])
    np.testing.assert_array_equal(ds.interactions.items, [0, 1, 2, 2, 1, 0, 1])


def test_amazon_json_plain_and_gzip(tmp_path: Path) -> None:
    rows = [{"reviewerID": "A", "asin": "X", "overall": 5.0, "unixReviewTime": 10},
            {"reviewerID": "B", "asin": "X", "overall": 2.0, "unixReviewTime": 5},
            {"reviewerID": "A", "asin": "Y", "overall": 4.0, "unixReviewTime": 20}]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    plain = write(tmp_path / "Beauty.json", text)
    packed = tmp_path / "Beauty.json.gz"
    with gzip.open(packed, "wt") as handle:
        handle.write(text)
    for path in (plain, packed):
        ds = load_dataset(path)
        assert ds.source_format == "amazon-json"
        assert ds.user_ids == ["A", "B"] and ds.item_ids == ["X", "Y"]
        np.testing.assert_array_equal(ds.interactions.ratings, [5, 2, 4])


def test_amazon_json_folder_with_meta(tmp_path: Path) -> None:
    write(tmp_path / "d" / "reviews.json", json.dumps({"reviewerID": "A", "asin": "X", "unixReviewTime": 1}) + "\n")
    write(tmp_path / "d" / "meta_Beauty.json", json.dumps({"asin": "X", "title": "Soap", "categories": [["Beauty", "Bath"]]}) + "\n")
    ds = load_dataset(tmp_path / "d")
    assert ds.item_info.titles == ["Soap"]
    assert ds.item_info.genres == [["Beauty", "Bath"]]


def test_csv(tmp_path: Path) -> None:
    write(tmp_path / "d" / "interactions.csv", "user,item,timestamp,rating\nu1,i1,3,5\nu1,i2,4,1\nu2,i1,5,3\n")
    write(tmp_path / "d" / "items.csv", "item,title,year,genres\ni1,Heat,1995,Action|Crime\ni2,Up,2009,\n")
    ds = load_dataset(tmp_path / "d")
    assert ds.source_format == "csv"
    assert ds.item_info.text(0) == "Heat (1995); genres: Action, Crime"
    single = load_dataset(write(tmp_path / "x.csv", "user,item,timestamp\n1,2,3\n"))
    assert single.interactions.ratings is None


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.csv", "user,item\n1,2\n", "bad.csv:1: missing column(s) timestamp"),
        ("bad2.csv", "user,item,timestamp\n1,2,soon\n", "bad2.csv:2: 'soon' is not a valid number"),
        ("bad.json", '{"reviewerID": "A", "asin": "X", "unixReviewTime": 1}\n{"asin": "Y"\n', "bad.json:2: malformed JSON"),
        ("bad2.json", '{"reviewerID": "A", "unixReviewTime": 1}\n', "bad2.json:1: missing field(s) asin"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    with pytest.raises(RecspecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_dataset(write(tmp_path / name, content))


def test_malformed_tab_file(recbole_dir: Path) -> None:
    with open(recbole_dir / "mini.inter", "a") as handle:
        handle.write("3\t10\n")
    with pytest.raises(RecspecError, match=r"mini.inter:6: expected 4 fields"):
        load_dataset(recbole_dir)


def test_unknown_dataset_and_format(tmp_path: Path) -> None:
    with pytest.raises(RecspecError, match="not a known name"):
        load_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecspecError, match="no supported dataset files"):
        load_dataset(tmp_path / "empty")
    with pytest.raises(RecspecError, match="unknown dataset format"):
        load_dataset(tmp_path / "empty", format="parquet")


def test_atspeed_missing_file_and_bad_item(tmp_path: Path) -> None:
    write(tmp_path / "b" / "sequential_train.txt", "1 1\n")
    write(tmp_path / "b" / "sequential_valid.txt", "1\n")
    with pytest.raises(RecspecError, match="sequential_test.txt: file not found"):
        load_dataset(tmp_path / "b", format="atspeed")
    write(tmp_path / "b" / "sequential_test.txt", "1 0\n")
    with pytest.raises(RecspecError, match=r"sequential_test.txt:1: item 0 is not a 1-based"):
        load_dataset(tmp_path / "b")


def test_kcore(recbole_dir: Path) -> None:
    with open(recbole_dir / "mini.inter", "a") as handle:
        handle.write("2\t20\t2\t400\n")
    ds = load_dataset(recbole_dir, min_interactions=2)
    # item 30 has one interaction and goes; then every user and item left has two
    assert ds.item_ids == ["10", "20"] and ds.user_ids == ["1", "2"]
    assert len(ds.interactions) == 4
    assert ds.item_info.titles == ["Toy Story", "Heat"]
    with pytest.raises(RecspecError, match="nothing is left"):
        load_dataset(recbole_dir, min_interactions=3)


def test_detect_format(recbole_dir: Path, tmp_path: Path) -> None:
    assert detect_format(recbole_dir) == "recbole"
    with pytest.raises(RecspecError, match="pass --format"):
        detect_format(write(tmp_path / "data.parquet", ""))


def test_real_beauty_matches_paper_table3(beauty) -> None:
    # atspeed.txt Table 3: 19,383 users, 12,035 items, 138,870 interactions, density 0.06%
    assert (beauty.num_users, beauty.num_items, len(beauty.interactions)) == (19383, 12035, 138870)
    assert round(beauty.density * 100, 2) == 0.06
    assert beauty.item_index_path is not None


def test_real_movielens(ml100k) -> None:
    assert (ml100k.num_users, ml100k.num_items, len(ml100k.interactions)) == (943, 1682, 100000)
    assert ml100k.item_info.text(0) == "Toy Story (1995); genres: Animation, Children's, Comedy"
    assert set(np.unique(ml100k.interactions.ratings)) == {1, 2, 3, 4, 5}
    assert len(ml100k.user_info.occupations) == 943


# one interaction file per format: (file name, header, row template with {user} {item} {time})
_FORMATS = {
    "recbole": ("mini/mini.inter", "user_id:token\titem_id:token\ttimestamp:float\n", "{user}\t{item}\t{time}\n"),
    "grouplens": ("ml/u.data", "", "{user}\t{item}\t4\t{time}\n"),
    "csv": ("data/interactions.csv", "user,item,timestamp\n", "{user},{item},{time}\n"),
    "amazon-json": ("reviews.json", "",
                    '{{"reviewerID": "{user}", "asin": "{item}", "overall": 4, "unixReviewTime": "{time}"}}\n'),
}


def _bad_file(tmp_path: Path, kind: str, user: str = "u1", item: str = "i1", time: str = "300") -> Path:
    name, header, row = _FORMATS[kind]
    good = [row.format(user="u1", item="i2", time="100"), row.format(user="u2", item="i1", time="200")]
    path = write(tmp_path / name, header + "".join(good) + row.format(user=user, item=item, time=time))
    return path.parent if kind in ("recbole", "grouplens") else path


@pytest.mark.parametrize("kind", sorted(_FORMATS))
@pytest.mark.parametrize("time", ["nan", "inf", "-inf", "1e300"])
def test_non_finite_timestamps_are_refused_with_file_and_line(tmp_path: Path, kind: str, time: str) -> None:
    path = _bad_file(tmp_path, kind, time=time)
    line = 3 if kind in ("grouplens", "amazon-json") else 4
    with pytest.raises(RecspecError, match=rf":{line}: .*{time}.*(not a finite number|out of range)"):
        load_dataset(path)


@pytest.mark.parametrize("kind", sorted(_FORMATS))
@pytest.mark.parametrize("field", ["user", "item"])
def test_empty_ids_are_refused_with_file_and_line(tmp_path: Path, kind: str, field: str) -> None:
    path = _bad_file(tmp_path, kind, **{field: " " if kind == "amazon-json" else ""})
    line = 3 if kind in ("grouplens", "amazon-json") else 4
    with pytest.raises(RecspecError, match=rf":{line}: empty {field} id"):
        load_dataset(path)


def test_valid_files_of_every_format_still_load(tmp_path: Path) -> None:
    for kind in _FORMATS:
        data = load_dataset(_bad_file(tmp_path / kind, kind, time="-5"))  # a time before 1970 is fine
        assert (data.num_users, data.num_items, len(data.interactions)) == (2, 2, 3)


def test_empty_item_id_in_an_item_file_is_refused(recbole_dir: Path) -> None:
    path = recbole_dir / "mini.item"
    path.write_text(path.read_text() + "\tNameless\t2000\tDrama\n")
    with pytest.raises(RecspecError, match=r"mini.item:5: empty item id"):
        load_dataset(recbole_dir)


def test_cli_refuses_a_nan_timestamp_in_one_line(tmp_path: Path) -> None:
    from tests.test_cli import recspec

    result = recspec("data", "show", str(_bad_file(tmp_path, "csv", time="nan")))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'data' / 'interactions.csv'}:4: 'nan' is not "
                                                  f"a finite number"]
