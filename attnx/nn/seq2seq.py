"""`Seq2Seq`: a bidirectional RNN encoder and an attention decoder (Bahdanau or Luong style).

- Encoder: embedding, bidirectional GRU or LSTM over the padded batch (packed by length, so
  the backward direction starts at each sequence's last real token; padding anywhere, left or
  between tokens too: each row's real tokens are read in order and their outputs put back in
  place). Its outputs h_j, of width 2 * hidden_dim, are the attention keys and values (0 at
  padding, but for a row of padding alone, whose first position is read); padding is masked
  out of the attention.
- Decoder state width is 2 * hidden_dim, so every score of `Attention` (dot and cosine
  included) applies; s_0 = tanh(W_init [forward final; backward final]) (LSTM: c_0 = 0).
- style="bahdanau" (Bahdanau et al. 2015): at step i attend with the previous state,
  c_i = Attn(s_{i-1}, h), then s_i = RNNCell([E y_{i-1}; c_i], s_{i-1}) and
  logits = W_o [s_i; c_i; E y_{i-1}] (a linear deep output instead of the paper's maxout).
- style="luong" (Luong et al. 2015, global or local-m attention): s_i = RNN(E y_{i-1}, s_{i-1})
  first, then c_i = Attn(s_i, h), h~_i = tanh(W_c [c_i; s_i]), logits = W_s h~_i. Without
  input feeding, so with teacher forcing the whole target runs as one RNN call and one
  attention call over all its positions.
- Training uses teacher forcing (`forward`), inference greedy decoding (`greedy`). With a
  `window`, decoder step i (from 0) attends source positions i-left..i+right in both.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .._validate import _check_dropout
from .seq2seq_attention import Attention


def _check_tokens(name: str, x, vocab: int, batch: Optional[int] = None) -> None:
    """Token ids (B, L): an integer tensor, B and L >= 1 (the encoder packs by length), every id
    in [0, vocab) (nn.Embedding would raise IndexError)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of token ids, got {type(x).__name__}")
    if x.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected token ids of dtype torch.int64 or torch.int32, got {x.dtype}")
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name}: expected (B, L) token ids with B, L >= 1, got shape {tuple(x.shape)}")
    if batch is not None and x.shape[0] != batch:
        raise ValueError(f"{name}: expected batch size {batch} (that of src), got shape {tuple(x.shape)}")
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"{name}: expected token ids in [0, {vocab}), got ids from {low} to {high}")


def _check_int(name: str, n, low: int) -> None:
    """An integer (numpy's too, as nn.Embedding takes), not a bool, >= low."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
    if operator.index(n) < low:
        raise ValueError(f"{name}: expected >= {low}, got {n}")


class Seq2Seq(nn.Module):
    def __init__(self, src_vocab: int, tgt_vocab: int, emb_dim: int = 64, hidden_dim: int = 128,
                 rnn: str = "gru", score: str = "additive", style: str = "bahdanau",
                 attn_dim: Optional[int] = None, dropout: float = 0.0, window=None,
                 pad_idx: int = 0, bos_idx: int = 1, eos_idx: int = 2):
        super().__init__()
        for name, n in (("src_vocab", src_vocab), ("tgt_vocab", tgt_vocab), ("emb_dim", emb_dim),
                        ("hidden_dim", hidden_dim)):
            _check_int(name, n, 1)
        # pad_idx is the padding row of both embeddings; BOS and EOS are target tokens
        for name, idx, size in (("pad_idx", pad_idx, min(src_vocab, tgt_vocab)),
                                ("bos_idx", bos_idx, tgt_vocab), ("eos_idx", eos_idx, tgt_vocab)):
            _check_int(name, idx, 0)
            if idx >= size:
                raise ValueError(f"{name}: expected an id in [0, {size}), got {idx}")
        dropout = _check_dropout(dropout, "dropout")
        if rnn not in ("gru", "lstm"):
            raise ValueError(f"rnn: expected 'gru' or 'lstm', got {rnn!r}")
        if style not in ("bahdanau", "luong"):
            raise ValueError(f"style: expected 'bahdanau' or 'luong', got {style!r}")
        self.rnn, self.style = rnn, style
        self.pad_idx, self.bos_idx, self.eos_idx = pad_idx, bos_idx, eos_idx
        dec = 2 * hidden_dim
        rnn_cls = nn.GRU if rnn == "gru" else nn.LSTM
        self.src_embed = nn.Embedding(src_vocab, emb_dim, padding_idx=pad_idx)
        self.tgt_embed = nn.Embedding(tgt_vocab, emb_dim, padding_idx=pad_idx)
        self.encoder = rnn_cls(emb_dim, hidden_dim, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(dec, dec)
        self.attention = Attention(dec, dec, score=score, attn_dim=attn_dim, window=window)
        self.drop = nn.Dropout(dropout)
        if style == "bahdanau":
            cell_cls = nn.GRUCell if rnn == "gru" else nn.LSTMCell
            self.decoder = cell_cls(emb_dim + dec, dec)
            self.out = nn.Linear(dec + dec + emb_dim, tgt_vocab)
        else:
            self.decoder = rnn_cls(emb_dim, dec, batch_first=True)
            self.combine = nn.Linear(2 * dec, dec, bias=False)
            self.out = nn.Linear(dec, tgt_vocab)

    def encode(self, src: torch.Tensor, src_key_padding_mask: Optional[torch.Tensor] = None):
        """src (B, S) token ids -> (memory (B, S, 2H), padding mask (B, S), initial state)."""
        _check_tokens("src", src, self.src_embed.num_embeddings)
        if src_key_padding_mask is not None and (
                not isinstance(src_key_padding_mask, torch.Tensor)
                or src_key_padding_mask.dtype != torch.bool or src_key_padding_mask.shape != src.shape):
            got = (f"{src_key_padding_mask.dtype} {tuple(src_key_padding_mask.shape)}"
                   if isinstance(src_key_padding_mask, torch.Tensor) else type(src_key_padding_mask).__name__)
            raise TypeError(f"src_key_padding_mask: expected None or a bool tensor of src's shape "
                            f"{tuple(src.shape)} (True = padding), got {got}")
        if src_key_padding_mask is None:
            src_key_padding_mask = src == self.pad_idx
        lengths = (~src_key_padding_mask).sum(1).clamp(min=1).cpu()
        # each row's real tokens first, in order (a stable sort of the padding flags): packing
        # reads a row's first `length` positions
        order = torch.argsort(src_key_padding_mask.int(), dim=1, stable=True)
        embedded = self.drop(self.src_embed(src.gather(1, order)))
        packed = pack_padded_sequence(embedded, lengths, batch_first=True, enforce_sorted=False)
        out, final = self.encoder(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        # and their outputs back at their own positions (padding's rows are 0, but a row of
        # padding alone has its first position read: a packed length is at least 1)
        memory = out.new_zeros(out.shape).scatter(1, order[..., None].expand(out.shape), out)
        h_n = final[0] if self.rnn == "lstm" else final  # (2, B, H): forward, backward
        s0 = torch.tanh(self.init_state(torch.cat([h_n[0], h_n[1]], dim=-1)))
        state = (s0, torch.zeros_like(s0)) if self.rnn == "lstm" else s0
        return memory, src_key_padding_mask, state

    @staticmethod
    def _hidden(state):
        return state[0] if isinstance(state, tuple) else state

    def _bahdanau_step(self, t, y_prev, state, memory, keys, mask, need_weights):
        """Decoder step t (from 0)."""
        e = self.drop(self.tgt_embed(y_prev))  # (B, emb)
        ctx, w = self.attention(self._hidden(state).unsqueeze(1), memory, key_padding_mask=mask,
                                need_weights=need_weights, projected_key=keys, query_offset=t)
        ctx = ctx.squeeze(1)
        state = self.decoder(torch.cat([e, ctx], dim=-1), state)
        logits = self.out(self.drop(torch.cat([self._hidden(state), ctx, e], dim=-1)))
        return logits, state, w

    def _luong_steps(self, t, y_prev, state, memory, mask, need_weights):
        """y_prev (B, T): run steps t..t+T-1 at once (teacher forcing: t = 0) or one (T = 1)."""
        rnn_state = (state[0].unsqueeze(0), state[1].unsqueeze(0)) if self.rnn == "lstm" else state.unsqueeze(0)
        h, rnn_state = self.decoder(self.drop(self.tgt_embed(y_prev)), rnn_state)
        ctx, w = self.attention(h, memory, key_padding_mask=mask, need_weights=need_weights,
                                query_offset=t)
        logits = self.out(self.drop(torch.tanh(self.combine(torch.cat([ctx, h], dim=-1)))))
        state = (rnn_state[0][0], rnn_state[1][0]) if self.rnn == "lstm" else rnn_state[0]
        return logits, state, w

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor,
                src_key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = False):
        """Teacher forcing: tgt_in (B, T) starts with BOS. Returns logits (B, T, V) and the
        alignment weights (B, T, S) or None."""
        memory, mask, state = self.encode(src, src_key_padding_mask)
        _check_tokens("tgt_in", tgt_in, self.tgt_embed.num_embeddings, batch=src.shape[0])
        if self.style == "luong":
            logits, _, w = self._luong_steps(0, tgt_in, state, memory, mask, need_weights)
            return logits, w
        logits, weights = [], []
        keys = self.attention.project_key(memory)
        for t in range(tgt_in.shape[1]):
            step, state, w = self._bahdanau_step(t, tgt_in[:, t], state, memory, keys, mask,
                                                 need_weights)
            logits.append(step)
            weights.append(w)
        return torch.stack(logits, 1), (torch.cat(weights, 1) if need_weights else None)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, max_len: int,
               src_key_padding_mask: Optional[torch.Tensor] = None):
        """Greedy decoding: (tokens (B, T) without BOS, ending at EOS or max_len; weights (B, T, S)).
        Positions after a sequence's EOS hold pad_idx."""
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len: expected an int >= 1, got {max_len!r}")
        memory, mask, state = self.encode(src, src_key_padding_mask)
        b = src.shape[0]
        y = torch.full((b,), self.bos_idx, dtype=torch.long, device=src.device)
        done = torch.zeros(b, dtype=torch.bool, device=src.device)
        tokens, weights = [], []
        keys = self.attention.project_key(memory)
        for t in range(max_len):
            if self.style == "luong":
                logits, state, w = self._luong_steps(t, y.unsqueeze(1), state, memory, mask, True)
                logits = logits.squeeze(1)
            else:
                logits, state, w = self._bahdanau_step(t, y, state, memory, keys, mask, True)
            y = logits.argmax(-1).masked_fill(done, self.pad_idx)
            tokens.append(y)
            weights.append(w)
            done = done | (y == self.eos_idx)
            if bool(done.all()):
                break
        return torch.stack(tokens, 1), torch.cat(weights, 1)
