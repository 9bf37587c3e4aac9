"""MoonViT-V2 + patch-merger projector (report §2.4; names and totals: checkpoint-layout.md §2.8)."""

import pytest
import torch
import torch.nn.functional as F

from k3.config import VISION_ACTIVATIONS, ConfigError, VisionConfig
from k3.model import vision
from k3.model.vision import MoonViT, PatchMergerProjector, VisionEncoder, merge_image_embeddings, pixel_shuffle

RELEASE_TOTAL = 447_358_976
RELEASE_VIT = 401_214_464  # conv 602,112 + table 4,194,304 + 27 x 14,682,112 + final norm 1,024
RELEASE_PROJECTOR = 46_144_512  # 4096*4096 + 7168*4096 + 7168


def release_names() -> dict[str, tuple[int, ...]]:
    """Every vision tensor of the release (checkpoint-layout.md §2.8) with its shape."""
    names = {
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }
    for i in range(27):
        b = f"vision_tower.encoder.blocks.{i}."
        names.update({
            b + "wqkv.weight": (3 * 1536, 1024), b + "wo.weight": (1024, 1536),
            b + "mlp.fc0.weight": (4096, 1024), b + "mlp.fc1.weight": (1024, 4096),
            b + "norm0.weight": (1024,), b + "norm1.weight": (1024,),
        })
    return names


@pytest.fixture(scope="module")
def release_meta():
    with torch.device("meta"):
        return VisionEncoder(VisionConfig())


@pytest.fixture
def tiny():
    cfg = VisionConfig.tiny()
    enc = VisionEncoder(cfg).init_weights(seed=0).eval()
    with torch.no_grad():  # non-trivial norm weights so every norm is exercised
        g = torch.Generator().manual_seed(1)
        for name, p in enc.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return cfg, enc


# --- release shapes ------------------------------------------------------------------------------------
def test_release_param_counts_on_meta(release_meta):
    vit = sum(p.numel() for p in release_meta.vision_tower.parameters())
    proj = sum(p.numel() for p in release_meta.mm_projector.parameters())
    assert vit == RELEASE_VIT
    assert proj == RELEASE_PROJECTOR
    assert vit + proj == RELEASE_TOTAL
    assert round(vit / 1e6, 1) == 401.2 and round(proj / 1e6, 1) == 46.1


def test_release_state_dict_names_and_shapes(release_meta):
    sd = release_meta.state_dict()
    want = release_names()
    assert len(sd) == 168
    assert set(sd) == set(want)
    for k, shape in want.items():
        assert tuple(sd[k].shape) == shape, k
    block0 = sorted(k for k in sd if ".blocks.0." in k)
    assert block0 == sorted(f"vision_tower.encoder.blocks.0.{n}.weight"
                            for n in ("wqkv", "wo", "mlp.fc0", "mlp.fc1", "norm0", "norm1"))
    assert sorted(k for k in sd if k.startswith("mm_projector.")) == [
        "mm_projector.post_norm.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"]
    # the sub-modules on their own give the short names
    assert "patch_embed.proj.weight" in release_meta.vision_tower.state_dict()
    assert "encoder.blocks.0.wqkv.weight" in release_meta.vision_tower.state_dict()
    assert set(release_meta.mm_projector.state_dict()) == {"proj.0.weight", "proj.2.weight", "post_norm.weight"}
    assert not any(k.startswith("language_model.") for k in sd)


def test_no_parameter_has_a_bias(release_meta):
    assert not any("bias" in n for n, _ in release_meta.named_parameters())
    for m in release_meta.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            assert m.bias is None


# --- config ------------------------------------------------------------------------------------------
def test_config_roundtrip_and_official_keys():
    cfg = VisionConfig()
    d = cfg.to_dict()
    assert d["merge_kernel_size"] == [2, 2] and d["merge_type"] == "sd2_tpool"
    assert d["mm_projector_type"] == "patchmergerv2" and d["pos_emb_type"] == "divided_fixed"
    assert VisionConfig.from_dict(d) == cfg
    # the whole config.json works too; unknown keys are ignored
    official = {"model_type": "kimi_k3", "vision_config": {**d, "some_future_key": 3, "patch_size": 14}}
    assert VisionConfig.from_dict(official) == cfg
    t = VisionConfig.tiny()
    assert VisionConfig.from_dict(t.to_dict()) == t
    assert cfg.head_dim == 128 and cfg.projector_input_size == 4096
    assert cfg.num_image_tokens(448, 896) == 16 * 32


@pytest.mark.parametrize("change, field", [
    ({"qkv_hidden_size": 100}, "qkv_hidden_size"),
    ({"vt_num_hidden_layers": 0}, "vt_num_hidden_layers"),
    ({"merge_kernel_size": (2,)}, "merge_kernel_size"),
    ({"mm_hidden_size": 512}, "mm_hidden_size"),
    ({"merge_type": "avgpool"}, "merge_type"),
    ({"pos_emb_interpolation_mode": "nearest"}, "pos_emb_interpolation_mode"),
    ({"projector_ln_eps": 0}, "projector_ln_eps"),
])
def test_config_validation_names_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        VisionConfig(**change)


def test_config_from_dict_type_errors():
    with pytest.raises(ConfigError, match="vt_hidden_size"):
        VisionConfig.from_dict({"vt_hidden_size": "1024"})
    with pytest.raises(ConfigError, match="merge_kernel_size"):
        VisionConfig.from_dict({"merge_kernel_size": 2})


def test_config_accepts_exactly_the_activations_the_encoder_implements():
    assert sorted(vision._ACTIVATIONS) == sorted(VISION_ACTIVATIONS)
    for name in VISION_ACTIVATIONS:
        VisionConfig(activation_func=name, projector_hidden_act=name)
    with pytest.raises(ConfigError, match="activation_func"):
        VisionConfig(activation_func="relu")


# --- forward -------------------------------------------------------------------------------------------
@torch.no_grad()
def test_tiny_forward_token_count_and_shape(tiny):
    cfg, enc = tiny
    x = torch.randn(2, 3, 112, 168)  # 8x12 patches -> 4x6 merged tokens
    out = enc(x)
    assert isinstance(out, list) and len(out) == 2
    for o in out:
        assert o.shape == (4 * 6, cfg.text_hidden_size)
        assert torch.isfinite(o).all()
    assert cfg.num_image_tokens(112, 168) == 24
    packed = enc(x, packed=True)
    assert torch.equal(packed, torch.cat(out))
    # post_norm is the last op: every token has RMS-normalised (then scaled) output (eps 1e-5 shaves a little)
    w = enc.mm_projector.post_norm.weight
    assert torch.allclose((out[0] / w).pow(2).mean(-1), torch.ones(24), atol=2e-2)


@torch.no_grad()
def test_images_of_different_sizes_and_no_cross_image_attention(tiny):
    cfg, enc = tiny
    g = torch.Generator().manual_seed(3)
    imgs = [torch.randn(3, 56, 56, generator=g), torch.randn(3, 224, 112, generator=g),
            torch.randn(3, 56, 56, generator=g), torch.randn(3, 28, 308, generator=g)]
    out = enc(imgs)
    assert [o.shape[0] for o in out] == [4, 8 * 4, 4, 11]
    for im, o in zip(imgs, out):  # each image alone gives the same tokens (batched grouping changes nothing)
        assert torch.allclose(enc(im.unsqueeze(0))[0], o, atol=1e-5, rtol=1e-5)
    # changing one image of a batch leaves the others' tokens unchanged
    x = torch.randn(3, 3, 84, 112, generator=g)
    a = enc(x)
    x[1] += 1.0
    b = enc(x)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[2], b[2], atol=1e-6)
    assert not torch.allclose(a[1], b[1])


def test_bad_image_sizes_raise(tiny):
    cfg, enc = tiny
    with pytest.raises(ValueError, match="multiple of 28x28"):
        enc(torch.randn(1, 3, 42, 56))
    with pytest.raises(ValueError, match="3 channels"):
        enc(torch.randn(1, 4, 56, 56))
    with pytest.raises(ValueError, match="multiple of 28x28"):
        cfg.num_image_tokens(30, 28)


@torch.no_grad()
def test_bf16_forward_finite(tiny):
    cfg, enc = tiny
    enc = enc.to(torch.bfloat16)
    out = enc(torch.randn(2, 3, 112, 140))
    assert all(o.dtype == torch.bfloat16 and torch.isfinite(o).all() for o in out)
    assert out[0].shape == (4 * 5, cfg.text_hidden_size)


def test_backward_reaches_every_parameter(tiny):
    cfg, enc = tiny
    out = enc(torch.randn(1, 3, 84, 84), packed=True)
    out.square().sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# --- pixel shuffle ordering ------------------------------------------------------------------------------
def test_pixel_shuffle_order():
    h, w = 4, 6
    grid = torch.arange(h * w, dtype=torch.float32).reshape(1, h, w, 1)  # value = 6*row + col
    m = pixel_shuffle(grid, (2, 2))
    assert m.shape == (1, 2 * 3, 4)
    for i in range(2):
        for j in range(3):
            r, c = 2 * i, 2 * j
            want = [w * r + c, w * r + c + 1, w * (r + 1) + c, w * (r + 1) + c + 1]
            assert m[0, 3 * i + j].tolist() == want
    # with C > 1 each patch keeps its whole vector, contiguous
    x = torch.randn(2, 4, 6, 5)
    m = pixel_shuffle(x, (2, 2))
    assert torch.equal(m[1, 4, 5:10], x[1, 2, 3])  # token (1,1) slot 1 = patch (2,3)
    assert torch.equal(m[0, 2, 15:20], x[0, 1, 5])  # token (0,2) slot 3 = patch (1,5)


@torch.no_grad()
def test_merged_tokens_hold_the_expected_patches_end_to_end():
    """Identity blocks, zero position table and a conv that reads a patch id: the tower's merged token (i, j)
    must hold patches (2i,2j), (2i,2j+1), (2i+1,2j), (2i+1,2j+1) in that order."""
    cfg = VisionConfig.tiny()
    vt = MoonViT(cfg).eval()
    p, C = cfg.patch_size, cfg.vt_hidden_size
    for b in vt.encoder.blocks:
        b.wo.weight.zero_()
        b.mlp.fc1.weight.zero_()
    vt.patch_embed.pos_emb.weight.zero_()
    vt.patch_embed.proj.weight.zero_()
    vt.patch_embed.proj.weight[0, 0] = 1.0 / (p * p)  # channel 0 = mean of red = patch id
    vt.patch_embed.proj.weight[1, 1] = 1.0 / (p * p)  # channel 1 = mean of green = 1
    h, w = 6, 4
    img = torch.zeros(1, 3, h * p, w * p)
    img[:, 1] = 1.0
    for r in range(h):
        for c in range(w):
            img[0, 0, r * p:(r + 1) * p, c * p:(c + 1) * p] = 1 + r * w + c
    (m,) = vt(img)
    assert m.shape == (3 * 2, 4 * C)
    ids = (m[:, 0::C] / m[:, 1::C]).round().long() - 1  # channel0/channel1 survives the RMSNorm
    for i in range(3):
        for j in range(2):
            r, c = 2 * i, 2 * j
            assert ids[2 * i + j].tolist() == [r * w + c, r * w + c + 1, (r + 1) * w + c, (r + 1) * w + c + 1]


# --- position table -----------------------------------------------------------------------------------------
def test_pos_emb_native_grid_is_the_table_and_resizes_otherwise(tiny):
    cfg, enc = tiny
    pe = enc.vision_tower.patch_embed.pos_emb
    W = pe.weight
    assert W.shape == (8, 8, cfg.vt_hidden_size)
    assert torch.equal(pe.table(8, 8), W)
    # bilinear, align_corners=False: halving the grid averages 2x2 blocks
    half = F.avg_pool2d(W.detach().permute(2, 0, 1)[None], 2)[0].permute(1, 2, 0)
    assert torch.allclose(pe.table(4, 4), half, atol=1e-6)
    assert pe.table(12, 6).shape == (12, 6, cfg.vt_hidden_size)
    with torch.no_grad():
        W.fill_(0.25)
    assert torch.allclose(pe.table(13, 3), torch.full((13, 3, cfg.vt_hidden_size), 0.25))


@torch.no_grad()
def test_pos_emb_is_added_per_patch_at_native_size():
    cfg = VisionConfig.tiny()
    vt = MoonViT(cfg)
    pe = vt.patch_embed
    x = torch.randn(1, 3, 8 * 14, 8 * 14)
    got = pe(x)
    want = pe.proj(x).permute(0, 2, 3, 1) + pe.pos_emb.weight
    assert torch.allclose(got, want, atol=1e-6)


# --- merging into the text stream ------------------------------------------------------------------------------
def test_merge_image_embeddings_places_tokens_in_order():
    P, D = 99, 6
    ids = torch.tensor([[1, P, P, 2, 3, P],
                        [P, P, 4, 5, P, 7]])
    emb = torch.randn(2, 6, D, requires_grad=True)
    imgs = [torch.full((2, D), 10.0), torch.full((1, D), 20.0), torch.arange(3 * D, dtype=torch.float32).view(3, D)]
    imgs = [t.requires_grad_() for t in imgs]
    out = merge_image_embeddings(emb, ids, imgs, P)
    flat_tokens = torch.cat([t.detach() for t in imgs])
    slots = (ids == P).nonzero().tolist()
    for k, (b, t) in enumerate(slots):
        assert torch.equal(out[b, t], flat_tokens[k])
    keep = ids != P
    assert torch.equal(out[keep], emb.detach()[keep])
    assert not torch.equal(emb.detach()[ids == P], out.detach()[ids == P])  # out-of-place
    out.sum().backward()
    assert all(t.grad is not None and torch.equal(t.grad, torch.ones_like(t)) for t in imgs)
    assert torch.equal(emb.grad, keep.unsqueeze(-1).float().expand(2, 6, D))
    # a packed tensor works the same
    assert torch.equal(merge_image_embeddings(emb.detach(), ids, flat_tokens, P), out.detach())


def test_merge_image_embeddings_errors_and_no_images():
    P, D = 7, 4
    ids = torch.tensor([[1, P, P, 2]])
    emb = torch.randn(1, 4, D)
    with pytest.raises(ValueError, match="2 image placeholder tokens .* 3 token embeddings"):
        merge_image_embeddings(emb, ids, [torch.randn(3, D)], P)
    with pytest.raises(ValueError, match="2 image placeholder tokens .* 0 token embeddings"):
        merge_image_embeddings(emb, ids, [], P)
    with pytest.raises(ValueError, match="width 5"):
        merge_image_embeddings(emb, ids, [torch.randn(2, 5)], P)
    with pytest.raises(ValueError, match="does not match"):
        merge_image_embeddings(emb, ids[:, :3], [torch.randn(2, D)], P)
    no_img = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(merge_image_embeddings(emb, no_img, [], P), emb)


@torch.no_grad()
def test_encoder_output_feeds_merge(tiny):
    cfg, enc = tiny
    P = 5
    imgs = [torch.randn(3, 56, 84), torch.randn(3, 28, 28)]
    n = [cfg.num_image_tokens(*im.shape[1:]) for im in imgs]
    ids = torch.tensor([[1] + [P] * n[0] + [2] + [P] * n[1] + [3]])
    emb = torch.zeros(1, ids.shape[1], cfg.text_hidden_size)
    out = merge_image_embeddings(emb, ids, enc(imgs), P)
    assert torch.allclose(out[0, 1:1 + n[0]], enc(imgs[:1])[0], atol=1e-5)
    assert torch.allclose(out[0, 2 + n[0]:2 + n[0] + n[1]], enc(imgs[1:])[0], atol=1e-5)
    assert (out[0, [0, 1 + n[0], -1]] == 0).all()


def test_projector_standalone_shapes():
    cfg = VisionConfig.tiny()
    pj = PatchMergerProjector(cfg)
    y = pj(torch.randn(3, 5, 4 * cfg.vt_hidden_size))
    assert y.shape == (3, 5, cfg.text_hidden_size)


# --- integration with the language model and the checkpoint layout -------------------------------------
def _vl_cfg():
    from k3.config import K3Config

    vc = VisionConfig.tiny().to_dict()
    return K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vision_config=vc,
                                                media_placeholder_token_id=7)


@torch.no_grad()
def test_language_model_with_images_round_trips_in_release_layout(tmp_path):
    import json

    from k3.checkpoint import from_pretrained, save_pretrained
    from k3.model.model import K3ForCausalLM

    cfg = _vl_cfg()
    model = K3ForCausalLM(cfg).init_weights(seed=0).eval()
    image = torch.randn(1, 3, 56, 56)
    n_img = VisionConfig.tiny().num_image_tokens(56, 56)
    ids = torch.tensor([[5] * 3 + [7] * n_img + [9] * 4])
    out = model(ids, pixel_values=image).logits
    text_only = model(ids).logits
    assert out.shape == text_only.shape and not torch.allclose(out, text_only)
    save_pretrained(model, tmp_path / "ck")
    wm = json.load(open(tmp_path / "ck" / "model.safetensors.index.json"))["weight_map"]
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in wm and "mm_projector.post_norm.weight" in wm
    d = json.load(open(tmp_path / "ck" / "config.json"))
    assert d["vision_config"]["vt_hidden_size"] == VisionConfig.tiny().vt_hidden_size
    assert d["media_placeholder_token_id"] == 7
    loaded = from_pretrained(tmp_path / "ck")
    assert torch.equal(loaded(ids, pixel_values=image).logits, out)
    # A text-only model reads the same files and ignores the vision tensors.
    from k3.checkpoint import load_state_into

    text_model = K3ForCausalLM(cfg.replace(vision_config=None))
    load_state_into(text_model, str(tmp_path / "ck"))
    assert torch.equal(text_model(ids).logits, text_only)
