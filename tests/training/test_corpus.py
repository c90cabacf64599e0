"""The shipped model's corpus (training.corpus) over a small tree: two fake packages (one with
relative and absolute imports and a cycle, one vendoring held-out modules) beside real stdlib
files. The scan filters and deduplicates; documents follow import order; held-out modules stay
out of training in every copy; the tokenizer round-trips and reads the same through
``tokenizers``, transformers and dhisparse, chat template included; the token files match
their JSON; a second build skips its stages."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from dhisparse.tokenizer import chat_formatter, load_tokenizer
from training.corpus import documents as documents_module
from training.corpus.__main__ import main
from training.corpus.bpe import SPECIAL_TOKENS, corpus_encoder, eos_id, token_byte_lengths
from training.corpus.build import build
from training.corpus.chunks import cut
from training.corpus.documents import Document, document_text, split_documents
from training.corpus.import_order import import_order, imported_names
from training.corpus.sources import find_sources, scan_root
from training.corpus.token_map import corpus_counts, ranked, source_counts
from training.corpus.token_map import main as token_map_main
from training.corpus.tokens import load_tokens, sha256_file

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELDOUT = ("graphlib", "shlex", "textwrap")
COPIED = ("textwrap.py", "graphlib.py", "shlex.py", "colorsys.py", "fnmatch.py", "json")
VOCAB = 512
ALPHA = {
    "alpha/__init__.py": "from .core import run\nfrom alpha import util\n",
    "alpha/core.py": "from . import util\nimport alpha.helpers\n\n\ndef run():\n    return util.thing()\n",
    "alpha/util.py": "from .core import run\n\n\ndef thing():\n    return run\n",
    "alpha/helpers.py": "import os\n\nHELP = os.sep\n",
    "alpha/sub/__init__.py": '"""The sub-package."""\n',
    "alpha/sub/leaf.py": "from ..helpers import HELP\nfrom . import other\n",
    "alpha/broken.py": "def broken(:\n",
}
ALPHA_ORDER = [
    "alpha/broken.py",
    "alpha/helpers.py",
    "alpha/core.py",  # the core <-> util cycle, broken in path order
    "alpha/util.py",
    "alpha/__init__.py",
    "alpha/sub/__init__.py",
    "alpha/sub/leaf.py",
]


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a stdlib-like root, a site-packages-like root)."""
    base = tmp_path_factory.mktemp("tree")
    lib, site = base / "lib", base / "site"
    for name in COPIED:
        if (STDLIB / name).is_dir():
            shutil.copytree(STDLIB / name, lib / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            _write(lib / name, (STDLIB / name).read_bytes())
    _write(lib / "test/test_textwrap.py", "import textwrap\n\nprint(textwrap.dedent('  x'))\n")
    _write(
        lib / "test/test_colorsys.py", "import colorsys\n\nprint(colorsys.rgb_to_hsv(1, 0, 0))\n"
    )
    _write(lib / "encodings/fake_codec.py", "TABLE = '\\x00\\x01'\n")
    _write(lib / "__pycache__/cached.py", "x = 1\n")
    _write(lib / "site-packages/inner.py", "x = 2\n")
    _write(lib / "lib2to3/tests/data/py2.py", "print 'x'\n")
    _write(lib / "latin1.py", b"# caf\xe9\n")
    _write(lib / "nul.py", b"x = 1\0\n")
    _write(lib / "huge.py", "#" * ((1 << 20) + 1) + "\n")
    for path, text in ALPHA.items():
        _write(site / path, text)
    textwrap_src = (STDLIB / "textwrap.py").read_text(encoding="utf-8")
    shlex_src = (STDLIB / "shlex.py").read_text(encoding="utf-8")
    _write(site / "beta/__init__.py", "from beta import main\n")
    _write(site / "beta/main.py", "from beta._vendor import tw\n\nWRAP = tw.wrap\n")
    _write(site / "beta/_vendor/__init__.py", "# vendored copies\n")
    _write(site / "beta/_vendor/tw.py", textwrap_src)  # a held-out file under another name
    _write(site / "beta/_vendor/shlex.py", shlex_src + "\n# patched\n")  # a namesake
    _write(site / "graphlib_backport/__init__.py", "# a backport of graphlib\nX = 1\n")  # alias
    _write(site / "beta/copy_of_helpers.py", ALPHA["alpha/helpers.py"])
    _write(site / "gamma.py", "import alpha\n\nalpha.run()\n")
    _write(site / "pkg-1.0.dist-info/x.py", "x = 3\n")
    return lib, site


def test_sources_are_filtered_and_deduplicated_in_root_then_path_order(tree) -> None:
    lib, site = tree
    scan = find_sources([lib, site])
    assert scan == find_sources([lib, site])
    assert scan.excluded == {"duplicate": 2, "not_utf8": 1, "nul": 1, "too_large": 1}
    got = [(Path(f.root).name, f.path) for f in scan.files]
    assert got == sorted(got, key=lambda rp: (rp[0] != "lib", rp[1]))
    lib_paths = {p for r, p in got if r == "lib"}
    site_paths = {p for r, p in got if r == "site"}
    assert {"textwrap.py", "json/decoder.py", "test/test_textwrap.py"} <= lib_paths
    assert not any(
        p.startswith(("encodings/", "__pycache__/", "site-packages/", "lib2to3/"))
        for p in lib_paths
    )
    # The first copy wins: textwrap.py over beta/_vendor/tw.py, alpha over beta's copy.
    assert "beta/_vendor/tw.py" not in site_paths and "beta/copy_of_helpers.py" not in site_paths
    assert {"alpha/helpers.py", "beta/_vendor/shlex.py", "gamma.py"} <= site_paths
    assert not any("dist-info" in p for p in site_paths)
    by_path = {f.path: f for f in scan.files}
    assert by_path["json/decoder.py"].package == "json" and by_path["gamma.py"].package == "gamma"
    data = (lib / "json/decoder.py").read_bytes()
    assert by_path["json/decoder.py"].sha256 == hashlib.sha256(data).hexdigest()
    assert by_path["json/decoder.py"].size == len(data)
    with pytest.raises(ValueError, match="given twice"):
        find_sources([lib, lib])


def test_a_module_comes_after_what_it_imports() -> None:
    assert import_order(ALPHA) == ALPHA_ORDER
    assert import_order(dict(reversed(ALPHA.items()))) == ALPHA_ORDER
    # In a cycle through a package's __init__, the __init__ goes last.
    cycle = {"p/__init__.py": "from .a import x\n", "p/a.py": "from p import y\nx = y = 1\n"}
    assert import_order(cycle) == ["p/a.py", "p/__init__.py"]
    assert imported_names("p/sub/leaf.py", "from ...x import y\nfrom .. import z\n") == {"p.z"}
    assert imported_names("p/m.py", "from .q import *\nimport os.path\n") == {"p.q", "os.path"}
    assert imported_names("p/m.py", "def (:\n") == frozenset()


def test_the_real_json_package_is_in_import_order(tree) -> None:
    lib, _ = tree
    sources = {
        p.relative_to(lib).as_posix(): p.read_text() for p in sorted((lib / "json").glob("*.py"))
    }
    order = import_order(sources)
    assert sorted(order) == sorted(sources)
    at = {p: i for i, p in enumerate(order)}
    assert at["json/scanner.py"] < at["json/decoder.py"] < at["json/__init__.py"]
    assert at["json/encoder.py"] < at["json/__init__.py"] < at["json/tool.py"]


def test_held_out_modules_stay_out_of_training_in_every_copy(tree, monkeypatch) -> None:
    lib, site = tree
    # Vendored copies first and not deduplicated: the split's own rules must catch them.
    files = scan_root(site).files + scan_root(lib).files
    split = split_documents(files, HELDOUT)
    assert [d.name for d in split.heldout] == ["graphlib.py", "shlex.py", "textwrap.py"]
    source = (lib / "textwrap.py").read_text(encoding="utf-8")
    assert split.heldout[2] == Document("textwrap.py", ("textwrap.py",), f"# textwrap.py\n{source}")
    trained = {f for d in split.train for f in d.files}
    assert "beta/_vendor/tw.py" not in trained  # same content as a held-out file
    assert "beta/_vendor/shlex.py" not in trained  # named like a held-out module
    assert "graphlib_backport/__init__.py" not in trained  # a held-out module's alias
    assert "test/test_textwrap.py" not in trained  # the stdlib's test of one
    assert {"test/test_colorsys.py", "beta/main.py", "json/decoder.py"} <= trained
    docs = {d.name: d for d in split.train}
    assert [d.name for d in split.train] == [
        "alpha",
        "beta",
        "gamma",
        "colorsys",
        "fnmatch",
        "json",
        "test",
    ]
    assert docs["alpha"].files == tuple(ALPHA_ORDER)
    assert docs["alpha"].text == document_text([(p, ALPHA[p]) for p in ALPHA_ORDER])
    assert docs["alpha"].text.startswith("# alpha/broken.py\ndef broken(:\n\n# alpha/helpers.py\n")
    monkeypatch.setattr(documents_module, "PARSE_CHUNK", 2)  # several worker processes
    assert split_documents(files, HELDOUT, workers=2) == split
    with pytest.raises(ValueError, match=r"\['tomllib'\] are not among the source files"):
        split_documents(files, (*HELDOUT, "tomllib"))


def test_cut_pieces_tokenize_as_the_whole(built) -> None:
    lib, _ = built["tree"]
    text = (lib / "json/decoder.py").read_text() + "a\n\n  b\n\tc\r\nd\ne  \nf\n<|endoftext|>\nz"
    pieces = cut(text, 64)
    assert "".join(pieces) == text and len(pieces) > 50
    tok = corpus_encoder(built["out"] / "tokenizer")
    whole = tok.encode(text).ids
    assert [i for p in pieces for i in tok.encode(p).ids] == whole
    assert [i for e in tok.encode_batch_fast(pieces) for i in e.ids] == whole
    rng = random.Random(0)
    alphabet = [
        " ",
        "\n",
        "\t",
        "\r",
        "\x0c",
        "\u00a0",
        "\u2028",
        "a",
        "1",
        ".",
        "'",
        "s",
        "é",
        "中",
    ]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        pieces = cut(text, rng.randint(1, 6))
        assert [i for p in pieces for i in tok.encode(p).ids] == tok.encode(text).ids, text


@pytest.fixture(scope="module")
def built(tree, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("corpus") / "out"
    summary = build(out, list(tree), vocab_size=VOCAB, heldout=HELDOUT, workers=1)
    return {"out": out, "summary": summary, "tree": tree}


def test_the_build_writes_a_tokenizer_directory_and_token_files(built) -> None:
    out, summary = built["out"], built["summary"]
    assert summary["stages"] == {"sources": "scanned", "tokenizer": "built", "tokens": "built"}
    assert summary["vocab_size"] == VOCAB and summary["heldout"]["documents"] == 3
    tokdir = out / "tokenizer"
    assert sorted(p.name for p in tokdir.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.loads((tokdir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>"
    assert [t["content"] for t in cfg["added_tokens_decoder"].values()] == list(SPECIAL_TOKENS)
    assert eos_id(tokdir) == VOCAB - len(SPECIAL_TOKENS)  # specials take the last ids


def test_held_out_documents_round_trip_and_every_reader_gives_the_same_ids(built) -> None:
    out = built["out"]
    lib, _ = built["tree"]
    tokdir = out / "tokenizer"
    corpus = load_tokens(out)
    docs = json.loads((out / "documents.json").read_text())["heldout"]
    reference = AutoTokenizer.from_pretrained(str(tokdir))
    ours = load_tokenizer(tokdir)
    encoder = corpus_encoder(tokdir)
    for doc in docs:
        (path,) = doc["files"]
        text = document_text([(path, (lib / path).read_text(encoding="utf-8"))])
        ids = corpus.heldout[doc["start"] : doc["start"] + doc["tokens"]].tolist()
        assert ids[-1] == corpus.meta["eos_id"]
        ids = ids[:-1]
        assert encoder.encode(text).ids == ids
        assert encoder.decode(ids) == text and ours.decode(ids) == text
        assert reference.encode(text, add_special_tokens=False) == ids
        assert ours.encode(text) == ids
    # Prompts parse special tokens in every reader; corpus text keeps them as text.
    prompt = "<|user|>\nhi<|endoftext|>"
    assert ours.encode(prompt) == reference.encode(prompt, add_special_tokens=False)
    assert ours.encode(prompt)[0] == ours.encode("<|user|>")[0] >= VOCAB - len(SPECIAL_TOKENS)
    literal = encoder.encode(prompt).ids
    assert max(literal) < VOCAB - len(SPECIAL_TOKENS) and encoder.decode(literal) == prompt


CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b\n"},
        {"role": "user", "content": "Und auf Deutsch? 中文"},
    ],
    [{"role": "user", "content": "run it"}, {"role": "tool", "content": '{"ok": true}'}],
]


def test_the_chat_template_renders_as_transformers_renders_it(built) -> None:
    tokdir = built["out"] / "tokenizer"
    reference = AutoTokenizer.from_pretrained(str(tokdir))
    fmt = chat_formatter(load_tokenizer(tokdir), tokdir)
    for messages in CHATS:
        for gen in (True, False):
            text = reference.apply_chat_template(
                copy.deepcopy(messages), tokenize=False, add_generation_prompt=gen
            )
            assert fmt.render(messages, add_generation_prompt=gen) == text
            ids = reference.apply_chat_template(
                copy.deepcopy(messages), tokenize=True, add_generation_prompt=gen
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert fmt.encode(messages, add_generation_prompt=gen) == list(ids)
    # GLM-4.7's template (GLM-5's family), thinking only when asked: the generation prompt
    # closes the reasoning block unless enable_thinking opens it.
    assert fmt.render(CHATS[0]) == "[gMASK]<sop><|user|>Hello!<|assistant|></think>"
    thinking = fmt.render(CHATS[0], enable_thinking=True)
    assert thinking == "[gMASK]<sop><|user|>Hello!<|assistant|><think>"
    assert fmt.render(CHATS[2], add_generation_prompt=False).endswith(
        '<|observation|><tool_response>{"ok": true}</tool_response>'
    )


def test_token_byte_lengths_sum_to_the_utf8_bytes(built) -> None:
    out = built["out"]
    tokdir = out / "tokenizer"
    lengths = token_byte_lengths(tokdir)
    assert lengths.shape == (VOCAB,) and lengths.dtype == np.int64
    eos = eos_id(tokdir)
    assert lengths[eos] == 1 and (lengths[eos + 1 :] == 0).all() and (lengths[:eos] >= 1).all()
    text = "def café(x):\n    return '中文' * x  # ok\n"
    ids = corpus_encoder(tokdir).encode(text).ids
    assert lengths[ids].sum() == len(text.encode("utf-8"))
    corpus = load_tokens(out)
    for name, tokens in (("train", corpus.train), ("heldout", corpus.heldout)):
        assert lengths[tokens.numpy()].sum() == corpus.meta["splits"][name]["bytes"]


def test_the_token_files_match_tokens_json(built, tmp_path: Path) -> None:
    out = built["out"]
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["heldout_modules"] == list(HELDOUT)
    assert meta["heldout_files"] == ["graphlib.py", "shlex.py", "textwrap.py"]
    assert meta["tokenizer_sha256"] == sha256_file(out / "tokenizer/tokenizer.json")
    assert meta["roots"] == [str(p.resolve()) for p in built["tree"]]
    docs = json.loads((out / "documents.json").read_text())
    corpus = load_tokens(out)
    for name, tokens, starts in (
        ("train", corpus.train, corpus.train_doc_starts),
        ("heldout", corpus.heldout, corpus.heldout_doc_starts),
    ):
        entry = meta["splits"][name]
        raw = (out / entry["file"]).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
        assert len(raw) == 2 * entry["tokens"] == 2 * len(tokens)
        assert tokens.dtype == torch.int32 and starts.dtype == torch.int64
        assert starts.tolist() == [d["start"] for d in docs[name]]
        assert len(starts) == entry["documents"] == len(docs[name])
        assert (tokens == meta["eos_id"]).sum() == entry["documents"]  # only the separators
        assert entry["bytes"] == sum(d["bytes"] for d in docs[name])
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    data = bytearray((broken / "heldout.bin").read_bytes())
    data[10] ^= 1
    (broken / "heldout.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match"):
        load_tokens(broken)


def test_a_second_run_skips_the_stages_a_changed_input_reruns(
    built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lib, site = built["tree"]
    work = tmp_path / "copy"
    shutil.copytree(built["out"], work)
    argv = ["--out", str(work), "--root", str(lib), "--root", str(site), "--vocab-size", str(VOCAB)]
    argv += ["--heldout", *HELDOUT, "--workers", "1", "--no-progress"]
    before = {p.name: sha256_file(p) for p in work.iterdir() if p.is_file()}

    def run(*extra: str) -> dict[str, Any]:
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    again = run()
    assert again["stages"] == {"sources": "scanned", "tokenizer": "skipped", "tokens": "skipped"}
    assert {p.name: sha256_file(p) for p in work.iterdir() if p.is_file()} == before
    assert again["train"] == built["summary"]["train"]
    (work / "train.bin").write_bytes(b"\0\0")  # a damaged output reruns its stage only
    assert run()["stages"] == {"sources": "scanned", "tokenizer": "skipped", "tokens": "built"}
    assert sha256_file(work / "train.bin") == before["train.bin"]
    bigger = run("--vocab-size", str(VOCAB + 8))
    assert bigger["stages"] == {"sources": "scanned", "tokenizer": "built", "tokens": "built"}
    assert bigger["vocab_size"] == VOCAB + 8


def test_a_token_map_ranks_the_training_splits_ids_by_frequency(built, tmp_path: Path) -> None:
    """``python -m training.corpus.token_map``: from the built corpus, every id of the
    vocabulary ranked by its count in ``train.bin`` (ties by id); from a scan of the sources,
    counts within 2% of those (each file its own document, the held-out modules kept out),
    and the same most frequent ids."""
    out, tokdir = built["out"], built["out"] / "tokenizer"
    counts = torch.bincount(load_tokens(out).train.long(), minlength=VOCAB).numpy()
    assert (corpus_counts(out, VOCAB) == counts).all()
    order = ranked(counts)
    assert sorted(order) == list(range(VOCAB))
    assert all(
        (counts[a], -a) > (counts[b], -b) for a, b in itertools.pairwise(order)
    )  # by count, then by id
    scanned, files = source_counts(tokdir, VOCAB, list(built["tree"]), HELDOUT)
    assert files > 0 and np.abs(scanned - counts).sum() < 0.02 * counts.sum()
    assert set(ranked(scanned)[:20]) == set(order[:20])
    held_in, _ = source_counts(tokdir, VOCAB, list(built["tree"]), ())
    assert held_in.sum() > scanned.sum()  # the held-out files are not counted
    hot = tmp_path / "hot.txt"
    assert token_map_main(["--model", str(tokdir), "--corpus", str(out), "--out", str(hot),
                           "--size", "64"]) == 0  # fmt: skip
    assert [int(x) for x in hot.read_text().split()] == order[:64]
