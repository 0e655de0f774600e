"""The REST datastore: suffix array against a brute-force sort, exact-match lookup, building (byte-identical twice,
ShareGPT train split only), atomic saving, and clear errors for corrupt files and tokenizer mismatches."""

import json

import numpy as np
import pytest

from specdraft import datastore
from specdraft.cli import main
from specdraft.corpus import split_of
from specdraft.datastore import SEPARATOR, Datastore, suffix_array
from specdraft.errors import SpecdraftError
from toys import WORDS, save_tiny_checkpoint, tiny_tokenizer


def _brute_force(tokens):
    return sorted(range(len(tokens)), key=lambda i: tokens[i:].tolist())


@pytest.mark.parametrize("seed", range(6))
def test_suffix_array_matches_brute_force_sort(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        n, vocab = int(rng.integers(0, 60)), int(rng.integers(1, 6))
        tokens = rng.integers(-1, vocab, n).astype(np.int32)  # -1: document separators
        if rng.random() < 0.3:  # long repeats need many doubling rounds
            tokens = np.tile(tokens[: int(rng.integers(1, 5))], 12) if n else tokens
        assert suffix_array(tokens).tolist() == _brute_force(tokens)


def test_suffix_array_of_large_token_ids_and_edge_cases():
    assert suffix_array(np.empty(0, dtype=np.int32)).tolist() == []
    assert suffix_array(np.array([7], dtype=np.int32)).tolist() == [0]
    tokens = np.array([49151, 3, 49151, 3, -1, 49151], dtype=np.int32)
    assert suffix_array(tokens).tolist() == _brute_force(tokens)


def _occurrences(tokens, pattern):
    m = len(pattern)
    return sorted(i for i in range(len(tokens) - m + 1) if tokens[i : i + m].tolist() == list(pattern))


def test_find_and_longest_suffix_match_against_scanning():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 4, int(rng.integers(1, 30))).tolist() for _ in range(15)]
    store = Datastore.from_documents(docs)
    assert store.tokens[-1] == SEPARATOR and (store.tokens == SEPARATOR).sum() == 15
    for _ in range(200):
        pattern = rng.integers(0, 4, int(rng.integers(1, 7))).tolist()
        lo, hi = store.find(pattern)
        assert sorted(store.suffix_array[lo:hi].tolist()) == _occurrences(store.tokens, pattern)
        context = rng.integers(0, 4, 12).tolist()
        m, lo, hi = store.longest_suffix_match(context, 2, 10)
        lengths = [n for n in range(2, 11) if _occurrences(store.tokens, context[-n:])]
        assert m == max(lengths, default=0)
        if m:
            assert sorted(store.suffix_array[lo:hi].tolist()) == _occurrences(store.tokens, context[-m:])


def test_continuations_stop_at_document_end_and_cap_is_evenly_spaced():
    store = Datastore.from_documents([[1, 2, 3, 4], [1, 2], [1, 2, 5]])
    lo, hi = store.find([1, 2])
    rows = store.continuations(lo, hi, 2, 3, 100)
    assert sorted(rows.tolist()) == [[-1, -1, -1], [3, 4, -1], [5, -1, -1]]
    store = Datastore.from_documents([[1, i] for i in range(2, 12)])
    lo, hi = store.find([1])
    assert store.continuations(lo, hi, 1, 1, 5)[:, 0].tolist() == [2, 4, 6, 8, 10]  # rows 0, 2, 4, 6, 8


@pytest.fixture
def corpus(tmp_path):
    text = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    paragraphs = [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 40)) for _ in range(30)]
    text.write_text("\n\n".join(paragraphs) + "\n")
    return text


def test_build_save_load_round_trip_and_byte_identical_rebuild(corpus, tmp_path):
    tokenizer = tiny_tokenizer()
    first, manifest = datastore.build(tokenizer, str(corpus), tmp_path / "a")
    second, _ = datastore.build(tokenizer, str(corpus), tmp_path / "b")
    for name in datastore.FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert manifest["documents"] == 30 and manifest["tokens"] == 30 * 41
    store = datastore.load(first, tokenizer)
    assert isinstance(store.tokens, np.memmap) and isinstance(store.suffix_array, np.memmap)
    assert store.suffix_array.tolist() == _brute_force(np.asarray(store.tokens))
    assert store.manifest["tokenizer_fingerprint"] == manifest["tokenizer_fingerprint"]
    assert not [p for p in first.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_sharegpt_source_keeps_held_out_conversations_out(tmp_path, monkeypatch):
    ids = [f"c{i}" for i in range(200)]
    train = next(i for i in ids if split_of(i) == "train")
    heldout = next(i for i in ids if split_of(i) == "heldout")
    conversations = [{"id": cid, "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": text}]}
                     for cid, text in ((train, "w5 w6 w7"), (heldout, "w8 w9"))]
    fake = tmp_path / "sharegpt.json"
    fake.write_text(json.dumps(conversations))
    monkeypatch.setattr("specdraft.corpus.sharegpt_path", lambda: fake)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    tokenizer = tiny_tokenizer()
    out, manifest = datastore.build(tokenizer)
    assert out == datastore.default_dir("sharegpt", manifest["tokenizer_fingerprint"])
    assert out.parent == tmp_path / "cache" / "datastores"
    assert datastore.load(out).tokens.tolist() == tokenizer("w5 w6 w7")["input_ids"] + [SEPARATOR]


def test_corrupt_truncated_or_missing_files_are_clear_errors(corpus, tmp_path):
    out, _ = datastore.build(tiny_tokenizer(), str(corpus), tmp_path / "ds")
    data_file = out / "suffix_array.npy"
    original = data_file.read_bytes()
    data_file.write_bytes(original[:-8])  # truncated
    with pytest.raises(SpecdraftError, match=r"corrupt datastore.*truncated"):
        datastore.load(out)
    flipped = bytearray(original)
    flipped[-3] ^= 0xFF
    data_file.write_bytes(bytes(flipped))  # same size, one byte changed
    with pytest.raises(SpecdraftError, match="SHA-256"):
        datastore.load(out)
    data_file.write_bytes(b"not a numpy file".ljust(len(original), b"!"))
    with pytest.raises(SpecdraftError, match="corrupt datastore"):
        datastore.load(out, verify=False)
    (out / "manifest.json").write_text("{")
    with pytest.raises(SpecdraftError, match="corrupt datastore manifest"):
        datastore.load(out)
    with pytest.raises(SpecdraftError, match="build-datastore"):
        datastore.load(tmp_path / "nowhere")


def test_tokenizer_fingerprint_mismatch(corpus, tmp_path):
    out, _ = datastore.build(tiny_tokenizer(), str(corpus), tmp_path / "ds")
    with pytest.raises(SpecdraftError, match="another tokenizer"):
        datastore.load(out, tiny_tokenizer(WORDS[::-1]))


def test_interrupted_rebuild_leaves_a_folder_that_does_not_load(corpus, tmp_path, monkeypatch):
    out, _ = datastore.build(tiny_tokenizer(), str(corpus), tmp_path / "ds")
    real_save = np.save
    calls = []

    def dying_save(file, array):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while writing the second file
        real_save(file, array)

    monkeypatch.setattr(np, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        datastore.build(tiny_tokenizer(), str(corpus), out)
    with pytest.raises(SpecdraftError, match="no datastore"):
        datastore.load(out)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_cli_build_datastore_then_generate_with_rest(corpus, tmp_path, capsys):
    target = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    out = tmp_path / "ds"
    code = main(["build-datastore", "--target", target, "--source", str(corpus), "--out", str(out),
                 "--max-docs", "10"])
    printed = capsys.readouterr().out
    assert code == 0 and "410 tokens" in printed and "MiB on disk" in printed and "built in" in printed
    assert datastore.load(out).manifest["documents"] == 10
    again = ["build-datastore", "--target", target, "--source", str(corpus), "--out", str(out), "--max-docs", "10",
             "--if-missing"]
    assert main(again) == 0 and "is present; not rebuilding it" in capsys.readouterr().out
    (out / "tokens.npy").write_bytes(b"broken")  # a datastore that does not load is rebuilt
    assert main(again) == 0 and "410 tokens" in capsys.readouterr().out
    base = ["generate", "--target", target, "--prompt", corpus.read_text().split()[3], "--max-new-tokens", "12",
            "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--drafter", "rest", "--drafter-option", f"datastore={out}"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main(["build-datastore", "--target", target, "--source", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
