"""weights/gguf_file.py: our own GGUF header reader, against gguf-py's GGUFReader on a small file
holding every kind of metadata value and tensors stored as numbers and as blocks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from slipstream.weights.gguf_file import GGML_BLOCK_SIZES, GGMLType, GGUFFile, StringArray, read_metadata  # noqa: E402


def _write(path: Path) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ messages }} ünï")
    w.add_array("llama.attention.head_count_kv", [2, 4])
    w.add_token_list(["<s>", "a", "b", "ab", "\"q\"", "é", "😀", "x y"])
    w.add_token_merges(["a b", "x y"])
    w.add_token_scores([0.0, -1.5, -2.0, 3.25, 0.0, 0.0, 0.0, 0.0])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_same_metadata_and_tensors_as_gguf_py(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    ref = gguf.GGUFReader(str(path))
    ours = GGUFFile(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():
        got = ours.metadata[key]
        if isinstance(value, list) and value and isinstance(value[0], float):
            assert got == pytest.approx(value), key
        else:
            assert got == value, key
    assert isinstance(ours.metadata["tokenizer.ggml.tokens"], StringArray)
    assert read_metadata(path)["tokenizer.ggml.merges"] == ["a b", "x y"]
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.tensor_type.name == b.tensor_type.name
        assert a.shape == tuple(int(d) for d in b.shape)
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert a.data.tobytes() == b.data.tobytes()


def test_string_array_reads_like_a_list() -> None:
    items = ["", "a", "é😀", "x y"]
    blob = b"".join(len(s.encode()).to_bytes(8, "little") + s.encode() for s in items)
    import array
    starts, off = array.array("q"), 0
    for s in items:
        starts.append(off)
        off += 8 + len(s.encode())
    arr = StringArray(blob, starts, "<")
    assert len(arr) == 4 and list(arr) == items and arr[2] == "é😀" and arr[-1] == "x y" and arr[1:3] == items[1:3]
    assert arr == items and arr != items[:3] and "x y" in arr


def test_block_sizes_are_ggml_s() -> None:
    for t in GGMLType:
        assert GGML_BLOCK_SIZES[t] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))], t.name


@pytest.mark.parametrize("damage", ["magic", "version"])
def test_a_foreign_header_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[0:4] = b"GGML"
    else:
        data[4:8] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        GGUFFile(path)
