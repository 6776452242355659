"""How many entries of Streaming DiLoCo's outer gradient E3M0 flushes to zero, with one scale per
tensor against one scale per row, on OLMo's real shapes and a real outer gradient.

E3M0 keeps magnitudes s, s/2, ..., s/64 of its scale s and rounds anything below s/128 to 0: a
dynamic range of 2**6. With one scale per tensor, every entry more than 128 times smaller than
the tensor's largest is lost; with one scale per row (torchft's choice), only entries 128 times
smaller than their own row's largest.

The outer gradient is the real one: OLMo-300M (or ``--model``) built by lowcomm, ``--steps``
inner AdamW steps at Streaming DiLoCo's inner settings (configs/optimizer/streaming_diloco.yaml)
on English text tokenized with OLMo's tokenizer (this repository's own Markdown: README and
results/, offline), Delta = theta_start - theta_after. Counted per tensor kind over the entries
that are not exactly zero (rows of tokens never seen are zero in Delta and stay zero either way):

    flushed = #{x != 0 and decode(encode(x)) == 0} / #{x != 0}

    .venv/bin/python benchmarks/e3m0_flush.py                   # OLMo-300M, 4 steps of 2 x 256 tokens
    .venv/bin/python benchmarks/e3m0_flush.py --model olmo_1b --steps 2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _kind(name: str) -> str:
    """The tensor's kind: embedding, or the block weight's name (att_proj, ff_out, ...)."""
    if "wte" in name or "emb" in name:
        return "embedding"
    match = re.search(r"\.(\w+)\.weight$", name)
    return match.group(1) if match else name


def _text_tokens(tokenizer, needed: int) -> torch.Tensor:
    files = [REPO / "README.md", *sorted((REPO / "results").rglob("*.md")), *sorted((REPO / "sweeps").glob("*.yaml"))]
    ids: list[int] = []
    for path in files:
        ids += tokenizer.encode(path.read_text())
    if len(ids) < needed:
        ids = ids * (needed // max(1, len(ids)) + 1)
    return torch.tensor(ids[:needed])


def outer_gradient(model_name: str, steps: int, batch: int, seq: int, threads: int,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the outer gradient after ``steps`` inner steps, the first step's raw gradient)."""
    from omegaconf import OmegaConf

    from lowcomm.config.compose import compose
    from lowcomm.models import ModelSpec, build_model
    from lowcomm.models.tokenizer import load_tokenizer
    from lowcomm.optim.grouping import adamw
    from lowcomm.strategies.streaming_diloco import StreamingDiLoCoConfig

    torch.set_num_threads(threads)
    raw = OmegaConf.to_container(compose([f"model={model_name}"]), resolve=True)
    spec = ModelSpec(**raw["model"])
    model = build_model(spec, "cpu", seed=0)
    start = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    optimizer = adamw(model, StreamingDiLoCoConfig.defaults())
    tokens = _text_tokens(load_tokenizer(raw["model"]["tokenizer"]),
                          steps * batch * (seq + 1)).view(steps, batch, seq + 1)
    for step in range(steps):
        began = time.perf_counter()
        logits = model(tokens[step, :, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[step, :, 1:].reshape(-1))
        loss.backward()
        if step == 0:
            first = {name: p.grad.detach().clone() for name, p in model.named_parameters() if name in start}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"inner step {step + 1}/{steps}: loss {loss.item():.3f}, {time.perf_counter() - began:.1f} s",
              file=sys.stderr, flush=True)
    return {name: start[name] - p.detach() for name, p in model.named_parameters() if name in start}, first


def flushed_fractions(deltas: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    from lowcomm.compress.e3m0 import E3M0

    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, delta in deltas.items():
        kind = _kind(name)
        nonzero = delta != 0
        counts[kind]["nonzero"] += int(nonzero.sum())
        counts[kind]["entries"] += delta.numel()
        for label, codec in (("per_tensor", E3M0(rowwise=False)), ("per_row", E3M0())):
            decoded = codec.decode([codec.encode(delta)])
            counts[kind][label] += int((nonzero & (decoded == 0)).sum())
    total = defaultdict(int)
    for kind_counts in counts.values():
        for key, value in kind_counts.items():
            total[key] += value
    counts["all"] = total
    return {kind: {"entries": c["entries"], "nonzero": c["nonzero"],
                   "per_tensor": c["per_tensor"] / max(1, c["nonzero"]), "per_row": c["per_row"] / max(1, c["nonzero"])}
            for kind, c in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="olmo_300m", help="model config name (default olmo_300m)")
    parser.add_argument("--steps", type=int, default=4, help="inner AdamW steps before Delta is taken")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    delta, gradient = outer_gradient(args.model, args.steps, args.batch, args.seq, args.threads)
    tables = {"outer_gradient": flushed_fractions(delta), "first_gradient": flushed_fractions(gradient)}
    titles = {"outer_gradient": f"the outer gradient after {args.steps} AdamW steps (what Streaming DiLoCo sends)",
              "first_gradient": "the first step's raw gradient (heavier-tailed: what a DDP-style quantizer would see)"}
    for key, fractions in tables.items():
        print(f"\nE3M0 on {titles[key]}, {args.model}, {args.batch} x {args.seq} tokens per step: "
              "share of the nonzero entries decoded to 0")
        print(f"{'tensors':<12} {'entries':>13} {'nonzero':>13} {'per-tensor scale':>17} {'per-row scale':>14}")
        for kind, row in fractions.items():
            print(f"{kind:<12} {row['entries']:13,d} {row['nonzero']:13,d} {100 * row['per_tensor']:16.2f}% "
                  f"{100 * row['per_row']:13.2f}%")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "steps": args.steps, "batch": args.batch,
                                         "seq": args.seq, **tables}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
