"""Data: OLMo's memmap format, rank-disjoint deterministic order, the synthetic corpus and its
exact Bayes floor, and text preparation with the OLMo tokenizer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lowcomm.cli.prepare_data import main as prepare_main
from lowcomm.data.memmap import BatchOrder, DataError, MemmapDataset, check_token_file
from lowcomm.data.synthetic import ALPHABET, MarkovMixture, SyntheticSpec, ensure_synthetic, read_meta
from lowcomm.models import load_tokenizer
from lowcomm.models.tokenizer import BYTES_EOS


def test_memmap_instances_span_files_and_drop_tails(tmp_path):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.memmap(a, dtype=np.uint16, mode="w+", shape=(10,))[:] = np.arange(10)
    np.memmap(b, dtype=np.uint16, mode="w+", shape=(7,))[:] = np.arange(100, 107)
    data = MemmapDataset([a, b], seq_len=3)
    assert len(data) == 3 + 2  # 10 // 3 + 7 // 3
    assert data[2].tolist() == [6, 7, 8]
    assert data[3].tolist() == [100, 101, 102]
    assert data.batch([4, 0]).tolist() == [[103, 104, 105], [0, 1, 2]]


def test_batch_order_is_disjoint_across_ranks_and_covers_each_epoch_once():
    world, n = 4, 64
    orders = [BatchOrder(n, global_batch_size=16, rank=r, world_size=world, micro_batch_size=2, seed=7)
              for r in range(world)]
    for step in range(n // 16):
        per_rank = [np.concatenate(o.indices_for_step(step)) for o in orders]
        assert all(len(p) == 4 for p in per_rank)
        assert len(set(np.concatenate(per_rank).tolist())) == 16
    epoch = np.concatenate([np.concatenate(o.indices_for_step(s)) for s in range(4) for o in orders])
    assert sorted(epoch.tolist()) == list(range(n))
    # a fresh order object (a resumed run) reproduces step 5 exactly
    again = BatchOrder(n, 16, 1, world, 2, seed=7)
    assert all(np.array_equal(x, y) for x, y in zip(again.indices_for_step(5), orders[1].indices_for_step(5),
                                                   strict=True))


def test_token_file_checks_name_the_problem(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02\x00\x03\x00")  # 6 bytes: fine as uint16, not as uint32
    assert check_token_file(odd, "uint16") == 3
    with pytest.raises(DataError, match=r"data.dtype=uint32 does not match .*odd.bin.*6 bytes.*set data.dtype=uint16"):
        check_token_file(odd, "uint32")
    with pytest.raises(DataError, match="does not exist"):
        check_token_file(tmp_path / "missing.bin", "uint16")
    with pytest.raises(DataError, match="holds 3 tokens, fewer than one sequence"):
        check_token_file(odd, "uint16", seq_len=4)


def test_synthetic_corpus_is_deterministic_and_starts_every_instance_with_a_document(tmp_path):
    spec = SyntheticSpec(train_tokens=8192, val_tokens=2048, seq_len=64)
    first = ensure_synthetic(tmp_path / "a", spec)
    second = ensure_synthetic(tmp_path / "b", spec)
    assert (first / "train.bin").read_bytes() == (second / "train.bin").read_bytes()
    tokens = np.fromfile(first / "val.bin", dtype=np.uint16).reshape(-1, 64)
    alphabet_ids = set(ALPHABET.encode())
    assert set(tokens[:, 0].tolist()) <= alphabet_ids  # never EOS at an instance start
    assert set(np.unique(tokens).tolist()) <= alphabet_ids | {BYTES_EOS}
    meta = read_meta(first)
    assert meta["val_tokens"] == 2048 and 0 < meta["val_bayes_floor"] < math.log(len(ALPHABET) + 1)


def _brute_force_nll(model: MarkovMixture, row: np.ndarray) -> list[float]:
    """-log p(x_t | x_<t) by explicit enumeration of topics for each target, from first principles."""
    spec, chars = model.spec, {int(c): i for i, c in enumerate(model.token_ids)}
    lo, hi = spec.doc_length
    out, doc_start = [], 0
    for t in range(1, len(row)):
        doc = [chars[int(c)] for c in row[doc_start:t]]  # the current document's characters so far
        # joint P(z, doc so far) for each topic, then P(next | doc so far)
        weights = []
        for z in range(spec.n_topics):
            p, prev = 1.0 / spec.n_topics, model.start_state
            for c in doc:
                p *= model.transitions[z, prev, c]
                prev = c
            weights.append((p, prev))
        total = sum(w for w, _ in weights)
        j = len(doc)
        # P(length == j | length >= j) under Uniform{lo..hi}
        end_prob = (1.0 / (hi - j + 1)) if lo <= j <= hi else 0.0
        target = int(row[t])
        if j == 0:
            # right after EOS: a new document's first character
            prob = sum(model.transitions[z, model.start_state, chars[target]] for z in range(spec.n_topics))
            prob /= spec.n_topics
        elif target == BYTES_EOS:
            prob = end_prob
        else:
            prob = (1 - end_prob) * sum(w * model.transitions[z, prev, chars[target]]
                                        for z, (w, prev) in enumerate(weights)) / total
        out.append(-math.log(prob))
        if target == BYTES_EOS:
            doc_start = t + 1
    return out


def test_bayes_floor_matches_a_brute_force_enumeration():
    spec = SyntheticSpec(n_topics=3, doc_length=(4, 12), seq_len=40)
    model = MarkovMixture(spec)
    tokens = model.sample(6, np.random.default_rng(0))
    assert (tokens == BYTES_EOS).any(), "the sample should cross document boundaries"
    fast = model.bayes_nll(tokens)
    for row, nll in zip(tokens, fast, strict=True):
        assert np.allclose(nll, _brute_force_nll(model, row), rtol=1e-9)


def test_prepare_data_tokenizes_text_and_jsonl_with_the_olmo_tokenizer(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("The quick brown fox.")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"document number {i}"}) for i in range(200)))
    out = tmp_path / "prepared"
    assert prepare_main([str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl"), "--output", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_documents"] + meta["val_documents"] == 201 and meta["val_documents"] > 0
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tok = load_tokenizer("allenai_gpt-neox-olmo-dolma-v1_5")
    assert tokens[: len(tok.encode("The quick brown fox."))].tolist() == tok.encode("The quick brown fox.")
    assert (tokens == tok.eos_token_id).sum() == meta["train_documents"]
    assert "train tokens" in capsys.readouterr().out
    assert prepare_main([str(tmp_path / "nothing*.txt"), "--output", str(out)]) == 2


def test_prepare_data_reads_markdown_as_text_and_names_every_other_file_before_reading_any(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# Notes\n\nbytes")
    (tmp_path / "more.txt").write_text("more")
    out = tmp_path / "prepared"
    assert prepare_main([str(tmp_path / "*.md"), str(tmp_path / "*.txt"), "--tokenizer", "bytes", "--output", str(out),
                         "--val-fraction", "0.5"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_documents"] + meta["val_documents"] == 2
    assert meta["train_tokens"] + meta["val_tokens"] == len("# Notes\n\nbytes") + len("more") + 2  # bytes + eos
    (tmp_path / "code.py").write_text("x = 1")
    (tmp_path / "table.csv").write_text("a,b")
    capsys.readouterr()
    assert prepare_main([str(tmp_path / "*"), "--output", str(tmp_path / "other")]) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'code.py'}" in error and f"{tmp_path / 'table.csv'}" in error and "nothing was written" in error
    assert "tokenizing" not in error and not (tmp_path / "other").exists()


def test_a_resume_on_changed_data_stops_naming_the_file(tmp_path):
    from lowcomm.data.fingerprint import check_unchanged

    tokens = tmp_path / "tokens.bin"
    np.arange(300_000, dtype=np.uint16).tofile(tokens)
    run_dir = tmp_path / "run"
    check_unchanged(run_dir, [tokens], resuming=False)  # the run starts: recorded
    check_unchanged(run_dir, [tokens], resuming=True)  # same files: fine

    data = np.fromfile(tokens, dtype=np.uint16)
    data[150_000] += 1  # one token in the middle, same size
    data.tofile(tokens)
    with pytest.raises(DataError, match=rf"{tokens} changed content \(same size, 600,000 bytes\)"):
        check_unchanged(run_dir, [tokens], resuming=True)

    np.arange(1000, dtype=np.uint16).tofile(tokens)  # truncated
    with pytest.raises(DataError, match=rf"{tokens} changed size: 600,000 bytes when the run started, 2,000 now"):
        check_unchanged(run_dir, [tokens], resuming=True)
    check_unchanged(run_dir, [tokens], resuming=False)  # a fresh start records the new files
    check_unchanged(run_dir, [tokens], resuming=True)
