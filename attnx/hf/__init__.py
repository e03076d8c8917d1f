"""Hugging Face transformers integration: `attn_implementation="attnx"`.

    import attnx
    attnx.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnx")

`register()` adds attnx's attention function to transformers' `AttentionInterface` and its
mask builder to `AttentionMaskInterface`. Importing this module does not import transformers
(`import attnx` must stay free of it); `register()` does.
"""

from __future__ import annotations

from .attention import CompactMask, attention_forward

NAME = "attnx"

__all__ = ["NAME", "register", "attention_forward", "CompactMask"]


def register() -> str:
    """Register attnx with transformers under the name "attnx" and return that name.

    Then `from_pretrained(..., attn_implementation="attnx")` and
    `model.set_attn_implementation("attnx")` run every attention layer on attnx. Calling it
    again is harmless.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError("attnx.hf.register() needs transformers: "
                          "pip install 'attnx[hf]'") from exc
    from .masks import attnx_mask  # imports transformers' masking code

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attnx_mask)
    return NAME
