"""attn_implementation="attnx" in real transformers models (tiny configs, random weights).

Each model's logits on its real tokens and its gradients are compared with the float64 "eager"
model, within a small multiple of what float32 "eager" errs by; greedy generation with the
model's own KV cache gives the tokens "sdpa" gives.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnx  # noqa: E402
from attnx.hf import attention as hf_attention  # noqa: E402
from _compare import assert_within  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64)


def _config(name: str):
    if name == "llama":
        return transformers.LlamaConfig(**TINY, num_key_value_heads=2)
    if name == "mistral":  # every layer a sliding window shorter than the inputs
        return transformers.MistralConfig(**TINY, num_key_value_heads=2, sliding_window=5)
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=64, bos_token_id=None, eos_token_id=None)
    if name == "bert":
        return transformers.BertConfig(**TINY)
    # layers alternate sliding (5 keys) and full attention; initializer_range 0.2 makes scores
    # large enough for a soft cap of 1 to bend them and for the sinks to matter
    if name == "gemma2":
        return transformers.Gemma2Config(**TINY, num_key_value_heads=2, head_dim=16,
                                         sliding_window=5, attn_logit_softcapping=1.0,
                                         query_pre_attn_scalar=16, initializer_range=0.2)
    if name == "gpt_oss":
        config = transformers.GptOssConfig(**TINY, num_key_value_heads=2, head_dim=16,
                                           sliding_window=5, num_local_experts=4,
                                           num_experts_per_tok=2, initializer_range=0.2)
        config._experts_implementation = "eager"  # the grouped-GEMM experts take no float64
        return config
    raise KeyError(name)


_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
            "gemma2": "Gemma2ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# the window each layer's band has (left, right): bottom-right causal, offset 0 in one forward
_WINDOWS = {"llama": [(None, 0)] * 2, "mistral": [(4, 0)] * 2, "gpt2": [(None, 0)] * 2,
            "bert": [None] * 2, "gemma2": [(4, 0), (None, 0)], "gpt_oss": [(4, 0), (None, 0)]}


def _model(name: str, dtype=torch.float32):
    torch.manual_seed(0)  # the same weights for every dtype and implementation
    model = getattr(transformers, _CLASSES[name])(_config(name))
    return model.to(dtype).eval()


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnx.hf.register() == "attnx"


@pytest.fixture
def sdpa_calls(monkeypatch):
    """What reaches attnx's SDPA op from the attention function: (query heads, key heads,
    attn_mask shape or None, window, dropout_p) per call."""
    calls = []
    real = hf_attention._dispatch.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, **kw):
        mask_shape = None if attn_mask is None else tuple(attn_mask.shape)
        calls.append((q.shape[1], k.shape[1], mask_shape, kw.get("window"), dropout_p))
        return real(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kw)

    monkeypatch.setattr(hf_attention._dispatch, "scaled_dot_product_attention", spy)
    return calls


def _inputs(batch=3, length=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding; the last row has none
    mask[1, :1] = 0
    return ids, mask


def _logits_and_grads(model, impl: str, ids, mask, one_row_at_a_time: bool = False):
    """Logits at the real tokens and every parameter's gradient of a fixed function of them.

    `one_row_at_a_time`: each sequence alone, without its padding (at the same positions), the
    golden value: with padding, transformers' eager path in float64 gives NaN (a padded query
    row's scores are all float64's lowest, which its float32 softmax makes -inf)."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    keep = mask.bool()
    if one_row_at_a_time:
        logits = torch.cat([model(input_ids=ids[b, keep[b]][None],
                                  position_ids=positions[b, keep[b]][None]).logits[0]
                            for b in range(ids.shape[0])])
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[keep]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64).to(logits.dtype)
    (logits * weights).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logits.detach(), grads


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "bert", "gemma2", "gpt_oss"])
def test_logits_and_gradients_match_eager(name, sdpa_calls):
    """Left-padded batch on attnx against each sequence alone on eager, float64 and float32."""
    ids, mask = _inputs()
    golden = _logits_and_grads(_model(name, torch.float64), "eager", ids, mask, True)
    model = _model(name)
    baseline = _logits_and_grads(model, "eager", ids, mask, True)
    sdpa_calls.clear()
    got = _logits_and_grads(model, "attnx", ids, mask)
    assert_within(got[0], golden[0], baseline[0], factor=3, floor=1e-7, what=f"{name} logits")
    assert_within(got[1], golden[1], baseline[1], factor=3, floor=1e-7, what=f"{name} gradients")
    # every layer ran on attnx with the padding as a broadcast (B, 1, 1, Lk) vector (causality
    # and windows as a band), and GQA's key/value heads were not repeated
    hkv = 4 if name in ("gpt2", "bert") else 2
    assert [c[:3] for c in sdpa_calls] == [(4, hkv, (3, 1, 1, 13))] * 2
    assert [c[3] for c in sdpa_calls] == _WINDOWS[name]


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "gemma2", "gpt_oss"])
def test_greedy_generate_matches_sdpa_or_eager(name):
    """(eager for the models with soft-capping or sinks, which transformers' sdpa refuses)"""
    ids, mask = _inputs(length=9)
    model = _model(name)
    reference = "eager" if name in ("gemma2", "gpt_oss") else "sdpa"
    tokens = {}
    for impl in (reference, "attnx"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                      do_sample=False, pad_token_id=0)
    assert tokens["attnx"].shape == (3, 17)
    assert torch.equal(tokens["attnx"], tokens[reference])


def test_unpadded_decoding_runs_on_the_decode_kernel(monkeypatch):
    calls = []
    real = hf_attention._dispatch.attention_with_kvcache

    def spy(q, k_cache, v_cache, cache_seqlens, **kw):
        calls.append((tuple(q.shape), tuple(k_cache.shape), cache_seqlens, kw.get("window")))
        return real(q, k_cache, v_cache, cache_seqlens, **kw)

    monkeypatch.setattr(hf_attention._dispatch, "attention_with_kvcache", spy)
    ids = _inputs(batch=2, length=9)[0]
    tokens = {}
    for name in ("llama", "mistral"):
        model = _model(name)
        for impl in ("sdpa", "attnx"):
            model.set_attn_implementation(impl)
            tokens[name, impl] = model.generate(input_ids=ids, max_new_tokens=6,
                                                do_sample=False, pad_token_id=0)
        assert torch.equal(tokens[name, "attnx"], tokens[name, "sdpa"])
    # 5 one-token steps after the prefill, 2 layers, per model: Llama's keys grow (10 .. 14),
    # Mistral's sliding cache keeps the window's last 4 keys plus the new one
    assert [c[2] for c in calls[:10:2]] == [10, 11, 12, 13, 14]
    assert all(c[0] == (2, 4, 1, 16) and c[3] is None for c in calls[:10])
    assert all(c[1] == (2, 2, 5, 16) and c[3] == (4, None) for c in calls[10:])
    assert len(calls) == 20


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_continuing_from_a_cache_matches_one_forward(name):
    """Queries after cached keys (Lq > 1, Lk > Lq): the causal band aligned bottom-right. A
    DynamicCache made without the config keeps every key, so Mistral's window must also drop
    the keys no query reaches."""
    ids, mask = _inputs()
    model = _model(name)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits[:, 8:]
        model.set_attn_implementation("attnx")
        cache = transformers.DynamicCache()
        model(input_ids=ids[:, :8], attention_mask=mask[:, :8], cache=cache)
        rest = model(input_ids=ids[:, 8:], attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(rest, whole, atol=2e-5, rtol=1e-4)


@pytest.fixture
def varlen_calls(monkeypatch):
    """What reaches attnx's varlen op from the attention function: (cu_seqlens, window,
    is_causal, dropout_p) per call."""
    calls = []
    real = hf_attention._dispatch.varlen_attention

    def spy(q, k, v, cu_q, cu_k, *args, **kw):
        calls.append((cu_q.tolist(), kw.get("window"), kw.get("is_causal"), kw.get("dropout_p")))
        return real(q, k, v, cu_q, cu_k, *args, **kw)

    monkeypatch.setattr(hf_attention._dispatch, "varlen_attention", spy)
    return calls


PACKED_POSITIONS = [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4, 5]]


# (gpt_oss's masks take no position_ids in this transformers: its packed batches are not packed)
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_packed_sequences_run_on_varlen(name, sdpa_calls, varlen_calls):
    """Packed sequences (position_ids that restart, no padding mask: transformers' padding-free
    path) run as one varlen_attention call per layer, over both rows' sequences: logits and
    gradients as the float64 eager model's (which materialises the block-diagonal mask),
    sliding windows and soft caps included."""
    ids = _inputs(batch=2, length=12)[0]
    position_ids = torch.tensor(PACKED_POSITIONS)
    mask = torch.ones_like(ids)

    def run(impl, dtype):
        model = _model(name, dtype)
        model.set_attn_implementation(impl)
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64).to(dtype)
        (logits * weights).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return logits.detach(), grads

    got = run("attnx", torch.float32)
    want = run("eager", torch.float64)
    base = run("eager", torch.float32)
    for what, a, w, b in zip(("logits", "grads"), got, want, base):
        assert_within(a, w, b, factor=3.0, floor=1e-5, what=what)
    layers = _config(name).num_hidden_layers
    assert not sdpa_calls and len(varlen_calls) == layers
    assert varlen_calls[0][0] == [0, 5, 8, 12, 18, 24]  # row 0: 5, 3, 4 tokens; row 1: 6, 6
    assert [c[1] for c in varlen_calls] == [(w[0], None) if w[0] is not None else None
                                           for w in _WINDOWS[name]]
    unpacked = _model(name)
    unpacked.set_attn_implementation("attnx")
    plain = unpacked(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert not torch.allclose(got[0], plain.detach())  # the packing mattered


def test_static_cache_generation_matches_sdpa():
    """A static cache's queries are not its last keys: its masks are materialised."""
    ids, mask = _inputs(length=9)
    model = _model("llama")
    tokens = {}
    for impl in ("sdpa", "attnx"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                      do_sample=False, pad_token_id=0,
                                      cache_implementation="static")
    assert torch.equal(tokens["attnx"], tokens["sdpa"])


def test_dropout_in_training(sdpa_calls):
    config = _config("llama")
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("attnx")
    ids = _inputs()[0]
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(model(input_ids=ids).logits)
    model.eval()
    plain = model(input_ids=ids).logits
    assert [c[4] for c in sdpa_calls] == [0.5] * 6 + [0.0] * 2
    assert torch.equal(runs[0], runs[1])  # reproducible under torch.manual_seed
    assert not torch.allclose(runs[0], runs[2]) and not torch.allclose(runs[0], plain)


def test_from_pretrained_with_attn_implementation(tmp_path):
    _model("llama").save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="attnx")
    assert model.config._attn_implementation == "attnx"
    ids, mask = _inputs()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=1e-4)


def test_sparse_indices_are_refused_not_ignored():
    """DeepSeek-V3.2's layers fold their indexer's top-k keys into the mask for "eager" and
    "sdpa" only, and pass them to any other attention function as `indices`: attnx attended
    densely without them (20% off the logits at index_topk=4 of 12 tokens)."""
    config = transformers.DeepseekV32Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        mlp_layer_types=["dense"], layer_types=["indexed_attention"], index_topk=4,
        index_head_dim=8, index_n_heads=2, max_position_embeddings=64)
    config._experts_implementation = "eager"
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    model.set_attn_implementation("attnx")
    with pytest.raises(ValueError, match="indices: not supported by attn_implementation='attnx'"):
        model(input_ids=torch.randint(3, 128, (2, 12)))
    q = torch.randn(1, 2, 3, 4)
    for name in ("block_indices", "sinks", "position_bias"):
        with pytest.raises(ValueError, match=f"{name}: not supported"):
            hf_attention.attention_forward(None, q, q, q, None, **{name: torch.zeros(1)})


@pytest.mark.parametrize("cls,config,error", [
    ("BloomForCausalLM", dict(vocab_size=128, hidden_size=32, n_layer=1, n_head=4), TypeError),
    ("MptForCausalLM", dict(vocab_size=128, d_model=32, n_layers=1, n_heads=4, max_seq_len=64),
     AttributeError),
])
def test_models_with_their_own_attention_get_a_clear_error(cls, config, error):
    """transformers takes attn_implementation="attnx" for any model, and builds masks with
    attnx's builder for those (Bloom, MPT) that compute attention themselves: they add the
    CompactMask to their scores (Bloom) or move it (MPT's .to), which raised an unrelated
    TypeError / AttributeError."""
    model_cls = getattr(transformers, cls)
    model = model_cls(getattr(transformers, cls.replace("ForCausalLM", "Config"))(**config))
    model.config._attn_implementation = "attnx"  # as from_pretrained(attn_implementation=) sets it
    ids, mask = torch.randint(3, 128, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(error, match="attention_mask: this model computes attention itself"):
        model(input_ids=ids, attention_mask=mask)
    compact = hf_attention.CompactMask(None, True, None, 2, 8, 8)
    assert not hasattr(compact, "dtype")  # probes still answer "no"


@pytest.mark.parametrize("window", [0, -2])
def test_a_window_of_no_keys_is_named(window):
    """A sliding_window <= 0 in the config: transformers' mask builder makes a mask one key too
    wide or narrow from it ("eager" and "sdpa" fail on the size); attnx names the window."""
    config = _config("mistral")
    config.sliding_window = window
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    model.set_attn_implementation("attnx")
    with pytest.raises(ValueError, match=f"sliding_window: expected a positive int .*got {window}"):
        model(input_ids=torch.randint(1, 128, (2, 10)))


def test_output_attentions_warns_that_there_are_none():
    """As with "sdpa", which logs it: the model's attentions come back empty, not silently."""
    ids, mask = _inputs()
    model = _model("llama")
    model.set_attn_implementation("attnx")
    with pytest.warns(UserWarning, match="output_attentions=True: attn_implementation='attnx' "
                                         "returns no attention weights"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert not out.attentions


def test_import_attnx_does_not_import_transformers():
    code = ("import sys, attnx; attnx.hf.NAME; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_bench_case_writes_tokens_per_second(tmp_path, monkeypatch):
    from attnx.bench import cli, timing
    monkeypatch.setitem(timing.WARMUP_SECONDS, "cpu", 0.0)
    monkeypatch.setitem(timing.BLOCK_SECONDS, "cpu", 0.0)
    threads = torch.get_num_threads()
    try:  # one thread: a second one waiting on a busy machine's scheduler costs seconds
        assert cli.main(["--ops", "hf", "--quick", "--repeats", "1", "--threads", "1",
                         "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["pass"], r["provider"]): r for r in doc["results"]}
    assert sorted(rows) == [(p, i) for p in ("forward", "generate") for i in ("attnx", "sdpa")]
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["generate", "attnx"]["same_tokens_as_sdpa"] is True
    assert rows["forward", "attnx"]["tokens"] == 2 * 32 - 32 // 8  # the real tokens only
    with pytest.raises(SystemExit):
        cli.main(["--ops", "hf,sdpa", "--out", str(tmp_path)])


def test_padded_forward_and_decoding_steps_compile_fullgraph():
    """torch.compile(fullgraph=True) of a left-padded forward (its padding kept as a mask
    whatever its values: a graph does not branch on them) and of cached one-token steps (the
    CPU decoding kernel, its cache length an int), each as the uncompiled model gives."""
    import copy

    ids, mask = _inputs(length=9)
    model = _model("llama")
    model.set_attn_implementation("attnx")
    torch._dynamo.reset()
    forward = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m).logits,
                            fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(forward(ids, mask)[mask.bool()], want[mask.bool()])
        step = torch.compile(lambda t, c: model(input_ids=t, past_key_values=c).logits,
                             fullgraph=True, backend="aot_eager")
        out = model(input_ids=ids[2:], use_cache=True)  # the unpadded row
        cache, compiled_cache = out.past_key_values, copy.deepcopy(out.past_key_values)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            want = model(input_ids=token, past_key_values=cache).logits
            torch.testing.assert_close(step(token, compiled_cache), want)
            token = want[:, -1:].argmax(-1)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_export_with_a_dynamic_sequence_length(name):
    """torch.export (non-strict, its default) with the length left symbolic: the layers' window
    edges, lk - lq, are SymInts there (a TypeError before); the program runs at other lengths
    as the model does."""
    model = _model(name)
    model.set_attn_implementation("attnx")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    length = torch.export.Dim("length", min=2, max=64)
    ids, mask = _inputs(batch=2, length=7)
    program = torch.export.export(Logits(), (ids, torch.ones_like(mask)),
                                  dynamic_shapes={"ids": {1: length}, "mask": {1: length}})
    ids, mask = _inputs(batch=2, length=12, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(ids, torch.ones_like(mask)),
                                   Logits()(ids, torch.ones_like(mask)))


def test_unpadded_generate_under_autocast_matches_sdpa():
    """Under torch.autocast Llama's q and k come out float32 from RoPE beside a bf16 v: the
    decoding op (which does not cast) refused them; the one-token steps go through SDPA, which
    casts as torch's does, and give sdpa's tokens."""
    ids = _inputs(batch=2, length=9)[0]
    model = _model("llama")
    tokens = {}
    with torch.no_grad(), torch.autocast("cpu"):
        for impl in ("sdpa", "attnx"):
            model.set_attn_implementation(impl)
            tokens[impl] = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False,
                                          pad_token_id=0)
    assert tokens["attnx"].shape == (2, 15)
    assert torch.equal(tokens["attnx"], tokens["sdpa"])
