"""The run's data files against its model, over every byte, before anything is spawned.

:func:`check_run_data` is called by the launchers once the files exist (``prepare_run_dir``:
memmap paths, or the synthetic / text corpus generated for the run). Each training and
validation file is scanned whole (:mod:`lowcomm.data.scan`, cached per file, so a corpus is read
once, not on every launch) and refused, with every problem named at once, when

- a token id is at or above the model's vocabulary (the tokenizer's size, not the embedding
  padded to a multiple of 64: ids in between would train silently on rows no tokenizer emits;
  ids past the embedding crash in a worker, after the allocation has started);
- a uint16 file looks like uint32 tokens (every other uint16 zero: it would train on t,0,t,0,...);
- a file holds fewer tokens than one sequence.

Then the files' whole-file fingerprint is recorded in the run directory, or compared with the
recorded one on a resume (:mod:`lowcomm.data.fingerprint`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from omegaconf import OmegaConf

from lowcomm.config.schema import RunConfig
from lowcomm.data import materialize
from lowcomm.data.fingerprint import check_unchanged
from lowcomm.data.memmap import DataError, short_file_message
from lowcomm.data.scan import FileScan, ScanProgress, cached_scan, scan_file
from lowcomm.data.synthetic import META, read_meta
from lowcomm.models.tokenizer import available_tokenizers, load_tokenizer
from lowcomm.paths import config_dir

SCAN_CACHE = ("data", "scans")  # under run_root, beside the generated corpora
# Name this many files per problem; the rest are counted.
LISTED_FILES = 4
# Say that the data is being checked, and how it went, when it takes at least this long.
ANNOUNCE_BYTES = 1 << 30
SUMMARY_AFTER_S = 1.0


@dataclass(frozen=True)
class ModelVocab:
    name: str
    vocab_size: int
    tokenizer: str


def scan_cache_dir(run: RunConfig) -> Path:
    return Path(run.run_root).joinpath(*SCAN_CACHE)


def check_run_data(run: RunConfig, files: dict, *, resuming: bool, stream: TextIO | None = None) -> list[FileScan]:
    """Scan ``files`` (``lowcomm.data.materialize``'s answer) and check them against ``run``'s
    model; record or compare their fingerprint. Raises DataError naming every problem."""
    stream = stream if stream is not None else sys.stderr
    paths, scans, problems = _check(run, files, stream)
    # On a resume, data that changed since the checkpoints is the story, whatever else is wrong
    # with it; a fresh start records its fingerprint only for data that passed.
    notes = check_unchanged(run.run_dir, paths, resuming=True, scans=scans) if resuming else []
    if len(problems) == 1:
        raise DataError(problems[0])
    if problems:
        raise DataError(f"{len(problems)} problems with the data:" + "".join(f"\n  - {p}" for p in problems))
    if not resuming:
        check_unchanged(run.run_dir, paths, resuming=False, scans=scans)
    for note in notes:
        print(f"[lowcomm] note: {note}", file=stream, flush=True)
    return scans


def data_problems(run: RunConfig, stream: TextIO | None = None) -> list[str]:
    """What :func:`check_run_data` would refuse in ``run``'s data, found before anything runs:
    the data is materialised (a synthetic or text corpus is generated once) and scanned (cached),
    nothing is written in the run directory. A sweep calls this for every job before the first
    one trains, so that job 7's data is not found wrong after jobs 1-6 have trained."""
    files = materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    return _check(run, files, stream if stream is not None else sys.stderr)[2]


def _check(run: RunConfig, files: dict, stream: TextIO) -> tuple[list[Path], list[FileScan], list[str]]:
    keys = _keys(run)
    labelled = [(Path(path), keys[split]) for split in ("train", "val") for path in files[split]]
    paths = [path for path, _ in labelled]
    scans = _scan_all(run, paths, files["dtype"], stream)
    return paths, scans, _problems(run, files["dtype"], list(zip(scans, (key for _, key in labelled), strict=True)))


def _keys(run: RunConfig) -> dict[str, str]:
    """How a message calls each split's files: the key that lists them, or the corpus."""
    if run.data.name == "memmap":
        return {"train": "data.paths", "val": "data.val_paths"}
    return {"train": f"data={run.data.name} (training split)", "val": f"data={run.data.name} (validation split)"}


def _scan_all(run: RunConfig, paths: list[Path], dtype: str, stream: TextIO) -> list[FileScan]:
    cache_dir = scan_cache_dir(run)
    scans: list[FileScan | None] = [cached_scan(path, dtype, cache_dir) for path in paths]
    todo = [i for i, scan in enumerate(scans) if scan is None]
    if not todo:
        return scans
    total = sum(paths[i].stat().st_size for i in todo)
    if total >= ANNOUNCE_BYTES:
        print(f"[lowcomm] checking {len(todo)} data file(s), {total / 1e9:.1f} GB, once: every token id against "
              f"the model's vocabulary and a SHA-256 of every byte (cached in {cache_dir})",
              file=stream, flush=True)
    progress = ScanProgress(stream)
    progress.begin(total, len(todo))
    started = time.perf_counter()
    for i in todo:
        scans[i] = scan_file(paths[i], dtype, cache_dir=cache_dir, progress=progress)
    progress.end()
    elapsed = time.perf_counter() - started
    if elapsed >= SUMMARY_AFTER_S:
        print(f"[lowcomm] scanned {len(todo)} data file(s), {total / 1e6:,.0f} MB in {elapsed:.1f} s "
              f"({total / 1e6 / elapsed:,.0f} MB/s); cached in {cache_dir}", file=stream, flush=True)
    return scans


def model_vocabulary(run: RunConfig) -> tuple[int, str]:
    """The number of token ids the model can be given, and a sentence saying so: its tokenizer's
    vocabulary (``model.vocab_size``), not ``model.embedding_size``, which only pads it."""
    model = run.model
    limit = model.vocab_size
    source = f"model.vocab_size, tokenizer {model.tokenizer}"
    try:
        tokenizer_size = load_tokenizer(model.tokenizer).vocab_size
    except ValueError:
        tokenizer_size = None
    if tokenizer_size is not None and tokenizer_size < limit:
        limit = tokenizer_size
        source = f"its tokenizer {model.tokenizer}'s size; model.vocab_size={model.vocab_size:,}"
    where = f"model={model.name} takes ids below {limit:,} ({source})"
    if model.embedding_size > limit:
        where += (f"; model.embedding_size={model.embedding_size:,} only pads it: ids {limit:,}-"
                  f"{model.embedding_size - 1:,} would train silently on rows no tokenizer emits, larger ones "
                  "crash in a worker")
    return limit, where


def shipped_models() -> list[ModelVocab]:
    """The model options in ``configs/model/``, with their vocabularies."""
    models = []
    for path in sorted((config_dir() / "model").glob("*.yaml")):
        spec = OmegaConf.load(path)
        if "vocab_size" in spec:
            models.append(ModelVocab(path.stem, int(spec.vocab_size), str(spec.get("tokenizer", "?"))))
    return models


def _likely_cause(run: RunConfig, dtype: str, largest: int) -> str:
    """Why a file holds ids the model cannot take, and the override that fixes it, if any."""
    fits = [m for m in shipped_models() if m.vocab_size > largest and m.name != run.model.name]
    tokenizers = []
    for name in available_tokenizers():
        try:
            size = load_tokenizer(name).vocab_size
        except (ValueError, OSError):
            continue
        if size > largest:
            tokenizers.append(f"{name} ({size:,} ids)")
    if run.data.name == "memmap" and dtype == "uint32" and largest >= 1 << 16 and not tokenizers:
        return ("no tokenizer has that many ids: the file is probably uint16 tokens read as uint32 (two ids "
                "read as one); set data.dtype=uint16")
    if fits:
        by_tokenizer: dict[str, list[ModelVocab]] = {}
        for model in sorted(fits, key=lambda m: (m.vocab_size, m.name)):
            by_tokenizer.setdefault(model.tokenizer, []).append(model)
        options = "; ".join(
            f"{' or '.join(f'model={m.name}' for m in group)} (tokenizer {tokenizer}, {group[0].vocab_size:,} ids)"
            for tokenizer, group in by_tokenizer.items())
        return (f"the file was made with another tokenizer than model={run.model.name}'s; models whose "
                f"vocabulary holds id {largest:,}: {options}")
    cause = f"no model in {config_dir() / 'model'} has a vocabulary that holds id {largest:,}"
    if tokenizers:
        cause += (f"; tokenizers that do: {', '.join(tokenizers)}: add a model config with that model.tokenizer "
                  "and a model.vocab_size to match")
    return cause


def _problems(run: RunConfig, dtype: str, scans: list[tuple[FileScan, str]]) -> list[str]:
    problems = []
    seq_len = run.train.seq_len
    for key in dict.fromkeys(key for _, key in scans):
        mine = [scan for scan, k in scans if k == key]
        short = [scan for scan in mine if scan.tokens < seq_len]
        for scan in short[:LISTED_FILES]:
            problems.append(short_file_message(Path(scan.path), scan.tokens, seq_len, key, _short_remedy(run, key)))
        if len(short) > LISTED_FILES:
            problems.append(f"{key}: {len(short) - LISTED_FILES} more file(s) are shorter than one sequence")
        if run.data.name == "memmap":
            swapped = [scan for scan in mine if scan.looks_like_uint32_as_uint16()]
            problems += [
                f"{key}: {scan.path} looks like uint32 tokens read as uint16: "
                f"{100 * scan.odd_small / scan.pairs:.1f}% of the odd uint16 positions sampled hold 0 or 1 (the "
                f"high halves of uint32 ids), against {100 * scan.even_small / scan.pairs:.1f}% of the even ones; "
                "set data.dtype=uint32" for scan in swapped[:LISTED_FILES]]
            if len(swapped) > LISTED_FILES:
                problems.append(f"{key}: {len(swapped) - LISTED_FILES} more file(s) look like uint32 tokens")
    if run.data.name == "memmap":
        problems += _tokenizer_problems(run, [(Path(scan.path), key) for scan, key in scans])
    limit, where = model_vocabulary(run)
    over = [(scan, key) for scan, key in scans if scan.max_id >= limit]
    if over:
        largest = max(scan.max_id for scan, _ in over)
        named = "; ".join(f"{key}: {scan.path} holds token id {scan.max_id:,} (first at token {scan.max_id_at:,} "
                          f"of {scan.tokens:,})" for scan, key in over[:LISTED_FILES])
        more = f"; and {len(over) - LISTED_FILES} more file(s)" if len(over) > LISTED_FILES else ""
        problems.append(f"{named}{more}, but {where}. Likely cause: {_likely_cause(run, dtype, largest)}")
    return problems


def corpus_record(path: Path) -> tuple[Path, dict] | None:
    """The ``meta.json`` that ``lowcomm-prepare-data`` wrote beside a token file, and what it
    holds; None for raw token files (or a record that cannot be read: the scan still checks
    every id against the vocabulary)."""
    try:
        return path.parent / META, read_meta(path.parent)
    except (OSError, ValueError):
        return None


def _tokenizer_problems(run: RunConfig, files: list[tuple[Path, str]]) -> list[str]:
    """A corpus tokenized for another model: its recorded tokenizer (and vocabulary) against the
    model's, once per corpus directory. Every id of a byte-level corpus is also a valid id of a
    50k vocabulary, so the id scan alone lets a 1B model train on bytes, silently."""
    model = run.model
    problems = []
    first = {}
    for path, key in files:  # one record per corpus directory, named by the first key that lists it
        first.setdefault(path.parent, (path, key))
    for path, key in first.values():
        found = corpus_record(path)
        if found is None or not isinstance(found[1], dict) or "tokenizer" not in found[1]:
            continue
        record, meta = found
        tokenizer = str(meta["tokenizer"])
        vocabulary = meta.get("vocab_size")
        if vocabulary is None:
            try:
                vocabulary = load_tokenizer(tokenizer).vocab_size
            except (ValueError, OSError):
                vocabulary = None
        if tokenizer == model.tokenizer and (vocabulary is None or vocabulary <= model.vocab_size):
            continue
        theirs = f"tokenizer {tokenizer}" + (f", {vocabulary:,} ids" if vocabulary is not None else "")
        fits = [m.name for m in shipped_models() if m.tokenizer == tokenizer
                and (vocabulary is None or m.vocab_size >= vocabulary)]
        fix = (f"train {' or '.join(f'model={name}' for name in fits)} on it" if fits
               else f"add a model config with model.tokenizer={tokenizer}")
        problems.append(
            f"{key}: {path.parent} was tokenized with {theirs} ({record}), but model={model.name} reads tokenizer "
            f"{model.tokenizer} ({model.vocab_size:,} ids); {fix}, or tokenize the text again for this model "
            f"(lowcomm-prepare-data --tokenizer {model.tokenizer} ...)")
    return problems


def _short_remedy(run: RunConfig, key: str) -> str:
    if run.data.name == "memmap":
        return f"remove it from {key} or lower train.seq_len"
    if run.data.name == "text" and "validation" in key:
        return "raise data.val_fraction, add documents, or lower train.seq_len"
    if run.data.name == "text":
        return "add documents or lower train.seq_len"
    return "lower train.seq_len"
