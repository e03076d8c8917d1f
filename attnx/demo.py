"""`attnx demo`: train a small attention seq2seq model on a task it generates, plot alignments.

The date task rewrites dates written in many human formats ("22 Nov 2026",
"November 22, 2026", "22/11/2026", "2026 Nov 22", "Sun 22 Nov 2026", ...) as "2026-11-22".
A bidirectional-GRU encoder and an attention decoder (attnx.nn.Seq2Seq) train on the CPU;
the held-out exact-match accuracy is printed and the alignment matrices of a few held-out
examples are drawn as a heatmap, like Figure 3 of Bahdanau et al. (2015).
The reverse task (reverse a string of letters) is a smaller sanity check.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .cli import positive_int
from .nn import Seq2Seq
from .nn.seq2seq_attention import SCORES

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>"]

_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]


def _ordinal(d: int) -> str:
    suffix = "th" if 10 <= d % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(d % 10, "th")
    return f"{d}{suffix}"


_DATE_FORMATS: Sequence[Callable[[dt.date], str]] = (
    lambda x: f"{x.day} {_MONTHS[x.month - 1][:3]} {x.year}",
    lambda x: f"{x.day} {_MONTHS[x.month - 1]} {x.year}",
    lambda x: f"{_MONTHS[x.month - 1]} {x.day}, {x.year}",
    lambda x: f"{_MONTHS[x.month - 1][:3]} {_ordinal(x.day)}, {x.year}",
    lambda x: f"{x.day:02d}/{x.month:02d}/{x.year}",
    lambda x: f"{x.day}.{x.month}.{x.year}",
    lambda x: f"{x.year} {_MONTHS[x.month - 1][:3]} {x.day}",
    lambda x: f"{x.year}/{x.month:02d}/{x.day:02d}",
    lambda x: f"{x.strftime('%a')} {x.day} {_MONTHS[x.month - 1][:3]} {x.year}",
    lambda x: f"{x.strftime('%A')}, {_MONTHS[x.month - 1]} {_ordinal(x.day)} {x.year}",
    lambda x: f"{x.day}-{_MONTHS[x.month - 1][:3].upper()}-{x.year % 100:02d}" if x.year >= 2000 else
              f"{x.day}-{_MONTHS[x.month - 1][:3].upper()}-{x.year}",
)


# The most held-out examples: a small part of either task's distinct inputs (the date task has
# ~400k), so that drawing them, and training batches from the rest, ends quickly.
MAX_TEST_SIZE = 20000


def date_pair(rng: random.Random) -> Tuple[str, str]:
    day = dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(365 * 100 + 24))
    return rng.choice(_DATE_FORMATS)(day), day.isoformat()


def reverse_pair(rng: random.Random) -> Tuple[str, str]:
    s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 12)))
    return s, s[::-1]


TASKS = {"date": date_pair, "reverse": reverse_pair}


class Vocab:
    def __init__(self, chars: str):
        self.itos = SPECIALS + sorted(set(chars))
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def encode(self, s: str) -> List[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(SPECIALS):
                out.append(self.itos[i])
        return "".join(out)


def batchify(pairs, src_vocab: Vocab, tgt_vocab: Vocab):
    """-> src (B, S) padded, tgt_in (B, T) = BOS + target, tgt_out (B, T) = target + EOS."""
    src = [torch.tensor(src_vocab.encode(s)) for s, _ in pairs]
    tgt = [tgt_vocab.encode(t) for _, t in pairs]
    src = torch.nn.utils.rnn.pad_sequence(src, batch_first=True, padding_value=PAD)
    tgt_in = torch.nn.utils.rnn.pad_sequence([torch.tensor([BOS] + t) for t in tgt], batch_first=True,
                                             padding_value=PAD)
    tgt_out = torch.nn.utils.rnn.pad_sequence([torch.tensor(t + [EOS]) for t in tgt], batch_first=True,
                                              padding_value=PAD)
    return src, tgt_in, tgt_out


class ProgressBar:
    """A one-line text bar on stderr (no dependency)."""

    def __init__(self, total: int, width: int = 30, stream=sys.stderr):
        self.total, self.width, self.stream = total, width, stream
        self.start = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        frac = done / max(self.total, 1)
        fill = int(self.width * frac)
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} "
                          f"{elapsed:5.1f}s {note}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def evaluate(model: Seq2Seq, pairs, src_vocab: Vocab, tgt_vocab: Vocab, max_len: int,
             batch_size: int = 500):
    """Exact-match accuracy of greedy decoding, and the predictions."""
    model.eval()
    preds = []
    for i in range(0, len(pairs), batch_size):
        src, _, _ = batchify(pairs[i:i + batch_size], src_vocab, tgt_vocab)
        tokens, _ = model.greedy(src, max_len)
        preds += [tgt_vocab.decode(row.tolist()) for row in tokens]
    model.train()
    correct = sum(p == t for p, (_, t) in zip(preds, pairs))
    return correct / max(len(pairs), 1), preds


def plot_alignments(model: Seq2Seq, pairs, src_vocab: Vocab, tgt_vocab: Vocab, max_len: int,
                    path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model.eval()
    src, _, _ = batchify(pairs, src_vocab, tgt_vocab)
    tokens, weights = model.greedy(src, max_len)
    model.train()
    fig, axes = plt.subplots(1, len(pairs), figsize=(3.4 * len(pairs), 4.2), squeeze=False)
    for ax, (s, _), row, w in zip(axes[0], pairs, tokens, weights):
        out = tgt_vocab.decode(row.tolist())
        shown = w[:len(out) + 1, :len(s)].numpy()  # the output characters and EOS
        ax.imshow(shown, cmap="gray", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(s)))
        ax.set_xticklabels(list(s.replace(" ", "\u2423")), fontsize=8)
        ax.set_yticks(range(len(out) + 1))
        ax.set_yticklabels(list(out) + ["</s>"], fontsize=8)
        ax.set_xlabel("input")
        ax.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False)
    axes[0][0].set_ylabel("output")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {x}")
    return x


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnx demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="date")
    p.add_argument("--score", choices=SCORES, default="additive",
                   help="alignment score of the decoder's attention (default: additive)")
    p.add_argument("--style", choices=("bahdanau", "luong"), default="bahdanau")
    p.add_argument("--rnn", choices=("gru", "lstm"), default="gru")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps (default 300, --quick 40)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--hidden", type=positive_int, default=64, help="encoder hidden size per direction")
    p.add_argument("--attn-dim", type=positive_int, default=64, help="attention dim of the additive score")
    p.add_argument("--lr", type=_positive_float, default=4e-3)
    p.add_argument("--test-size", type=positive_int, default=None,
                   help=f"held-out examples (default 1000, --quick 200; at most {MAX_TEST_SIZE}: "
                        "training draws from the inputs left)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (default 1: the matrices are small, and extra OpenMP "
                        "threads only slow the run down, badly so on a busy machine)")
    p.add_argument("--out", default="attnx_alignment.png", help="path of the heatmap PNG")
    p.add_argument("--quick", action="store_true", help="a short run (seconds) for smoke tests")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    # refused now, not after the training run
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        p.error(f"--out: no folder {folder!r} to write {os.path.basename(args.out)!r} into")
    if os.path.isdir(args.out):
        p.error(f"--out: expected the path of a file to write, got the folder {args.out!r}")
    ext = os.path.splitext(args.out)[1].lower()
    if ext not in ("", ".png", ".pdf", ".svg"):
        p.error(f"--out: expected a .png, .pdf or .svg file, got {args.out!r}")
    if not ext:  # (matplotlib adds it: the path said below is the file's)
        args.out += ".png"
    if args.test_size is not None and args.test_size > MAX_TEST_SIZE:
        # the date task has ~400k distinct inputs: drawing as many distinct ones never ended
        p.error(f"--test-size: expected at most {MAX_TEST_SIZE}, got {args.test_size}")
    steps = args.steps if args.steps is not None else (40 if args.quick else 300)
    test_size = args.test_size if args.test_size is not None else (200 if args.quick else 1000)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    make = TASKS[args.task]

    test = []
    seen = set()
    while len(test) < test_size:
        pair = make(rng)
        if pair[0] not in seen:
            seen.add(pair[0])
            test.append(pair)
    # The vocabularies come from a large sample so that no held-out character is unknown.
    probe = random.Random(args.seed + 1)
    sample = test + [make(probe) for _ in range(5000)]
    src_vocab = Vocab("".join(s for s, _ in sample))
    tgt_vocab = Vocab("".join(t for _, t in sample))
    max_len = max(len(t) for _, t in sample) + 2

    model = Seq2Seq(len(src_vocab.itos), len(tgt_vocab.itos), emb_dim=32, hidden_dim=args.hidden,
                    rnn=args.rnn, score=args.score, style=args.style,
                    attn_dim=args.attn_dim)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.1)
    print(f"attnx demo: task={args.task} score={args.score} style={args.style} rnn={args.rnn} "
          f"steps={steps} batch={args.batch_size} threads={torch.get_num_threads()} "
          f"params={sum(p.numel() for p in model.parameters())}")

    bar = ProgressBar(steps)
    start, start_cpu = time.perf_counter(), time.process_time()
    loss_avg = None
    for step in range(1, steps + 1):
        batch = []
        while len(batch) < args.batch_size:
            pair = make(rng)
            if pair[0] not in seen:  # never train on a held-out input
                batch.append(pair)
        src, tgt_in, tgt_out = batchify(batch, src_vocab, tgt_vocab)
        logits, _ = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                               ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        if step % 10 == 0 or step == steps:
            bar.update(step, f"loss {loss_avg:.3f}")
    bar.close()
    train_s, train_cpu = time.perf_counter() - start, time.process_time() - start_cpu

    acc, preds = evaluate(model, test, src_vocab, tgt_vocab, max_len)
    print(f"trained in {train_s:.1f}s ({train_cpu:.1f}s of CPU); held-out exact match: {acc:.1%} ({len(test)} examples)")
    for (s, t), p in list(zip(test, preds))[:5]:
        print(f"  {s!r:>36} -> {p!r} {'ok' if p == t else 'expected ' + repr(t)}")
    shown = test[:4] if args.task != "date" else _diverse(test, 4)
    plot_alignments(model, shown, src_vocab, tgt_vocab, max_len, args.out,
                    f"attnx.nn.Seq2Seq, {args.score} attention ({args.style}): alignments")
    print(f"alignment heatmap written to {args.out}")
    return 0


def _diverse(pairs, n: int):
    """n examples of visibly different formats (by their first and last characters' kinds)."""
    picked, kinds = [], set()
    for s, t in pairs:
        kind = (s[0].isdigit(), s[-1].isdigit(), "/" in s or "." in s, "," in s)
        if kind not in kinds:
            kinds.add(kind)
            picked.append((s, t))
        if len(picked) == n:
            break
    return picked or pairs[:n]


if __name__ == "__main__":
    sys.exit(main())
