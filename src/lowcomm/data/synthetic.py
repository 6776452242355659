"""The embedded default corpus: documents from a mixture of Markov chains, written in the byte
tokenizer, with an exact Bayes loss floor.

Generative process (all from one seed):
- ``n_topics`` topics, each a first-order Markov chain over a small printable alphabet; the
  rows of every transition matrix are drawn from a sparse Dirichlet, so topics are distinct
  and each is far from uniform;
- a document picks a topic uniformly and a length uniformly in ``doc_length``, emits its
  characters from that topic's chain, then EOS;
- documents are packed so that every instance of ``seq_len`` tokens *starts* a document (the
  last document of an instance is cut at its end). Nothing the model could use lies outside
  its window, so the Bayes-optimal prediction of each target given the tokens before it in the
  instance is computable exactly:
      p(x_t | x_<t) = (1 - h(j)) * sum_z P(z | doc so far) * T_z[x_{t-1}, x_t]   for a character,
      p(EOS | x_<t) = h(j) = P(len = j | len >= j),   j = characters of the document so far.
A model must learn the chains and infer the topic in context, so optimizers separate within a
few hundred steps, and the floor says how far from perfect each one is.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lowcomm.data.memmap import DataError
from lowcomm.models.tokenizer import BYTES_EOS

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,'\n-"
META = "meta.json"


@dataclass(frozen=True)
class SyntheticSpec:
    seed: int = 1234
    n_topics: int = 8
    concentration: float = 0.15
    doc_length: tuple[int, int] = (16, 192)
    train_tokens: int = 4_000_000
    val_tokens: int = 131_072
    seq_len: int = 128

    @classmethod
    def from_data_config(cls, data, seq_len: int) -> SyntheticSpec:
        """The spec of a ``data=synthetic`` config section (``lowcomm.config.DataSpec``)."""
        return cls(seed=data.seed, n_topics=data.n_topics, concentration=data.concentration,
                   doc_length=tuple(data.doc_length), train_tokens=data.train_tokens,
                   val_tokens=data.val_tokens, seq_len=seq_len)

    def validate(self) -> list[str]:
        errors = []
        lo, hi = self.doc_length
        if not 1 <= lo <= hi:
            errors.append(f"data.doc_length must be [min, max] with 1 <= min <= max, got {list(self.doc_length)}")
        if self.n_topics < 1:
            errors.append(f"data.n_topics must be >= 1, got {self.n_topics}")
        if self.concentration <= 0:
            errors.append(f"data.concentration must be > 0, got {self.concentration}")
        for key in ("train_tokens", "val_tokens"):
            if getattr(self, key) < self.seq_len:
                errors.append(f"data.{key} ({getattr(self, key)}) must hold at least one sequence of {self.seq_len}")
        return errors

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


class MarkovMixture:
    """The generator's parameters: per topic, a start distribution and a transition matrix."""

    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 0])
        n_chars = len(ALPHABET)
        # row n_chars is the "document start" state
        self.transitions = rng.dirichlet(np.full(n_chars, spec.concentration), size=(spec.n_topics, n_chars + 1))
        self.token_ids = np.frombuffer(ALPHABET.encode(), dtype=np.uint8).astype(np.int64)
        self.start_state = n_chars
        lo, hi = spec.doc_length
        lengths = np.arange(hi + 1)
        # hazard h(j) = P(len = j | len >= j) for len ~ Uniform{lo..hi}
        self.hazard = np.where(lengths >= lo, 1.0 / np.maximum(hi - lengths + 1, 1), 0.0)

    def sample(self, n_instances: int, rng: np.random.Generator) -> np.ndarray:
        """(n_instances, seq_len) token ids, every instance starting a document."""
        spec = self.spec
        lo, hi = spec.doc_length
        out = np.empty((n_instances, spec.seq_len), dtype=np.int64)
        cdf = np.cumsum(self.transitions, axis=-1)
        cdf[..., -1] = 1.0
        topic = rng.integers(spec.n_topics, size=n_instances)
        length = rng.integers(lo, hi + 1, size=n_instances)
        seen = np.zeros(n_instances, dtype=np.int64)
        prev = np.full(n_instances, self.start_state)
        for t in range(spec.seq_len):
            ended = seen == length
            uniform = rng.random(n_instances)
            chars = (cdf[topic, prev] < uniform[:, None]).sum(axis=1)
            out[:, t] = np.where(ended, BYTES_EOS, self.token_ids[chars])
            # a finished document is followed by a fresh one: new topic, new length
            new_topic = rng.integers(spec.n_topics, size=n_instances)
            new_length = rng.integers(lo, hi + 1, size=n_instances)
            topic = np.where(ended, new_topic, topic)
            length = np.where(ended, new_length, length)
            prev = np.where(ended, self.start_state, chars)
            seen = np.where(ended, 0, seen + 1)
        return out

    def bayes_nll(self, tokens: np.ndarray) -> np.ndarray:
        """Exact -log p(x_t | x_<t in the instance) for t >= 1, shape (n, seq_len - 1)."""
        n, seq_len = tokens.shape
        char_of = np.full(BYTES_EOS + 1, -1, dtype=np.int64)
        char_of[self.token_ids] = np.arange(len(self.token_ids))
        log_prior = np.full(self.spec.n_topics, -np.log(self.spec.n_topics))
        log_t = np.log(self.transitions)  # (Z, S, C)
        first = char_of[tokens[:, 0]]
        log_post = log_prior + log_t[:, self.start_state, first].T  # (n, Z)
        prev = first
        seen = np.ones(n, dtype=np.int64)
        nll = np.empty((n, seq_len - 1))
        for t in range(1, seq_len):
            target = tokens[:, t]
            is_eos = target == BYTES_EOS
            after_eos = prev == self.start_state
            hazard = np.where(after_eos, 0.0, self.hazard[np.minimum(seen, len(self.hazard) - 1)])
            post = np.exp(log_post - log_post.max(axis=1, keepdims=True))
            post /= post.sum(axis=1, keepdims=True)
            char = np.where(is_eos, 0, char_of[target])
            p_char = (post * self.transitions[:, prev, char].T).sum(axis=1)
            p = np.where(is_eos, hazard, (1.0 - hazard) * p_char)
            nll[:, t - 1] = -np.log(p)
            # posterior update: a character sharpens it, EOS resets it for the next document
            log_post = np.where(
                is_eos[:, None], log_prior, log_post + log_t[:, prev, char].T
            )
            prev = np.where(is_eos, self.start_state, char)
            seen = np.where(is_eos, 0, seen + 1)
        return nll


def synthetic_dir(run_root: str | os.PathLike, spec: SyntheticSpec) -> Path:
    return Path(run_root) / "data" / f"synthetic-{spec.digest()}"


def ensure_synthetic(run_root: str | os.PathLike, spec: SyntheticSpec) -> Path:
    """Write the corpus once (atomically: a temp dir renamed into place) and return its dir.

    Safe to call from many processes: the loser of a race discards its copy. A write that fails
    (a full disk, a quota) removes its temp dir and raises DataError naming the filesystem."""
    target = synthetic_dir(run_root, spec)
    if (target / META).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_attempts(target)
    needed = 2 * (spec.train_tokens + spec.val_tokens)  # uint16; meta.json is a few hundred bytes
    free = shutil.disk_usage(target.parent).free
    if free < needed + (1 << 20):
        raise DataError(_no_space_message(target, needed, free))
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model = MarkovMixture(spec)
        meta = {"spec": asdict(spec), "tokenizer": "bytes", "dtype": "uint16", "alphabet": ALPHABET}
        for split, n_tokens, stream in (("train", spec.train_tokens, 1), ("val", spec.val_tokens, 2)):
            tokens = model.sample(n_tokens // spec.seq_len, np.random.default_rng([spec.seed, stream]))
            # write(), not a writable memmap: a full disk is then an OSError here, where a memmap
            # dies of SIGBUS with nothing said and its temp dir left behind
            with (tmp / f"{split}.bin").open("wb") as handle:
                handle.write(tokens.reshape(-1).astype(np.uint16).tobytes())
            meta[f"{split}_tokens"] = int(tokens.size)
            if split == "val":
                meta["val_bayes_floor"] = float(model.bayes_nll(tokens).mean())
        (tmp / META).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / META).is_file():
                raise
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(_no_space_message(target, needed, free, filled_up=True)) from exc
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# A temp dir this old is a write that died (killed, or a SIGBUS of an older lowcomm), not one in flight.
STALE_ATTEMPT_S = 3600


def _remove_stale_attempts(target: Path) -> None:
    for attempt in target.parent.glob(f".{target.name}.*"):
        try:
            if time.time() - attempt.stat().st_mtime > STALE_ATTEMPT_S:
                shutil.rmtree(attempt, ignore_errors=True)
        except OSError:
            pass


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (which need not exist yet)."""
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def _no_space_message(target: Path, needed: int, free: int, filled_up: bool = False) -> str:
    disk = mount_point(target.parent)
    where = (f"the filesystem mounted at {disk} filled up while it was written ({free / 1e6:,.1f} MB were free "
             "when it started)" if filled_up else f"the filesystem mounted at {disk} has {free / 1e6:,.1f} MB free")
    return (f"no space left to write the synthetic corpus ({needed / 1e6:,.1f} MB) to {target}: {where}; "
            "free some space, or set run_root to a directory on another disk")


def read_meta(directory: Path) -> dict:
    return json.loads((directory / META).read_text())
