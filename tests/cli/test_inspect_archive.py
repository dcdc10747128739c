"""`shared-td inspect` and `verify` of an archive (one .tdz zip): the same tree and the
same checks as for the directory it was packed from, plus the stored checksums. Before,
both refused an archive ("unpack it first")."""
from __future__ import annotations

import zipfile

import pytest

from tests.cli.cli_helpers import problems_by_path, run_json, run_main, save_by

import shared_td
from shared_td.persist.archive import Archive


def _packed(writer: str, tmp_path, compression=None) -> tuple[str, str]:
    """(the directory saved by ``writer``, the archive ``writer`` packed it into)."""
    directory = save_by(writer, tmp_path / "saved")
    archive = str(tmp_path / "saved.tdz")
    if writer == "tensordict":
        import tensordict

        tensordict.pack_memmap(directory, archive)
    else:
        shared_td.pack_memmap(directory, archive, compression=compression)
    return directory, archive


def _without_prefix(document: dict) -> dict:
    return {key: value for key, value in document.items() if key != "prefix"}


@pytest.mark.parametrize("writer", ["shared_td", "tensordict"])
def test_inspect_of_an_archive_is_that_of_its_directory(tmp_path, writer):
    directory, archive = _packed(writer, tmp_path)
    code_dir, of_directory = run_json("inspect", directory)
    code_zip, of_archive = run_json("inspect", archive)
    assert code_dir == code_zip == 0
    assert _without_prefix(of_archive) == _without_prefix(of_directory)
    assert of_archive["prefix"] == archive


@pytest.mark.parametrize("compression", [None, "deflate"])
def test_verify_of_a_good_archive_is_ok(tmp_path, compression):
    directory, archive = _packed("shared_td", tmp_path, compression)
    code, out, _ = run_main("verify", archive)
    assert code == 0 and out.startswith(f"ok: {archive}:"), out
    assert out.split(":", 2)[2] == run_main("verify", directory)[1].split(":", 2)[2]


def test_verify_names_a_member_whose_data_do_not_match_its_checksum(tmp_path):
    _, archive = _packed("shared_td", tmp_path)
    opened = Archive(archive)
    offset = opened.members["obs.memmap"].offset
    opened.close()
    with open(archive, "r+b") as file:
        file.seek(offset + 5)
        byte = file.read(1)
        file.seek(offset + 5)
        file.write(bytes([byte[0] ^ 0xFF]))
    code, document = run_json("verify", archive)
    assert code == 1
    assert list(problems_by_path(document)) == ["obs.memmap"]
    assert "checksum" in problems_by_path(document)["obs.memmap"][0][1]


def test_verify_reports_a_missing_member_and_an_unknown_one(tmp_path):
    _, archive = _packed("shared_td", tmp_path)
    damaged = str(tmp_path / "damaged.tdz")
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(damaged, "w") as target:
        for info in source.infolist():
            if info.filename != "obs.memmap":
                target.writestr(info, source.read(info))
        target.writestr("junk.txt", b"left over")
    code, document = run_json("verify", damaged)
    problems = problems_by_path(document)
    assert code == 1
    assert problems["obs.memmap"][0][0] == "error" and "missing" in problems["obs.memmap"][0][1]
    assert problems["junk.txt"] == [("warning", "an unknown file: no meta.json names it")]


def test_a_truncated_or_refused_archive_is_a_clear_error(tmp_path, capsys):
    from shared_td.cli import main

    _, archive = _packed("shared_td", tmp_path)
    data = open(archive, "rb").read()
    cut = tmp_path / "cut.tdz"
    cut.write_bytes(data[: len(data) // 2])
    for command in ("inspect", "verify"):
        assert main([command, str(cut)]) == 1
        assert f"{cut}: not a complete zip archive" in capsys.readouterr().err
    escaping = tmp_path / "escaping.tdz"
    with zipfile.ZipFile(escaping, "w") as target:
        target.writestr("meta.json", open(tmp_path / "saved" / "meta.json", "rb").read())
        target.writestr("../evil.memmap", b"x")
    assert main(["verify", str(escaping)]) == 1
    assert "'../evil.memmap': refused" in capsys.readouterr().err


def test_a_file_that_is_no_archive_is_refused_as_before(tmp_path, capsys):
    from shared_td.cli import main

    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert main(["verify", str(other)]) == 1
    assert "neither a saved tensordict directory nor an archive" in capsys.readouterr().err
