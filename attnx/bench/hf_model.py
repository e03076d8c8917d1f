"""`attnx bench --ops hf`: a small Llama-style transformers model (random weights) run with
attn_implementation "attnx" and "sdpa": forward (prefill) and greedy `generate`, tokens per
second.

Both implementations are timed in one process, interleaved round-robin (`timing.interleaved`),
on two copies of one model, so that machine noise falls on both alike: read the ratio. Left
padding (row b shorter by b/8 of the prompt) makes the masks real; without it the causal
layers need no mask at all and one-token steps run on attnx's decoding kernel.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
import transformers

import attnx

from . import machine, timing

SCHEMA = "attnx-bench-hf/1"
IMPLEMENTATIONS = ("attnx", "sdpa")


@dataclass(frozen=True)
class ModelCase:
    task: str  # "forward" (one pass over the prompt) or "generate" (greedy, with the KV cache)
    batch: int
    prompt: int  # prompt length (of the longest row)
    new_tokens: int  # generate only
    padded: bool  # left padding: row b is shorter by b * prompt // 8 tokens

    def label(self) -> str:
        gen = f" +{self.new_tokens}" if self.task == "generate" else ""
        pad = " left-padded" if self.padded else ""
        return f"{self.task} B{self.batch} L{self.prompt}{gen}{pad}"


def model_config(quick: bool) -> transformers.LlamaConfig:
    """Llama's shape at a size a CPU generates with in real time: 8 query heads of 64 sharing
    2 key/value heads (GQA), 4 layers; `quick`: a toy of the same shape that runs in seconds."""
    if quick:
        return transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)


def cases(quick: bool) -> list:
    if quick:
        return [ModelCase("forward", 2, 32, 0, True), ModelCase("generate", 2, 16, 4, True)]
    return [ModelCase("forward", 1, 2048, 0, False), ModelCase("forward", 4, 512, 0, True),
            ModelCase("generate", 1, 512, 128, False), ModelCase("generate", 4, 256, 64, True)]


def inputs(case: ModelCase, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (case.batch, case.prompt), generator=g)
    mask = torch.ones_like(ids)
    if case.padded:
        for b in range(case.batch):
            mask[b, :b * case.prompt // 8] = 0
    return ids, mask


def _step(model, case: ModelCase, ids, mask):
    if case.task == "forward":
        return lambda: model(input_ids=ids, attention_mask=mask, use_cache=False)
    return lambda: model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens,
                                  pad_token_id=0)


def tokens(case: ModelCase, mask) -> int:
    """Tokens a run makes: the real prompt tokens of a forward, the new ones of a generate."""
    return int(mask.sum()) if case.task == "forward" else case.batch * case.new_tokens


def run(args, argv) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    attnx.hf.register()
    config = model_config(args.quick)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    models = {}
    for impl in IMPLEMENTATIONS:
        models[impl] = copy.deepcopy(base)
        models[impl].set_attn_implementation(impl)
    repeats = args.repeats or (3 if args.quick else 5)
    scale = 0.2 if args.quick else 1.0
    doc = machine.describe("cpu")
    doc.update(schema=SCHEMA, settings={
        "argv": list(argv), "repeats": repeats, "timing": timing.__doc__.strip().splitlines()[0],
        "transformers": transformers.__version__,
        "model": {k: getattr(config, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")}
        | {"class": "LlamaForCausalLM", "dtype": "float32"}})
    doc["load_average_before"] = machine.load_average()
    results = []
    with torch.inference_mode():
        for case in cases(args.quick):
            ids, mask = inputs(case, config.vocab_size)
            steps = {impl: _step(models[impl], case, ids, mask) for impl in IMPLEMENTATIONS}
            same = None
            if case.task == "generate":  # the numbers compare like with like only if equal
                out = {impl: steps[impl]() for impl in IMPLEMENTATIONS}
                same = torch.equal(out["attnx"], out["sdpa"])
            timings = timing.interleaved(steps, "cpu", repeats, scale)
            n = tokens(case, mask)
            for impl in IMPLEMENTATIONS:
                t = timings[impl]
                row = {"op": "hf", "provider": impl, "pass": case.task, "case": asdict(case),
                       "tokens": n, "time": t.as_dict(), "same_tokens_as_sdpa": same}
                if t.error is None:
                    row["tokens_per_s"] = n / t.median
                results.append(row)
    doc["results"] = results
    doc["load_average_after"] = machine.load_average()
    return doc


def table(doc: dict) -> str:
    """tokens/s of each implementation per case (median times), and attnx's over sdpa's: of the
    medians, and of the best times (the rounds least disturbed on a shared machine)."""
    head = ["case", "attnx tok/s", "sdpa tok/s", "attnx / sdpa", "best / best",
            "attnx min-max ms", "sdpa min-max ms", "same tokens"]
    by_case = {}
    for r in doc["results"]:
        by_case.setdefault(ModelCase(**r["case"]).label(), {})[r["provider"]] = r
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rows in by_case.items():
        a, s = rows["attnx"], rows["sdpa"]

        def rate(r):
            if "tokens_per_s" not in r:
                return f"error: {r['time']['error']}"
            return f"{r['tokens_per_s']:.0f}"

        def spread(r):
            t = r["time"]
            return f"{t['min_ms']:.0f}-{t['max_ms']:.0f}" if "min_ms" in t else "-"
        both = "tokens_per_s" in a and "tokens_per_s" in s
        ratio = f"{a['tokens_per_s'] / s['tokens_per_s']:.2f}" if both else "-"
        best = f"{s['time']['min_ms'] / a['time']['min_ms']:.2f}" if both else "-"
        same = {None: "-", True: "yes", False: "NO"}[a["same_tokens_as_sdpa"]]
        lines.append("| " + " | ".join([label, rate(a), rate(s), ratio, best, spread(a),
                                         spread(s), same]) + " |")
    return "\n".join(lines)


def header(doc: dict) -> str:
    sw, m = doc["software"], doc["settings"]["model"]
    return (f"device: {doc['device']['name']} (cpu, {doc['device']['torch_threads']} threads), "
            f"{doc['date']}, load {doc['load_average_before']}\n"
            f"torch {sw['torch']}, transformers {doc['settings']['transformers']}, attnx "
            f"{sw['attnx']} ({sw['attnx_git_commit'] or 'no git commit'})\n"
            f"model: LlamaForCausalLM, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} kv heads, float32, "
            f"random weights")
