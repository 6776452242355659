"""lm-eval's view of a lowcomm model: log-likelihoods of continuations, batched.

:class:`LowcommLM` is an ``lm_eval.api.model.TemplateLM`` rather than lm-eval's ``HFLM``. HFLM
needs a Hugging Face ``PreTrainedModel`` and ``PreTrainedTokenizer``; lowcomm's tokenizers are
its own (the tiny model's byte tokenizer has no HF counterpart, the OLMo ones are loaded with the
``tokenizers`` library), and TemplateLM only asks for ``encode`` and an end-of-text id. It also
needs nothing of the model but ``forward(input_ids).logits``, so any lowcomm model works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lowcomm.eval.checkpoints import Checkpoint, load_checkpoint_model, load_model_spec, select_checkpoints
from lowcomm.models import ModelSpec, load_tokenizer


@dataclass(frozen=True)
class ScoringWindow:
    """One forward pass's worth of a request: the model reads ``input_ids`` and the predictions at
    its last ``len(target_ids)`` positions score ``target_ids``."""

    request_index: int
    input_ids: list[int]
    target_ids: list[int]


def scoring_windows(
    request_index: int, context_ids: Sequence[int], continuation_ids: Sequence[int], max_length: int
) -> list[ScoringWindow]:
    """Windows of at most ``max_length`` input tokens that score each continuation token once.

    The usual case is one window: context and continuation together, the context truncated from
    the left so that the input fits. A continuation longer than ``max_length`` tokens (possible
    with short-context models, e.g. the byte-level tiny model on PIQA) is cut from its end into
    chunks of ``max_length`` tokens, each scored from the ``max_length`` tokens before its last
    one, so every token still counts and the final tokens see the longest context.
    """
    if not context_ids:
        raise ValueError("a scoring request needs at least one context token to condition on")
    tokens = [*context_ids, *continuation_ids]
    first_target = len(context_ids)
    windows = []
    end = len(tokens)
    while end > first_target:
        n_targets = min(max_length, end - first_target)
        start = max(0, end - 1 - max_length)
        windows.append(ScoringWindow(request_index, tokens[start : end - 1], tokens[end - n_targets : end]))
        end -= n_targets
    return windows[::-1]


class LowcommLM(TemplateLM):
    """A lowcomm (OLMo) model and tokenizer behind lm-eval's LM interface.

    Args:
        model: maps ``input_ids`` (batch, length) to an output with ``.logits`` (batch, length,
            vocabulary); causal, so right padding does not change earlier positions.
        tokenizer: has ``encode(text) -> list[int]``, ``eos_token_id`` and ``name``.
        max_length: the longest input the model reads (its ``max_sequence_length``).
        batch_size: windows per forward pass.
        device: where the model lives.

    ``progress``: when set, called as ``progress(windows_scored, windows_total)`` after each
    forward pass, and lm-eval's bars and this class's own are off (``lowcomm-eval`` shows one
    progress line for all of its checkpoints and tasks).
    """

    progress: Callable[[int, int], None] | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_length: int,
        batch_size: int = 32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"max_length and batch_size must be positive, got {max_length} and {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self._device = torch.device(device)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        *,
        device: str | torch.device = "cpu",
        batch_size: int = 32,
        spec: ModelSpec | None = None,
    ) -> LowcommLM:
        """The model of ``checkpoint``'s run with the checkpoint's weights; ``spec`` defaults to the
        ``model`` section of the run's ``config.yaml``."""
        spec = spec if spec is not None else load_model_spec(checkpoint.run_dir)
        model = load_checkpoint_model(checkpoint, device, spec)
        return cls(
            model,
            load_tokenizer(spec.tokenizer),
            max_length=spec.max_sequence_length,
            batch_size=batch_size,
            device=device,
        )

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, step: int | None = None, **kwargs) -> LowcommLM:
        """The latest complete checkpoint of ``run_dir``, or the one at ``step``."""
        (checkpoint,) = select_checkpoints(run_dir, step=step)
        return cls.from_checkpoint(checkpoint, **kwargs)

    # ------------------------------------------------------------------ tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        # lm-eval keys its request cache by this name.
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:  # noqa: ARG002
        # lowcomm tokenizers add no special tokens: there is nothing to switch on or off.
        return self.tokenizer.encode(string)

    # ------------------------------------------------------------------- scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's evaluator calls this without ``disable_tqdm``: its "Tokenizing inputs" bar
        # is switched off here when the progress is reported to ``progress``.
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.progress is not None)

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs,  # noqa: ARG002 - lm-eval's signature
    ) -> list[tuple[float, bool]]:
        windows = [
            window
            for index, (_, context_ids, continuation_ids) in enumerate(requests)
            for window in scoring_windows(index, context_ids, continuation_ids, self.max_length)
        ]
        results = self._score(windows, len(requests), disable_tqdm)
        for (strings, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents (perplexity tasks), in lm-eval's rolling windows:
        the first window is conditioned on the end-of-text token, each token is scored once."""
        windows = []
        for index, (text,) in enumerate(request.args for request in requests):
            for context_ids, target_ids in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.extend(scoring_windows(index, context_ids, target_ids, self.max_length))
        results = [logprob for logprob, _ in self._score(windows, len(requests), disable_tqdm)]
        for request, logprob in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, logprob)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:  # noqa: ARG002
        raise NotImplementedError(
            "LowcommLM scores multiple-choice and perplexity tasks only (loglikelihood, "
            "loglikelihood_rolling); generative tasks are not supported"
        )

    @torch.inference_mode()
    def _score(
        self, windows: list[ScoringWindow], n_requests: int, disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        """Sum of target log-probabilities per request, and whether every target is the argmax.

        Windows run longest first: batches hold similar lengths (little padding) and the largest
        batch comes first, so an out-of-memory error shows at once rather than at the end.
        """
        logprob_sums = [0.0] * n_requests
        all_greedy = [True] * n_requests
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i].input_ids))
        bar = tqdm(total=len(windows), desc="Scoring", unit="window",
                   disable=disable_tqdm or self.progress is not None)
        scored = 0
        for batch_start in range(0, len(order), self.batch_size):
            batch = [windows[i] for i in order[batch_start : batch_start + self.batch_size]]
            padded_length = len(batch[0].input_ids)
            input_ids = torch.full((len(batch), padded_length), self.eot_token_id, dtype=torch.long)
            for row, window in enumerate(batch):
                input_ids[row, : len(window.input_ids)] = torch.tensor(window.input_ids)
            # The logits keep all of the model's output columns (including vocabulary padding)
            # so the probabilities are the ones the training loss was computed with.
            logits = self.model(input_ids.to(self.device)).logits
            batch_logprobs, batch_greedy = [], []
            for row, window in enumerate(batch):
                n_inputs, n_targets = len(window.input_ids), len(window.target_ids)
                logprobs = F.log_softmax(logits[row, n_inputs - n_targets : n_inputs].float(), dim=-1)
                targets = torch.tensor(window.target_ids, device=logprobs.device)
                batch_logprobs.append(logprobs.gather(1, targets[:, None]).sum())
                batch_greedy.append((logprobs.argmax(dim=-1) == targets).all())
            # One device-to-host copy per batch, not two per window.
            for window, logprob, greedy in zip(
                batch, torch.stack(batch_logprobs).tolist(), torch.stack(batch_greedy).tolist(), strict=True
            ):
                logprob_sums[window.request_index] += logprob
                all_greedy[window.request_index] &= greedy
            bar.update(len(batch))
            scored += len(batch)
            if self.progress is not None:
                self.progress(scored, len(windows))
        bar.close()
        return list(zip(logprob_sums, all_greedy, strict=True))

    def get_model_info(self) -> dict:
        """Shown by lm-eval in its results' ``config``."""
        return {
            "model_class": type(self.model).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "tokenizer": self.tokenizer.name,
            "max_length": self.max_length,
        }
