"""Fast tests of the benchmark suite itself (attnx.bench): FLOP formulas, timing method, the
memory probe, and one tiny end-to-end run writing the table, results.json and the plots."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnx.bench import flops, main, memory, providers, report, timing
from attnx.bench.providers import Provider
from attnx.bench.shapes import Case
from attnx.bench.workload import make_inputs


def _case(op="sdpa", causal=False, b=2, h=3, lq=17, lk=17, d=8, ev=8):
    return Case(op, b, h, lq, lk, d, ev, causal, "float32", "cpu")


def test_sdpa_flops_follow_flash_attention():
    c = _case(lq=17, lk=33)
    assert flops.forward(c) == 4 * 2 * 3 * 17 * 33 * 8
    assert flops.forward(_case(causal=True, lq=17, lk=33)) == flops.forward(c) / 2
    assert flops.count(c, "backward") == 2.5 * flops.forward(c)
    assert flops.count(c, "forward_backward") == 3.5 * flops.forward(c)


def test_sdpa_forward_flops_equal_torch_count_of_the_naive_matmuls():
    c = _case(lq=17, lk=33, d=16, ev=16)
    with FlopCounterMode(display=False) as counter:
        providers.naive_sdpa(make_inputs(c), causal=False)
    assert counter.get_total_flops() == flops.forward(c)


def test_additive_flops_formula():
    c = _case("additive", b=4, h=1, lq=5, lk=7, d=32, ev=16)
    pairs = 4 * 5 * 7
    assert flops.forward(c) == pairs * (4 * 32 + 2 * 16)
    assert flops.backward(c) == pairs * (12 * 32 + 4 * 16)
    assert flops.forward(_case("additive", causal=True, b=4, h=1, lq=5, lk=7, d=32, ev=16)) == flops.forward(c) / 2


def test_kvcache_and_varlen_flops():
    kv = Case("kvcache", 2, 8, 4, 300, 64, 64, True, "float32", "cpu", kv_heads=2)
    assert flops.forward(kv) == 4 * 2 * 8 * 4 * 300 * 64  # every query against the whole cache
    lens = (5, 17, 40)
    packed = Case("varlen", 3, 2, 62, 62, 16, 16, False, "float32", "cpu", lengths=lens)
    per_sequence = sum(flops.forward(_case(b=1, h=2, lq=n, lk=n, d=16, ev=16)) for n in lens)
    assert flops.forward(packed) == per_sequence
    causal = Case("varlen", 3, 2, 62, 62, 16, 16, True, "float32", "cpu", lengths=lens)
    assert flops.count(causal, "forward_backward") == 3.5 * per_sequence / 2


def _provider(name: str, op: str) -> Provider:
    found = {(p.name, p.op): p for p in providers.discover("cpu", probe_flex=False,
                                                           probe_compile=False)}
    return found[(name, op)]


@pytest.mark.parametrize("lq", [1, 4])
def test_kvcache_providers_compute_the_same(lq):
    """A benchmark of different problems is worth nothing: attnx and torch's peer agree."""
    c = Case("kvcache", 2, 8, lq, 33, 16, 16, True, "float32", "cpu", kv_heads=2)
    x = make_inputs(c)
    with torch.no_grad():
        got, want = (_provider(name, "kvcache").run(x, True) for name in ("attnx-cpu", "torch-sdpa"))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_providers_compute_the_same(causal):
    """attnx on the packed batch and torch's SDPA on the same tokens padded (the peer's layout,
    with its key-padding mask where not causal) agree on the real tokens."""
    lens = (5, 17, 9)
    c = Case("varlen", 3, 2, 31, 31, 8, 8, causal, "float32", "cpu", lengths=lens)
    packed = make_inputs(c, "packed")
    padded = make_inputs(c, "padded")
    assert padded["q"].shape == (3, 2, 17, 8) and (padded["key_padding"] is None) == causal
    real = torch.arange(17).view(1, -1) < torch.tensor(lens).view(-1, 1)
    for name in ("q", "k", "v"):  # the packed tokens in the padded layout
        padded[name] = torch.zeros(3, 17, 2, 8).index_put_((real,), packed[name]).transpose(1, 2)
    with torch.no_grad():
        got = _provider("attnx-cpu", "varlen").run(packed, causal)
        want = _provider("torch-sdpa-padded", "varlen").run(padded, causal)
    torch.testing.assert_close(got, want.transpose(1, 2)[real])


def _assert_additive_matches_reference(run):
    import attnx

    x = make_inputs(_case("additive", b=2, h=1, lq=5, lk=9, d=6, ev=4))
    for causal in (False, True):
        want = attnx.additive_attention(x["q"], x["k"], x["value"], x["v"], is_causal=causal,
                                        backend="reference")
        torch.testing.assert_close(run(x, causal), want)


def test_naive_additive_matches_reference():
    _assert_additive_matches_reference(providers.naive_additive)
    _assert_additive_matches_reference(providers.summed_additive)


def test_compiled_naive_additive_provider(monkeypatch):
    """`compile-naive`, torch.compile of the naive additive formula (the peer of attnx's additive
    kernels), is probed in a child process and then computes what the reference computes; not
    probed, it says how to ask for it. (The probe's time limit is the benchmark's guard against a
    hanging compiler, not what this tests: a cold first compile beside another test process took
    over its 60 s on a 2-core machine.)"""
    monkeypatch.setattr(providers, "COMPILE_PROBE_SECONDS", 900)
    assert "not probed" in providers._compiled_additive("cpu", probe=False).reason
    p = providers._compiled_additive("cpu", probe=True)
    assert p.available, p.reason
    _assert_additive_matches_reference(p.run)


def test_interleaved_rotates_order_and_survives_a_failing_step(monkeypatch):
    monkeypatch.setitem(timing.WARMUP_SECONDS, "cpu", 0.0)
    monkeypatch.setitem(timing.BLOCK_SECONDS, "cpu", 0.0)
    log = []

    def step(name):
        return lambda: log.append(name)

    def broken():
        raise RuntimeError("kernel not written\nsecond line")

    out = timing.interleaved({"a": step("a"), "bad": broken, "b": step("b")}, "cpu", repeats=3)
    assert out["bad"].error == "RuntimeError: kernel not written"
    assert len(out["a"].samples) == len(out["b"].samples) == 3
    timed = log[-6:]  # after warm-up: one call per provider per repeat, order rotated
    assert timed == ["a", "b", "b", "a", "a", "b"]
    d = out["a"].as_dict()
    assert d["min_ms"] <= d["median_ms"] <= d["max_ms"]


def test_cpu_peak_memory_sees_the_naive_score_matrix():
    if memory.rss_supported() is not None:
        pytest.skip(memory.rss_supported())
    small, large = (Case("sdpa", 1, 4, n, n, 16, 16, False, "float32", "cpu") for n in (64, 512))
    with memory.CpuMemory() as mem:
        naive_small = mem.peak("naive", small, "forward")
        naive_large = mem.peak("naive", large, "forward")
        flash_large = mem.peak("torch-flash", large, "forward")
    scores = 4 * 512 * 512 * 4  # one (H, L, L) float32 matrix
    assert naive_large - naive_small >= scores
    assert flash_large < scores  # the fused kernel never holds the matrix


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")

    def boom(x, causal):
        raise RuntimeError("boom")

    broken = Provider("broken", "sdpa", run=boom)
    real_discover = providers.discover
    providers.discover = lambda device, **kw: real_discover(device, **kw) + [broken]
    try:
        main(["--quick", "--out", str(out), "--seqlens", "16", "--repeats", "2", "--threads", "1",
              "--providers", "naive,attnx-reference,attnx-cpu,torch-flash,broken"])
    finally:
        providers.discover = real_discover
    return out


def test_quick_run_writes_results_json(quick_run, capsys):
    doc = json.loads((quick_run / "results.json").read_text())
    assert doc["schema"] == report.SCHEMA
    assert doc["device"]["type"] == "cpu" and doc["device"]["name"]
    assert doc["software"]["torch"] == torch.__version__
    assert doc["gemm"]["flops_per_s"] > 0
    names = {(p["name"], p["op"]) for p in doc["providers"]}
    assert {("naive", "sdpa"), ("naive", "additive"), ("broken", "sdpa")} <= names
    seen = set()
    for r in doc["results"]:
        c = r["case"]
        seen.add((r["provider"], c["op"], r["pass"], c["seqlen_q"], c["causal"]))
        if r["provider"] == "broken":
            assert r["time"] == {"error": "RuntimeError: boom"}
            continue
        if r["provider"] == "naive":
            t = r["time"]
            assert t["min_ms"] <= t["median_ms"] <= t["max_ms"] and len(t["samples_ms"]) == 2
            assert r["flops"] == flops.count(Case(**c), r["pass"])
            assert r["flops_per_s"] == pytest.approx(r["flops"] / (t["median_ms"] * 1e-3))
            assert r["memory"]["bytes"] >= 0
    for op in ("sdpa", "additive"):
        for pass_ in ("forward", "forward_backward"):
            for L in (16,):
                for causal in (False, True):
                    assert ("naive", op, pass_, L, causal) in seen


def test_quick_run_writes_readable_pngs(quick_run):
    for name in ("throughput_sdpa", "throughput_additive", "memory_sdpa", "memory_additive",
                 "additive_vs_naive"):
        data = (quick_run / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_table_lists_errors_and_spread():
    doc = {"device": {"type": "cpu"}, "results": [
        {"op": "sdpa", "provider": "x", "pass": "forward", "case": _case().as_dict(),
         "flops": 1e9, "time": {"median_ms": 2.0, "min_ms": 1.5, "max_ms": 3.0},
         "flops_per_s": 5e11, "fraction_of_gemm": 0.5, "memory": {"bytes": 2**21}},
        {"op": "sdpa", "provider": "y", "pass": "forward", "case": _case().as_dict(),
         "flops": 1e9, "time": {"error": "RuntimeError: boom"}}]}
    text = report.table(doc)
    assert "| 2.000 | 1.500-3.000 | 500.0 | 50 | 2.0 |" in text
    assert "error: RuntimeError: boom" in text


def test_quick_kvcache_and_varlen_run(tmp_path, capsys):
    """`attnx bench --ops kvcache,varlen`: decoding forward only, varlen forward and training
    step, attnx against torch's peers, in the table, results.json and two plots."""
    main(["--quick", "--ops", "kvcache,varlen", "--out", str(tmp_path), "--repeats", "2",
          "--threads", "1", "--no-memory",
          "--providers", "attnx-cpu,torch-sdpa,torch-sdpa-padded"])
    doc = json.loads((tmp_path / "results.json").read_text())
    seen = {(r["case"]["op"], r["pass"], r["provider"]) for r in doc["results"]
            if "error" not in r["time"]}
    assert seen == {("kvcache", "forward", "attnx-cpu"), ("kvcache", "forward", "torch-sdpa"),
                    ("varlen", "forward", "attnx-cpu"), ("varlen", "forward", "torch-sdpa-padded"),
                    ("varlen", "forward_backward", "attnx-cpu"),
                    ("varlen", "forward_backward", "torch-sdpa-padded")}
    for r in doc["results"]:
        assert r["flops"] == flops.count(Case(**r["case"]), r["pass"])
    out = capsys.readouterr().out
    assert "Hq8/2 Lq4 cache256" in out and "N3 H2 tokens121 (17-64)" in out
    for name in ("throughput_kvcache", "throughput_varlen"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_provider_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown"):
        main(["--quick", "--providers", "nope", "--out", "/nonexistent"])


def _refused(argv, capsys) -> str:
    """The message of a run refused before it starts: SystemExit's own, or argparse's usage
    error on stderr (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0
    return f"{exc.value} {capsys.readouterr().err}"


@pytest.mark.parametrize("argv, words", [
    (["--world", "0"], "--world: expected an int >= 1, got 0"),
    (["--world", "2", "--seqlens", "30"], "multiple of 2 x world = 4"),
    (["--world", "2", "--providers", "naive"], "without --providers"),
    (["--world", "2", "--ops", "hf"], "without --ops"),
    (["--world", "2", "--head-dims", "32,64"], "one head dim"),
])
def test_ring_world_rejects_what_it_cannot_run_before_spawning(argv, words, capsys):
    assert words in _refused(argv + ["--out", "/nonexistent"], capsys)


@pytest.mark.parametrize("argv, words", [
    (["--seqlens", "0"], "--seqlens: expected an int >= 1, got 0"),
    (["--seqlens=-5,8"], "--seqlens: expected an int >= 1, got -5"),
    (["--head-dims", "x"], "--head-dims: expected an int >= 1, got 'x'"),
    (["--attn-dims", "0"], "--attn-dims: expected an int >= 1"),
    (["--repeats=-3"], "--repeats: expected an int >= 1"),
    (["--threads", "0"], "--threads: expected an int >= 1"),
    (["--ops", ""], "--ops: expected a comma-separated list"),
    (["--dtypes", "nope"], "--dtypes: unknown ['nope']"),
    (["--ops", "kvcache", "--head-dims", "32,64"], "kvcache and varlen take one head dim"),
    (["--ops", "hf", "--seqlens", "64"], "without --seqlens"),
    (["--ops", "hf", "--dtypes", "float32"], "without --dtypes"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: no CUDA device")]))
def test_bad_arguments_are_refused_before_any_timing(argv, words, capsys):
    assert words in _refused(argv + ["--quick", "--out", "/nonexistent"], capsys)


@pytest.mark.parametrize("argv, words", [
    (["--ops", "additive", "--providers", "torch-flash"], "nothing here runs additive"),
    (["--ops", "sdpa,kvcache", "--providers", "naive"], "nothing here runs kvcache"),
])
def test_a_sweep_that_would_time_nothing_is_refused(tmp_path, argv, words, capsys):
    """An op none of the chosen providers can run here was an empty table and exit status 0."""
    message = _refused(argv + ["--quick", "--out", str(tmp_path)], capsys)
    assert words in message and "providers for it here" in message
    assert not (tmp_path / "results.json").exists()


def test_an_inference_op_in_a_sweep_without_forward_is_refused(tmp_path, capsys):
    """kvcache has a forward only: a backward-only sweep dropped it without a word (an empty
    table and exit status 0 where it was alone)."""
    message = _refused(["--ops", "sdpa,kvcache", "--passes", "backward", "--quick", "--out",
                        str(tmp_path)], capsys)
    assert "--passes: kvcache has only a forward pass" in message
    assert not (tmp_path / "results.json").exists()


def test_a_backward_only_sweep_with_memory_writes_its_plots(tmp_path, capsys):
    """Peak memory is measured for forward passes only: a backward-only sweep has none to
    plot (it raised after the sweep, before the table)."""
    main(["--quick", "--ops", "additive", "--seqlens", "16", "--providers", "attnx-cpu",
          "--passes", "backward", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").exists() and (tmp_path / "throughput_additive.png").exists()
    assert not (tmp_path / "memory_additive.png").exists()
    assert "additive" in capsys.readouterr().out


def test_refused_runs_leave_no_folder_behind(tmp_path, capsys):
    """An unknown op was refused after --out's folder had been made."""
    assert "--ops: unknown ['foo']" in _refused(["--ops", "foo", "--out", str(tmp_path / "new")],
                                                capsys)
    assert not (tmp_path / "new").exists()


def test_out_must_be_a_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert "--out: expected a folder" in _refused(["--quick", "--out", str(tmp_path / "file")], capsys)


def test_kvcache_and_varlen_take_the_sweep_options(tmp_path):
    """--seqlens and --head-dims shape the kvcache and varlen cases too."""
    main(["--quick", "--ops", "kvcache,varlen", "--seqlens", "40,97", "--head-dims", "32",
          "--out", str(tmp_path), "--repeats", "1", "--threads", "1", "--no-memory",
          "--providers", "attnx-cpu"])
    cases = [r["case"] for r in json.loads((tmp_path / "results.json").read_text())["results"]]
    assert {c["seqlen_k"] for c in cases if c["op"] == "kvcache"} == {40, 97}
    assert {tuple(c["lengths"]) for c in cases if c["op"] == "varlen"} == {(40, 97)}
    assert {c["head_dim"] for c in cases} == {32}


def test_ring_world_two_tiny_run_writes_table_json_and_plot(tmp_path, capsys):
    """`attnx bench --world 2`: two gloo ranks, both layouts, timed against the single call."""
    assert main(["--world", "2", "--seqlens", "32", "--head-dims", "8", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["device"]["type"] == "cpu" and doc["device"]["name"] == doc["cpu"]
    assert doc["software"]["torch"] == torch.__version__
    assert doc["shape"] == {"batch": 1, "heads": 1, "head_dim": 8}
    assert [(r["world"], r["length"], r["layout"]) for r in doc["rows"]] == [
        (2, 32, "zigzag"), (2, 32, "contiguous")]
    for r in doc["rows"]:
        assert len(r["ring_s"]) == len(r["ring_cpu_s"]) == len(r["compute_s"]) == 2
        assert min(r["ring_s"]) > 0 and r["single_s"] > 0
        assert r["ideal_s"] == pytest.approx(r["single_s"] / 2)
        assert r["speedup"] == pytest.approx(r["single_s"] / max(r["ring_s"]))
        assert all(0 <= s <= 1 for s in r["comm_share"])
    out = capsys.readouterr().out
    assert " 2     32     zigzag" in out and "results.json" in out
    assert (tmp_path / "ring_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
