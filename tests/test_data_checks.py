"""Whole-file data checks, before anything is spawned: every token id against the model's
vocabulary (not its padded embedding), a uint32 file declared uint16, files shorter than one
sequence, a fingerprint over every byte, a scan cached per file, and the synthetic corpus on a
full disk."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lowcomm.config import ConfigError
from lowcomm.config.compose import compose
from lowcomm.config.schema import DataSpec, TrainSpec
from lowcomm.data import materialize
from lowcomm.data.fingerprint import FINGERPRINT_FILE, check_unchanged
from lowcomm.data.memmap import DataError
from lowcomm.data.synthetic import SyntheticSpec, ensure_synthetic
from lowcomm.launch.local import prepare_run_dir
from lowcomm.models.olmo import ModelSpec
from runs import tiny_run

# More than the 2^20 tokens that the checks before this one looked at.
LONG = 1_200_000


def _tokens(path: Path, count: int, *, high: int = 257, dtype=np.uint16, seed: int = 0) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, high, size=count).astype(dtype)
    tokens.tofile(path)
    return tokens


def _memmap_run(tmp_path: Path, train: Path, val: Path, *overrides: str):
    return tiny_run(tmp_path / "runs", "data=memmap", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
                    *overrides, workers=1, max_steps=2)


SCHEMAS = {"model": ModelSpec, "data": DataSpec, "train": TrainSpec}


def assert_suggested_keys_exist(message: str) -> None:
    """Every ``group=option`` and ``section.key`` a message names exists (issue 26: a hint
    named ``data.paths.dtype``, which OmegaConf then refused with a traceback)."""
    message = re.sub(r"\S*/\S*", "<path>", message)
    for section, dotted, value in re.findall(r"\b(model|data|train)(?:\.([\w.]+))?=([A-Za-z0-9_]+)", message):
        if dotted:
            assert dotted in {f.name for f in dataclasses.fields(SCHEMAS[section])}, f"{section}.{dotted} in {message}"
        else:
            compose([f"{section}={value}"])  # raises for an option that does not exist
    for section, dotted in re.findall(r"\b(model|data|train)\.([a-z_][\w.]*[a-z_])", message):
        assert dotted in {f.name for f in dataclasses.fields(SCHEMAS[section])}, f"{section}.{dotted} in {message}"


# ----------------------------------------------------------------------------- the vocabulary


@pytest.mark.slow
def test_an_id_out_of_the_vocabulary_near_the_end_of_a_file_is_refused_before_spawning(tmp_path, capsys):
    """Today: after spawning, `IndexError: index out of range in self`, two tracebacks."""
    from lowcomm.cli.train import main

    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    tokens = _tokens(train, LONG)
    tokens[LONG - 10] = 50_000  # made with the OLMo tokenizer, say
    tokens.tofile(train)
    _tokens(val, 20_000, seed=1)
    run_root = tmp_path / "runs"

    code = main(["wandb.mode=disabled", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=64",
                 "train.warmup_steps=0", "train.eval_every=0", "train.eval_instances=8", "train.max_steps=2",
                 "cluster.workers=1", f"run_root={run_root}", "data=memmap", f"data.paths=[{train}]",
                 f"data.val_paths=[{val}]"])

    err = capsys.readouterr().err
    assert code == 2  # bad input, as a bad config is (issue 45: it was 1)
    assert f"data.paths: {train} holds token id 50,000 (first at token {LONG - 10:,} of {LONG:,})" in err
    assert "model=tiny takes ids below 257" in err
    assert "model=olmo_1b or model=olmo_300m" in err  # the models whose tokenizer holds it
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(run_root.glob("default/*"))  # nothing was launched, and no empty run directory is left
    assert_suggested_keys_exist(err)


@pytest.mark.slow
def test_ids_between_the_vocabulary_and_the_padded_embedding_are_refused(tmp_path):
    """Today: id 300 of the tiny model (vocab 257, embedding 384) trains silently."""
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    tokens = _tokens(train, LONG)
    tokens[LONG - 1] = 300
    tokens.tofile(train)
    _tokens(val, 20_000, seed=1)

    with pytest.raises(DataError) as info:
        prepare_run_dir(_memmap_run(tmp_path, train, val))

    message = str(info.value)
    assert f"{train} holds token id 300 (first at token {LONG - 1:,}" in message
    assert "model.embedding_size=384 only pads it: ids 257-383 would train silently" in message
    assert not (_memmap_run(tmp_path, train, val).run_dir / "config.yaml").exists()
    assert_suggested_keys_exist(message)


def test_uint16_tokens_declared_uint32_are_named(tmp_path):
    train = tmp_path / "train.bin"
    _tokens(train, 200_000, high=50_000)
    run = _memmap_run(tmp_path, train, train, "model=olmo_300m", "data.dtype=uint32")
    with pytest.raises(DataError, match="probably uint16 tokens read as uint32 .*; set data.dtype=uint16") as info:
        prepare_run_dir(run)
    assert_suggested_keys_exist(str(info.value))


def test_a_sweep_checks_every_jobs_data_before_the_first_one_trains(tmp_path, capsys):
    """Before: job 1 trained, then job 2's launch was refused (and, earlier still, its workers
    crashed after spawning). Now the sweep names job 2's data and trains nothing."""
    from lowcomm.cli.sweep import main as sweep_main

    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    _tokens(good, 20_000)
    tokens = _tokens(bad, LONG)
    tokens[-3] = 50_000
    tokens.tofile(bad)
    sweep = tmp_path / "mine.yaml"
    sweep.write_text(json.dumps({
        "base": ["data=memmap", f"data.val_paths=[{good}]", "wandb.mode=disabled", "optimizer=adamw_ddp",
                 "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=64", "train.max_steps=2",
                 "train.eval_every=0", "train.eval_instances=8", "cluster.workers=1"],
        "points": [[f"data.paths=[{good}]"], [f"data.paths=[{bad}]"]],
        "seeds": [0],
    }))

    with pytest.raises(SystemExit) as exited:  # argparse's exit: usage errors are 2
        sweep_main(["run", str(sweep), "--out", str(tmp_path / "out"), f"run_root={tmp_path / 'runs'}"])

    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert f"job 2 (data.paths=[{bad}] seed=0): data.paths: {bad} holds token id 50,000" in err
    assert "job 1" not in err
    assert not list((tmp_path / "runs").glob("default/*"))  # nothing trained, not even job 1


# ----------------------------------------------------------------------------- the layout


def test_uint32_tokens_declared_uint16_are_detected(tmp_path):
    """Today: trains silently on t,0,t,0,... (every id is below the vocabulary)."""
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    _tokens(train, 300_000, dtype=np.uint32)
    _tokens(val, 20_000, dtype=np.uint32, seed=1)

    with pytest.raises(DataError) as info:
        prepare_run_dir(_memmap_run(tmp_path, train, val))

    message = str(info.value)
    assert f"data.paths: {train} looks like uint32 tokens read as uint16" in message
    assert f"data.val_paths: {val} looks like uint32 tokens read as uint16" in message
    assert "set data.dtype=uint32" in message
    assert_suggested_keys_exist(message)
    prepare_run_dir(_memmap_run(tmp_path, train, val, "data.dtype=uint32"))  # the suggestion works


def test_real_uint16_tokens_with_many_zeros_are_not_called_uint32(tmp_path):
    train = tmp_path / "train.bin"
    tokens = _tokens(train, 300_000)
    tokens[::7] = 0  # EOS id 0 in some tokenizers, padding, ...
    tokens.tofile(train)
    prepare_run_dir(_memmap_run(tmp_path, train, train))


# ----------------------------------------------------------------------------- short files


def test_a_memmap_file_shorter_than_one_sequence_is_refused_before_spawning(tmp_path):
    """Today: `... hold no instance of 64 tokens` inside the workers, after spawning."""
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    _tokens(train, 20_000)
    _tokens(val, 50)
    with pytest.raises(ConfigError) as info:
        _memmap_run(tmp_path, train, val)
    message = str(info.value)
    assert (f"data.val_paths: {val} holds 50 tokens, fewer than one sequence (train.seq_len=64), so no instance "
            "can be read from it; remove it from data.val_paths or lower train.seq_len") in message
    assert_suggested_keys_exist(message)


def test_a_text_corpus_whose_validation_split_is_shorter_than_one_sequence_is_refused(tmp_path):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(300)))
    run = tiny_run(tmp_path / "runs", "data=text", f"data.paths=[{tmp_path}/docs.jsonl]", "data.val_fraction=0.02",
                   workers=1)
    with pytest.raises(DataError) as info:
        prepare_run_dir(run)
    message = str(info.value)
    assert re.search(r"data=text \(validation split\): \S+/val\.bin holds \d+ tokens, fewer than one sequence "
                     r"\(train\.seq_len=64\).*raise data\.val_fraction", message), message
    assert_suggested_keys_exist(message)


# ----------------------------------------------------------------------------- the fingerprint


def test_a_rewrite_in_place_at_a_quarter_of_a_file_stops_a_resume(tmp_path):
    """Today: three sampled 64 KiB windows (start, middle, end) miss it."""
    tokens_path = tmp_path / "tokens.bin"
    tokens = _tokens(tokens_path, 2_000_000)
    run_dir = tmp_path / "run"
    check_unchanged(run_dir, [tokens_path], resuming=False)  # the run starts
    check_unchanged(run_dir, [tokens_path], resuming=True)  # same data: resumes

    quarter = len(tokens) // 4
    with tokens_path.open("r+b") as handle:  # in place: same size, same inode
        handle.seek(quarter * 2)
        handle.write(((tokens[quarter:quarter + 50_000] + 1) % 257).astype(np.uint16).tobytes())

    with pytest.raises(DataError, match=rf"{tokens_path} changed content \(same size, 4,000,000 bytes\)"):
        check_unchanged(run_dir, [tokens_path], resuming=True)


@pytest.mark.slow
def test_the_scan_is_cached_per_file_and_redone_when_the_file_changes(tmp_path):
    from lowcomm.config.data_checks import check_run_data, scan_cache_dir

    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    tokens = _tokens(train, 500_000)
    _tokens(val, 20_000, seed=1)
    time.sleep(2.1)  # older than a timestamp tick: a scan of it may be cached
    run = _memmap_run(tmp_path, train, val)
    files = materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)

    first = check_run_data(run, files, resuming=False)
    second = check_run_data(run, files, resuming=True)
    assert [s.cached for s in first] == [False, False] and [s.cached for s in second] == [True, True]
    assert [dataclasses.replace(s, cached=False) for s in second] == first
    assert len(list(scan_cache_dir(run).glob("*.json"))) == 2

    with train.open("r+b") as handle:  # a rewrite in place, same size: scanned again, and refused
        handle.seek(len(tokens) // 4 * 2)
        handle.write(np.full(1000, 7, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match=f"{train} changed content"):
        check_run_data(run, files, resuming=True)
    third = check_run_data(run, files, resuming=False)  # a fresh start records it
    assert [s.cached for s in third] == [False, True] and third[0].sha256 != first[0].sha256


def test_a_run_directory_with_the_older_sampled_fingerprint_resumes_and_is_upgraded(tmp_path, capsys):
    from lowcomm.config.data_checks import check_run_data
    from lowcomm.data.fingerprint import legacy_window_hash

    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    _tokens(train, 200_000)
    _tokens(val, 20_000, seed=1)
    run = _memmap_run(tmp_path, train, val)
    files = materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    record = run.run_dir / FINGERPRINT_FILE
    record.parent.mkdir(parents=True)
    legacy = {str(p.resolve()): {"size": p.stat().st_size, "sha256_windows": legacy_window_hash(p)} for p in (train, val)}
    record.write_text(json.dumps(legacy))

    check_run_data(run, files, resuming=True)

    assert "came from an older lowcomm that hashed three 64 KiB windows" in capsys.readouterr().err
    upgraded = json.loads(record.read_text())
    assert set(upgraded) == set(legacy) and all("sha256" in entry for entry in upgraded.values())
    check_run_data(run, files, resuming=True)  # and now compared whole
    assert capsys.readouterr().err == ""

    legacy[str(val.resolve())]["sha256_windows"] = "0" * 64  # a changed window is still refused
    record.write_text(json.dumps(legacy))
    with pytest.raises(DataError, match=f"{val.resolve()} changed content"):
        check_run_data(run, files, resuming=True)


def test_a_long_scan_reports_its_progress_and_throughput(tmp_path):
    from lowcomm.data.scan import CHUNK_TOKENS, ScanProgress, scan_file

    path = tmp_path / "big.bin"
    _tokens(path, 3 * CHUNK_TOKENS + 5)
    stream = io.StringIO()
    progress = ScanProgress(stream, interval_s=0, after_s=0)
    progress.begin(path.stat().st_size, 1)

    scan = scan_file(path, "uint16", progress=progress)

    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and all(re.fullmatch(
        rf"\[lowcomm\] scanning data, file 1 of 1 \({path.resolve()}\): [\d.]+ MB of 25\.2 MB \(\d+%\) at [\d.]+ [kMG]?B/s, "
        r"~\d+ s left", line) for line in lines), lines
    assert lines[-1].split(": ")[1].startswith("25.2 MB of 25.2 MB (100%)")
    assert scan.tokens == 3 * CHUNK_TOKENS + 5 and scan.max_id == 256


# ----------------------------------------------------------------------------- the synthetic corpus


@pytest.fixture
def tiny_disk(tmp_path) -> Path:
    """A 1 MiB tmpfs (root only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_the_synthetic_corpus_on_a_full_disk_names_it_and_leaves_nothing(tiny_disk, monkeypatch):
    """Today: SIGBUS (exit 135, nothing printed) and an orphan temp directory."""
    spec = SyntheticSpec(train_tokens=1_000_000, val_tokens=4096, seq_len=64)
    with pytest.raises(DataError, match=rf"no space left to write the synthetic corpus \(2\.0 MB\) to {tiny_disk}/data/"
                                        rf"synthetic-\w+: the filesystem mounted at {tiny_disk} has 1\.0 MB free"):
        ensure_synthetic(tiny_disk, spec)
    assert list((tiny_disk / "data").iterdir()) == []

    # the disk fills up while the corpus is written (another writer took the space)
    import lowcomm.data.synthetic as synthetic

    real = shutil.disk_usage
    monkeypatch.setattr(synthetic.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))
    stale = tiny_disk / "data" / f".{synthetic.synthetic_dir(tiny_disk, spec).name}.dead"
    stale.mkdir()  # left by a writer killed earlier
    os.utime(stale, (time.time() - 2 * synthetic.STALE_ATTEMPT_S,) * 2)
    with pytest.raises(DataError, match=f"the filesystem mounted at {tiny_disk} filled up while it was written"):
        ensure_synthetic(tiny_disk, spec)
    assert list((tiny_disk / "data").iterdir()) == []


def test_lowcomm_prepare_data_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(tiny_disk, tmp_path, capsys):
    """Today: a 30-line OSError traceback."""
    from lowcomm.cli.prepare_data import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: {'lorem ipsum dolor sit amet ' * 40}\n" for i in range(2000)))
    output = tiny_disk / "mycorpus"

    assert main([str(corpus), "--output", str(output), "--tokenizer", "bytes"]) == 2

    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after the progress bar
    assert last.startswith(f"lowcomm-prepare-data: error: could not write {output}: No space left on device")
    assert last.endswith(f"nothing was written (the filesystem is mounted at {tiny_disk})")
    assert list(tiny_disk.iterdir()) == []


# ------------------------------------------------------------------ the corpus's tokenizer against the model's

def _byte_corpus(tmp_path: Path, *, record_vocabulary: bool = True) -> Path:
    """A corpus of three of this repository's pages, tokenized to bytes by lowcomm-prepare-data."""
    from lowcomm.data.prepare import prepare
    corpus = tmp_path / "corpus"
    repo = Path(__file__).resolve().parents[1]
    prepare([str(repo / page) for page in ("README.md", "analysis/README.md", "slurm/README.md")], corpus, "bytes", 0.3)
    if not record_vocabulary:  # as a corpus prepared before meta.json recorded it
        meta = json.loads((corpus / "meta.json").read_text())
        del meta["vocab_size"]
        (corpus / "meta.json").write_text(json.dumps(meta))
    return corpus


@pytest.mark.parametrize("record_vocabulary", [True, False], ids=["recorded", "by-tokenizer-name"])
def test_a_corpus_tokenized_for_another_model_is_refused_naming_both_before_spawning(tmp_path, record_vocabulary):
    """Every byte id is also a valid id of OLMo's 50,280: the id scan alone let a 300M model train
    on a byte corpus, silently (issue 45). The corpus's meta.json names its tokenizer."""
    corpus = _byte_corpus(tmp_path, record_vocabulary=record_vocabulary)
    run = _memmap_run(tmp_path, corpus / "train.bin", corpus / "val.bin", "model=olmo_300m", "train.seq_len=64",
                      "train.global_batch_size=2", "train.micro_batch_size=1")
    with pytest.raises(DataError) as info:
        prepare_run_dir(run)
    message = str(info.value)
    assert message == (
        f"data.paths: {corpus} was tokenized with tokenizer bytes, 257 ids ({corpus / 'meta.json'}), but "
        "model=olmo_300m reads tokenizer allenai_gpt-neox-olmo-dolma-v1_5 (50,280 ids); train model=tiny on it, "
        "or tokenize the text again for this model (lowcomm-prepare-data --tokenizer "
        "allenai_gpt-neox-olmo-dolma-v1_5 ...)")
    assert_suggested_keys_exist(message)
    assert not (run.run_dir / "config.yaml").exists()  # refused before anything was written or spawned


def test_a_corpus_of_the_models_own_tokenizer_and_raw_token_files_pass(tmp_path):
    corpus = _byte_corpus(tmp_path)
    prepare_run_dir(_memmap_run(tmp_path, corpus / "train.bin", corpus / "val.bin"))  # tiny reads bytes
    raw = tmp_path / "raw"
    raw.mkdir()
    _tokens(raw / "train.bin", 4096)
    _tokens(raw / "val.bin", 1024, seed=1)
    (raw / "meta.json").write_text("not a record of ours")  # unreadable: the id scan alone decides
    prepare_run_dir(_memmap_run(tmp_path / "second", raw / "train.bin", raw / "val.bin"))


def test_data_a_worker_cannot_read_is_bad_input_there_too(tmp_path):
    """The launcher checks the data before it spawns; a worker that still finds it wanting (a file
    on the first node but not on another, or removed since the check) says so in one line and
    exits 2, as the check would have, and the local launcher passes that status on."""
    from lowcomm.launch.local import WorkerFailure
    from lowcomm.train.worker import EXIT_BAD_INPUT

    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    _tokens(train, 4096)
    _tokens(val, 1024, seed=1)
    run = _memmap_run(tmp_path, train, val)
    config_path = prepare_run_dir(run)
    train.unlink()  # not on this node
    done = subprocess.run([sys.executable, "-m", "lowcomm.train.worker", str(config_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "RANK": "0", "WORLD_SIZE": "1",
                                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
    assert done.returncode == EXIT_BAD_INPUT == 2, done.stdout + done.stderr
    line = f"data.paths: no file matches '{train}'"
    assert done.stderr.splitlines() == [f"[lowcomm] rank 0: {line}"], done.stderr

    words = {"line": line, "cause": line}
    assert WorkerFailure(0, EXIT_BAD_INPUT, words, run.run_dir).exit_status == 2
    assert WorkerFailure(0, 1, words, run.run_dir).exit_status == 1
