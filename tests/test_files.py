"""stratagem.files: bounded typed reads and writes that never replace what stratagem did not write."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.files import (
    MARKERS,
    check_inside,
    check_owned,
    check_structure,
    is_ours,
    parse_yaml,
    read_json,
    read_text,
    write_owned,
)


def test_every_marker_makes_a_file_ours_and_nothing_else_does(tmp_path: Path) -> None:
    for i, marker in enumerate(MARKERS):
        f = tmp_path / f"{i}.txt"
        f.write_text(f"x\n{marker} y\n")
        assert is_ours(f), marker
    plain = tmp_path / "notes.md"
    plain.write_text("# my notes about stratagem\n")
    assert not is_ours(plain)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "0.txt")
    assert not is_ours(link), "a link is never ours, even to our file"
    late = tmp_path / "late.txt"
    late.write_text("a" * (70 << 10) + MARKERS[0])
    assert not is_ours(late), "the marker must be near the start"


def test_self_referencing_yaml_and_deep_data_end_in_one_line() -> None:
    with pytest.raises(StratagemError, match="nested more than 64 levels"):
        parse_yaml("a: &a [*a]\n", "scenario (x)")
    deep: list = []
    node = deep
    for _ in range(100):
        node.append([])
        node = node[0]
    with pytest.raises(StratagemError, match="nested more than"):
        check_structure(deep, "x")
    check_structure({"a": [1, 2, {"b": 3}]}, "x")


def test_reads_refuse_what_is_not_a_small_text_file(tmp_path: Path) -> None:
    with pytest.raises(StratagemError, match=r"x \(/dev/null\): is a character device"):
        read_text("/dev/null", "x")
    big = tmp_path / "big.json"
    big.write_text("[" + "1," * 100 + "1]")
    with pytest.raises(StratagemError, match="over the 100 bytes"):
        read_json(big, "x", max_bytes=100)
    assert read_json(big, "x")[:2] == [1, 1]
    with pytest.raises(StratagemError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        read_json(tmp_path / "bad.json", "x")


def test_write_owned_replaces_only_its_own_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    write_owned(out, f"{MARKERS[5]}\nfirst\n")
    write_owned(out, f"{MARKERS[5]}\nsecond\n")
    assert out.read_text().endswith("second\n")
    user = tmp_path / "u.md"
    user.write_text("mine")
    with pytest.raises(StratagemError, match="was not written by stratagem"):
        write_owned(user, "x")
    write_owned(user, "x", force=True)
    assert user.read_text() == "x"
    with pytest.raises(StratagemError, match="is a directory"):
        check_owned(tmp_path)
    before = sorted(os.listdir(tmp_path))
    sub = tmp_path / "sub"
    sub.mkdir()
    root = os.geteuid() == 0  # root writes into a 0500 directory; an immutable one stops it
    subprocess.run(["chattr", "+i", str(sub)] if root else ["chmod", "500", str(sub)], check=True)
    try:
        with pytest.raises(StratagemError, match="cannot write in"):
            write_owned(sub / "a.md", "x")
    finally:
        subprocess.run(["chattr", "-i", str(sub)] if root else ["chmod", "700", str(sub)], check=True)
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "sub"])


def test_check_inside_refuses_links_and_escapes(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "d").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(StratagemError, match="symbolic link"):
        check_inside(tmp_path / "out", "d/run.sh")
    with pytest.raises(StratagemError, match="not a path inside"):
        check_inside(tmp_path / "out", "../run.sh")
    assert check_inside(tmp_path / "out", "a/b.sh") == tmp_path / "out" / "a" / "b.sh"
