"""A .gguf file is converted once, and again when a file with other content takes its path, even one of the
same size and date (copied with its timestamp kept)."""

import os

import pytest

from machinery import gguf_convert

pytest.importorskip("gguf")


def test_a_replaced_gguf_at_the_same_path_is_converted_again(tmp_path, monkeypatch):
    converted = []

    def convert(path, folder, flag):
        converted.append(open(path, "rb").read())
        os.makedirs(folder)

    monkeypatch.setattr(gguf_convert, "NEEDED", ())  # the stub writes no model: nothing to check in its folder
    monkeypatch.setattr(gguf_convert, "safetensors_complete", lambda path: True)

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    path, cache = tmp_path / "model.gguf", str(tmp_path / "cache")
    path.write_bytes(b"GGUF" + b"a" * 4000)
    first = gguf_convert.gguf_folder(str(path), cache)
    assert gguf_convert.gguf_folder(str(path), cache) == first and len(converted) == 1  # once
    stat = os.stat(path)
    path.write_bytes(b"GGUF" + b"b" * 4000)  # another model, same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same date
    second = gguf_convert.gguf_folder(str(path), cache)
    assert second != first and converted == [b"GGUF" + b"a" * 4000, b"GGUF" + b"b" * 4000]
