"""attnx.nn: attention modules on attnx's fused ops.

Drop-in replacements for torch.nn's attention and Transformer classes, the classic
sequence-to-sequence alignment scores (`Attention`), the sinusoidal `PositionalEncoding` and an
RNN encoder-decoder with attention (`Seq2Seq`).
"""

from .multihead import MultiheadAttention
from .positional import PositionalEncoding
from .seq2seq import Seq2Seq
from .seq2seq_attention import Attention
from .transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer,
                          TransformerEncoder, TransformerEncoderLayer, to_attnx)

__all__ = ["MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerDecoder", "Transformer", "to_attnx", "Attention", "PositionalEncoding", "Seq2Seq"]
