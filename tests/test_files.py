"""stratagem.files: bounded typed reads and writes that never replace what stratagem did not write."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.files import (
    DIGEST,
    check_inside,
    check_owned,
    check_structure,
    is_ours,
    parse_yaml,
    read_json,
    read_text,
    sidecar,
    stamp,
    write_owned,
)


@pytest.mark.parametrize("name,text", [
    ("r.md", "# Pareto front\n"), ("r.html", "<!DOCTYPE html>\n<title>x</title>\n"), ("run.sh", "#!/bin/sh\necho\n"),
    ("c.yaml", "format: x\n"), ("r.json", '{\n "a": 1\n}\n'), ("e.json", "{}"), ("r.csv", "trial,plan_key\n1,a\n"),
])
def test_ours_only_while_unchanged(name: str, text: str, tmp_path: Path) -> None:
    """What write_owned writes is ours; one byte changed anywhere (or the digest line copied into another file)
    and it is not; a link to it never is."""
    f = tmp_path / name
    write_owned(f, text)
    assert is_ours(f)
    raw = f.read_bytes()
    if name == "run.sh":
        assert raw.startswith(b"#!/bin/sh\n# " + DIGEST.encode()), "the shebang stays first"
    if name.endswith(".json"):
        assert read_json(f, "x") == __import__("json").loads(text), "read_json drops the digest key"
    f.write_bytes(raw[:-1] + b"X")
    assert not is_ours(f), "an edited file is the user's"
    f.write_bytes(raw)
    copy = tmp_path / f"copy-{name}"
    copy.write_bytes(raw + b"\nmine\n")  # the digest line copied into a longer file
    assert not is_ours(copy)
    link = tmp_path / f"link-{name}"
    link.symlink_to(f)
    assert not is_ours(link), "a link is never ours, even to our file"


@pytest.mark.parametrize("text", [
    "# stratagem: my notes\n", "<title>stratagem notes</title>\n", "# stratagem export for my job\n",
    "trial,plan_key,label,fidelity,status\n", f"# {DIGEST}{'0' * 64}\nmine\n",
    f"# {DIGEST}{'a' * 64}\nmine\n",
])
def test_mentions_of_stratagem_are_not_ownership(text: str, tmp_path: Path) -> None:
    f = tmp_path / "notes.md"
    f.write_text(text)
    assert not is_ours(f)
    with pytest.raises(StratagemError, match=r"-o \(.*notes.md\): exists and was not written by stratagem.*--force"):
        write_owned(f, "x")
    assert f.read_text() == text


def test_csv_digest_lives_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "r.csv"
    write_owned(out, "a,b\n1,2\n")
    assert out.read_text() == "a,b\n1,2\n", "a CSV stays plain CSV"
    assert sidecar(out).read_text().startswith(DIGEST)
    write_owned(out, "a,b\n3,4\n")
    out.write_text("a,b\n5,6\n")
    with pytest.raises(StratagemError, match="--force"):
        write_owned(out, "x")
    other = tmp_path / "u.csv"
    sidecar(other).write_text("my file\n")
    with pytest.raises(StratagemError, match="remove it, or pass --force"):
        write_owned(other, "x")
    assert stamp("x", "sidecar") == "x"


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
    write_owned(out, "first\n")
    write_owned(out, "second\n")
    assert out.read_text().endswith("second\n")
    user = tmp_path / "u.md"
    user.write_text("mine")
    with pytest.raises(StratagemError, match="was not written by stratagem"):
        write_owned(user, "x")
    write_owned(user, "x", force=True)
    assert user.read_text().endswith("\nx") and is_ours(user)
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
