"""benchmarks/hybrid_decode_cost.py: the computed cache bytes are k3.info's, the all-MLA arm's cache is its per-token
rows times the context, the floor's weight bytes are the active parameters', and the measured path (an engine whose
pages are set directly, stepped through its runner) decodes what the model's plain cached decode does."""

import copy
import json

import pytest
import torch

from k3.config import K3Config
from k3.info import model_info, sequence_cache_bytes
from tests.helpers import load_benchmark, one_torch_thread, randomize_

hdc = load_benchmark("hybrid_decode_cost")


@pytest.mark.parametrize("preset", ["tiny", "k3-mini"])
def test_computed_cache_bytes_are_info_numbers(preset):
    rows = hdc.computed_rows([preset], [256, 8192, 1048576], list(hdc.ARMS), batch=1, bw_tbs=4.0)
    assert len(rows) == 3 * 3
    for r in rows:
        cfg = hdc.arm_config(K3Config.from_preset(preset), r["arm"])
        info = model_info(cfg)  # bf16 cache, as the computed table counts it
        assert r["cache_bytes"] == info.kda_state_bytes + info.kda_conv_bytes \
            + info.mla_cache_bytes_per_token * r["context"]
        assert r["cache_bytes"] == sequence_cache_bytes(info, r["context"])
        assert (r["kda_layers"], r["mla_layers"]) == (len(cfg.kda_layers), len(cfg.full_attn_layers))


def test_release_cache_is_the_specs_27_gib_at_1m():
    """SPEC.md: 576 values per token per MLA layer, 27 GiB at 1M tokens for the release in bf16; plus its fixed
    KDA state (k3 info: 434.1 MB fp32 + 30.5 MB conv tails)."""
    row = hdc.computed_rows(["k3"], [2**20], ["hybrid"], batch=1, bw_tbs=4.0)[0]
    info = model_info(K3Config.from_preset("k3"))
    assert info.mla_cache_bytes_per_token * 2**20 == 27 * 2**30
    assert row["cache_bytes"] == 27 * 2**30 + info.kda_state_bytes + info.kda_conv_bytes
    assert info.kda_state_bytes == 434_110_464


def test_all_mla_cache_is_rows_times_context_times_layers():
    cfg = K3Config.from_preset("k3-mini")
    full = hdc.arm_config(cfg, "all-MLA")
    assert full.kda_layers == [] and full.full_attn_layers == list(range(1, cfg.num_hidden_layers + 1))
    assert full.ablations() and not cfg.ablations()  # the arm is marked as not K3; the preset is K3
    per_token_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2  # bf16 latent + shared key dims
    rows = {(r["arm"], r["context"]): r for r in
            hdc.computed_rows(["k3-mini"], [8192, 131072], ["hybrid", "all-MLA"], batch=1, bw_tbs=4.0)}
    for L in (8192, 131072):
        assert rows["all-MLA", L]["cache_bytes"] == per_token_layer * L * cfg.num_hidden_layers
    # the hybrid grows by its MLA layers' rows only; its KDA state is the same at every length
    grow = rows["hybrid", 131072]["cache_bytes"] - rows["hybrid", 8192]["cache_bytes"]
    assert grow == per_token_layer * (131072 - 8192) * len(cfg.full_attn_layers)
    # the ratio is the all-MLA floor over the hybrid's, and the cache ratio stays under layers / MLA layers
    r = rows["all-MLA", 131072]
    assert r["ratio"] == pytest.approx(r["floor_ms"] / rows["hybrid", 131072]["floor_ms"])
    assert 1 < r["cache_ratio"] < cfg.num_hidden_layers / len(cfg.full_attn_layers)
    with pytest.raises(ValueError, match="context"):
        sequence_cache_bytes(model_info(cfg), -1)
    with pytest.raises(ValueError, match="arm"):
        hdc.arm_config(cfg, "all-RNN")


def test_weight_bytes_are_the_active_parameters():
    mini = K3Config.from_preset("k3-mini")
    info = model_info(mini)
    assert hdc.weight_bytes_per_step(mini, info, batch=1) == pytest.approx(2 * info.active)  # bf16, k/n experts
    routed = info.breakdown["routed experts"][0]
    many = hdc.weight_bytes_per_step(mini, info, batch=10_000)  # every expert touched
    assert many == pytest.approx(2 * (info.active - info.breakdown["routed experts"][1]) + 2 * routed)
    rel = K3Config.from_preset("k3")  # the release: routed experts in MXFP4 (4 bits + a scale per 32)
    ri = model_info(rel)
    act = ri.breakdown["routed experts"][1]
    assert hdc.weight_bytes_per_step(rel, ri, 1) == pytest.approx(2 * (ri.active - act) + act * 17 / 32, rel=1e-9)


def _plain_decode(model, prompts, steps):
    """Prefill `prompts` [B, T] through the model's contiguous cache; return (a copy of the cache after the
    prefill, the logits [steps][B, V] of decoding tokens `steps` [steps][B] one at a time after it)."""
    cache = model.new_cache()
    with torch.no_grad():
        model(prompts, cache=cache)
        filled = copy.deepcopy(cache)
        logits = [model(torch.tensor(t)[:, None], cache=cache).logits[:, -1].float() for t in steps]
    return filled, logits


@pytest.mark.parametrize("arm,static", [("hybrid", False), ("all-MLA", False), ("all-KDA", False),
                                         ("hybrid", True), ("all-MLA", True)])
def test_measured_path_decodes_what_the_plain_path_does(arm, static):
    """A pool filled from a real prefill (two prompts of 37 tokens, 16-token pages: three pages per MLA layer) and
    stepped through the bench gives the model's plain cached decode, step after step (fp32: atol 1e-4, rtol 1e-4;
    the engine also stacks the projections, which changes the summation order only). `static`: the engine's
    static-buffer decode step (what a CUDA graph captures), run uncaptured on the backends a graph needs (the paged
    MLA decode's reference, the grouped MoE), with its scratch page."""
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import Backends

    cfg = hdc.arm_config(K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0), arm)
    backends = Backends(per_op={"mla_decode": "triton", "moe": "grouped"}) if static else None
    with one_torch_thread():
        model = randomize_(K3ForCausalLM(cfg, backends=backends), seed=3).eval()
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, cfg.vocab_size, (2, 37), generator=g)
        steps = torch.randint(1, cfg.vocab_size, (3, 2), generator=g).tolist()
        filled, ref = _plain_decode(model, prompts, steps)
        bench = hdc.DecodeBench(model, context=37, batch=2, room=4, page_tokens=16,
                                cuda_graphs="eager" if static else True)
        assert bench.uses_graphs == static
        n_mla = len(cfg.full_attn_layers)
        assert bench.pages_per_seq == n_mla * 3 + len(cfg.kda_layers)
        assert bench.pool.num_pages == 2 * bench.pages_per_seq + static  # the static steps' scratch page
        bench.fill_from(filled)
        if static:  # every step below replays (here: runs) the static-buffer step
            runs = []
            orig = bench.engine.runner.graphs.run
            bench.engine.runner.graphs.run = lambda *a: runs.append(orig(*a)) or runs[-1]
        for t, want in zip(steps, ref):
            torch.testing.assert_close(bench.step(t), want, atol=1e-4, rtol=1e-4)
        assert bench.positions == [40, 40]
        if static:
            assert len(runs) == 3 and all(r is not None for r in runs)  # None: it fell back to the eager step
        bench.step(steps[0])  # the fourth token of room 4
        with pytest.raises(RuntimeError, match="room"):
            bench.step(steps[0])  # a fifth would write past the 41 tokens the pages were given for


def test_random_fill_and_timing_on_tiny():
    with one_torch_thread():
        model = hdc.build_model("tiny", "hybrid", torch.device("cpu"), "auto", 4096)
        bench = hdc.DecodeBench(model, context=300, batch=1, room=8, page_tokens=128)
        bench.fill_random(seed=1)
        logits = bench.step([5])
        assert logits.shape == (1, model.config.vocab_size) and torch.isfinite(logits).all()
        t = bench.time_steps(steps=3, warmup=1)
        assert t.steps == 3 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms
        # every page a step reads was written: no MLA row of the sequence's pages is left at the pool's zeros
        mla = bench.pool.mla_view()
        for table in bench.slots[0].mla_tables:
            rows = mla[torch.tensor(table)].reshape(-1, bench.pool.mla_width)[:300]
            assert (rows.abs().sum(-1) > 0).all()
        with pytest.raises(ValueError, match="2 tokens for 1 sequences"):
            bench.step([1, 2])


def test_command_line_tiny(tmp_path, capsys):
    out, png = tmp_path / "h.json", tmp_path / "h.png"
    with one_torch_thread():
        assert hdc.main(["--presets", "tiny", "--contexts", "256", "1024", "--measure-contexts", "256", "--arms",
                         "hybrid", "all-MLA", "--steps", "2", "--warmup", "1", "--device", "cpu",
                         "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "| tiny | all-MLA (0/5) | 1K |" in text and "measured on cpu" in text
    data = json.loads(out.read_text())
    assert len(data["computed"]) == 4 and len(data["measured"]) == 2
    m = {r["arm"]: r for r in data["measured"]}
    assert m["all-MLA"]["ratio"] == pytest.approx(m["all-MLA"]["median_ms"] / m["hybrid"]["median_ms"])
    assert m["hybrid"]["cache_dtype"] == "fp32" and m["hybrid"]["allocated_bytes"] >= m["hybrid"]["cache_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*"))


def test_command_line_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as e:
        hdc.main(["--help"])
    assert e.value.code == 0
    assert "default: 50" in capsys.readouterr().out
    for bad, msg in ((["--bw-tbs", "0"], "--bw-tbs must be positive"), (["--steps", "0"], "must be positive"),
                     (["--backend", "fast", "--device", "cpu"], "needs a CUDA device")):
        with pytest.raises(SystemExit):
            hdc.main(bad + ["--no-measure"])
        assert msg in capsys.readouterr().err


def test_draft_bytes_are_the_mtp_layers_and_the_output_head():
    cfg = K3Config.from_preset("k3-mini")
    info = model_info(cfg)
    routed, other = hdc._mtp_split(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    # every MTP parameter once (the breakdown also counts the router's correction bias, a buffer of one per expert)
    assert routed + other - head + cfg.num_experts == info.breakdown["MTP"][0]
    E, I, R = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    assert routed == E * 3 * I * R
    k = cfg.num_experts_per_token
    assert hdc.draft_bytes_per_step(cfg, 1) == pytest.approx(2 * other + 2 * routed * k / E)
    # more rows touch more experts, never more than all of them
    assert hdc.draft_bytes_per_step(cfg, 1) < hdc.draft_bytes_per_step(cfg, 4) < 2 * (routed + other)


def test_speculation_floor_speedup_is_tokens_per_weight_byte_against_plain():
    """The cycle of k3-mini at batch 1 with 3 drafts all accepted, by hand: the verification reads the trunk with
    the experts 4 uniformly routed tokens touch, the first drafting step the MTP layer with 4 rows' experts, the two
    others one row's; 4 tokens against one per plain step."""
    cfg = K3Config.from_preset("k3-mini")
    info = model_info(cfg)
    E, k = cfg.num_experts, cfg.num_experts_per_token
    routed_total, routed_active = info.breakdown["routed experts"]
    mtp_routed, mtp_other = hdc._mtp_split(cfg)

    def touched(n):
        return 1 - (1 - k / E) ** n

    def trunk(n):
        return 2 * (info.active - routed_active) + 2 * routed_total * touched(n)

    def draft(n):
        return 2 * mtp_other + 2 * mtp_routed * touched(n)

    want = 4 * trunk(1) / (trunk(4) + draft(4) + 2 * draft(1))
    got = hdc.speculation_floor_speedup(cfg, info, 1, 3, 4)
    assert got == pytest.approx(want, rel=1e-12)
    assert 1.4 < got < 1.6  # at batch 1 weight traffic alone keeps 3 drafts well below 2x
    # fewer accepted tokens, less speed-up; a bigger batch shares the weights among more sequences
    fewer = hdc.speculation_floor_speedup(cfg, info, 1, 3, 2.5)
    wider = hdc.speculation_floor_speedup(cfg, info, 16, 3, 4)
    assert fewer < got < wider
    for drafts, accepted in [(0, 1), (3, 0.5), (3, 5)]:
        with pytest.raises(ValueError, match="drafts"):
            hdc.speculation_floor_speedup(cfg, info, 1, drafts, accepted)
    no_mtp = cfg.replace(num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no MTP layer"):
        hdc.draft_bytes_per_step(no_mtp, 1)


def test_speculation_table_lists_presets_with_an_mtp_layer(capsys):
    assert hdc.main(["--presets", "tiny", "k3", "--contexts", "256", "--no-measure", "--speculation", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "| tiny | 1 |" in out and "| tiny | 64 |" in out and "| k3 | 1 |" not in out  # k3 has no MTP layer
    rows = hdc.speculation_rows(["tiny"], [1, 64], [1, 3])
    assert [r["batch"] for r in rows] == [1, 64]
    assert rows[0]["floor_speedup"][1] < rows[0]["floor_speedup"][3]
