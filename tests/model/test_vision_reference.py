"""The vision encoder (k3.model.vision) against an independent reference written from the report's equations
(tests/model/vision_reference.py: native-resolution patching, the 2-D position table, the blocks, the 2x2 pixel
shuffle, the projector), on random weights in fp32; the release's vision tensor names, and their save/load round
trip through k3.checkpoint.

Tolerance: the fp32 module against the float64 reference, 1e-5 of the largest output magnitude (two blocks of fp32
matrix products and softmaxes give ~1e-6; a convention error, such as a transposed position table or a wrong qkv
row order, moves the output by more than 1e-1)."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3.config import K3Config, VisionConfig
from k3.model.vision import VisionEncoder
from model.vision_reference import patchify, position_table, reference_image_tokens

TOL = 1e-5  # relative to the reference's largest magnitude (see the module docstring)
# Non-square, different sizes (patch grids 4x6, 8x8 = the tiny table's own size, 12x14 > the table, 2x4, 4x6 again).
SIZES = [(56, 84), (112, 112), (168, 196), (28, 56), (56, 84)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def random_encoder(cfg: VisionConfig, seed: int = 0) -> VisionEncoder:
    """Weights at unit-ish scale (matrices N(0, 1/fan_in), position table N(0, 1), norms 1 + N(0, 0.1^2)), so the
    attention logits are O(1) and every norm weight matters."""
    enc = VisionEncoder(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("pos_emb.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
    return enc


def images(sizes=SIZES, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=g) for h, w in sizes]


@pytest.fixture(scope="module")
def tiny():
    cfg = VisionConfig.tiny()
    return cfg, random_encoder(cfg)


@pytest.fixture(scope="module")
def reference_out(tiny):
    cfg, enc = tiny
    with torch.no_grad():
        return reference_image_tokens(enc.state_dict(), cfg.to_dict(), images())


# --- the reference's own building blocks are what they claim ------------------------------------------------------
def test_reference_patchify_is_the_stride_14_convolution():
    g = torch.Generator().manual_seed(0)
    img, w = torch.randn(3, 42, 70, generator=g, dtype=torch.float64), torch.randn(5, 3, 14, 14, generator=g,
                                                                                  dtype=torch.float64)
    conv = F.conv2d(img[None], w, stride=14)[0]  # [5, 3, 5]
    assert torch.allclose(patchify(img, 14) @ w.reshape(5, -1).T, conv.permute(1, 2, 0).reshape(15, 5), atol=1e-12)


@pytest.mark.parametrize("h,w", [(8, 8), (4, 6), (12, 14), (3, 11), (1, 1)])
def test_reference_position_table_is_bilinear_without_corner_alignment(h, w):
    table = torch.randn(8, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(h * 100 + w))
    want = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    assert torch.allclose(position_table(table, h, w), want.permute(1, 2, 0), atol=1e-12)


# --- the module equals the reference ---------------------------------------------------------------------------------
@torch.no_grad()
def test_encoder_equals_reference_on_mixed_image_sizes(tiny, reference_out):
    cfg, enc = tiny
    out = enc(images())  # all five images in one packed sequence
    assert [o.shape for o in out] == [(cfg.num_image_tokens(h, w), cfg.text_hidden_size) for h, w in SIZES]
    for i, (o, r) in enumerate(zip(out, reference_out)):
        assert rel(o, r) < TOL, (i, SIZES[i], rel(o, r))


@torch.no_grad()
def test_same_sized_batch_tensor_equals_reference(tiny):
    cfg, enc = tiny
    x = torch.randn(3, 3, 84, 140, generator=torch.Generator().manual_seed(5))
    ref = reference_image_tokens(enc.state_dict(), cfg.to_dict(), list(x))
    for o, r in zip(enc(x), ref):
        assert rel(o, r) < TOL


@torch.no_grad()
def test_packed_encoding_equals_encoding_each_image_alone(tiny, reference_out):
    # One packed sequence of five images against five separate forwards: attention is restricted to each image,
    # so only fp32 rounding (different matrix shapes) may differ.
    cfg, enc = tiny
    imgs = images()
    packed = enc(imgs)
    x, packing, grids = enc.vision_tower.encode_packed(imgs)
    assert packing.lengths == tuple(h * w for h, w in grids) == (24, 64, 168, 8, 24)
    assert x.shape == (sum(packing.lengths), cfg.vt_hidden_size)
    for im, o, r in zip(imgs, packed, reference_out):
        alone = enc([im])[0]
        assert rel(o, alone) < TOL
        assert rel(alone, r) < TOL
    # the projector's packed output (packed=True) is the per-image outputs concatenated
    assert torch.equal(enc(imgs, packed=True), torch.cat(packed))


@torch.no_grad()
def test_reference_detects_convention_errors(tiny):
    # The comparison is sensitive to each inferred convention the module docstring lists: the reference fed a state
    # dict with the position table transposed (columns for rows), wqkv's q and k rows swapped, or proj.0's input
    # columns of the window's top-right and bottom-left patches swapped (a column-major 2x2 window), or the
    # projector's exact gelu replaced by the tanh form, is far from the module (measured: 1.2, 0.37, 1.1 and
    # 2.3e-4 relative; the gelu forms differ by ~1e-4 of their input), each more than 10x the tolerance.
    cfg, enc = tiny
    sd = enc.state_dict()
    out = enc(images())
    C, Q = cfg.vt_hidden_size, cfg.qkv_hidden_size
    pos, qkv, p0 = ("vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
                    "mm_projector.proj.0.weight")
    q_k_swapped = torch.cat([sd[qkv][Q:2 * Q], sd[qkv][:Q], sd[qkv][2 * Q:]])
    column_major = torch.cat([sd[p0][:, :C], sd[p0][:, 2 * C:3 * C], sd[p0][:, C:2 * C], sd[p0][:, 3 * C:]], 1)
    for bad_sd, bad_cfg in [({**sd, pos: sd[pos].transpose(0, 1)}, cfg),
                            ({**sd, qkv: q_k_swapped}, cfg),
                            ({**sd, p0: column_major}, cfg),
                            (sd, cfg.replace(projector_hidden_act="gelu_pytorch_tanh"))]:
        wrong = reference_image_tokens(bad_sd, bad_cfg.to_dict(), images())
        assert max(rel(o, r) for o, r in zip(out, wrong)) > 10 * TOL


def test_reference_reads_every_vision_tensor(tiny):
    # Every tensor of the module's state dict reaches the reference's output (a gradient through each): the module
    # holds no parameter the equations do not use.
    cfg, enc = tiny
    sd = {k: v.detach().clone().requires_grad_() for k, v in enc.state_dict().items()}
    out = reference_image_tokens(sd, cfg.to_dict(), images(SIZES[:2]))
    sum(o.square().sum() for o in out).backward()
    for k, v in sd.items():
        assert v.grad is not None and v.grad.abs().sum() > 0, k


def test_encoder_gradients_equal_reference_gradients(tiny):
    # The packed forward's backward (through the vision_attn op) against autograd through the reference: the
    # gradient of every parameter, 1e-4 of its largest magnitude (fp32 backward against float64).
    cfg, enc = tiny
    imgs = images(SIZES[:4])
    enc.zero_grad(set_to_none=True)
    weights = torch.randn(sum(cfg.num_image_tokens(h, w) for h, w in SIZES[:4]), cfg.text_hidden_size,
                          generator=torch.Generator().manual_seed(9))
    (enc(imgs, packed=True) * weights).sum().backward()
    sd = {k: v.detach().clone().requires_grad_() for k, v in enc.state_dict().items()}
    ref = torch.cat(reference_image_tokens(sd, cfg.to_dict(), imgs))
    (ref * weights.double()).sum().backward()
    params = dict(enc.named_parameters())
    for k, v in sd.items():
        assert rel(params[k].grad, v.grad) < 1e-4, k
    enc.zero_grad(set_to_none=True)


# --- official names: the release's 168 vision tensors, loaded and saved ----------------------------------------------
def release_vision_tensors() -> dict[str, tuple[int, ...]]:
    """checkpoint-layout.md §2.8 with the shapes of §3's vision_config (1024 wide, qkv 1536, MLP 4096, 27 blocks,
    14x14 patches, a 64x64 table, a 4096 -> 4096 -> 7168 projector)."""
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
        names.update({b + "wqkv.weight": (4608, 1024), b + "wo.weight": (1024, 1536),
                      b + "mlp.fc0.weight": (4096, 1024), b + "mlp.fc1.weight": (1024, 4096),
                      b + "norm0.weight": (1024,), b + "norm1.weight": (1024,)})
    return names


def test_release_vision_config_gives_exactly_the_official_tensors():
    with torch.device("meta"):
        enc = VisionEncoder(VisionConfig())
    sd = enc.state_dict()
    want = release_vision_tensors()
    assert len(want) == 168
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert sum(v.numel() for v in sd.values()) == 447_358_976  # §2.8's total


def _vl_model(seed: int = 0):
    from k3.model.model import K3ForCausalLM

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vision_config=VisionConfig.tiny().to_dict(),
                                               media_placeholder_token_id=7)
    model = K3ForCausalLM(cfg).init_weights(seed=seed).eval()
    model.vision.load_state_dict(random_encoder(VisionConfig.tiny(), seed=seed + 1).state_dict())
    return model


@torch.no_grad()
def test_vision_tensors_round_trip_bit_exact_under_official_names(tmp_path):
    from k3.checkpoint import from_pretrained, read_checkpoint_tensors, save_pretrained

    model = _vl_model()
    own = model.vision.state_dict()  # the names without the model's `vision.` attribute: vision_tower.*, mm_projector.*
    save_pretrained(model, tmp_path / "ck")
    disk = read_checkpoint_tensors(str(tmp_path / "ck"))
    on_disk = {k: v for k, v in disk.items() if k.startswith(("vision_tower.", "mm_projector."))}
    assert set(on_disk) == set(own)  # no prefix, no renaming, nothing missing or extra
    assert not any("vision" in k or "mm_projector" in k for k in set(disk) - set(on_disk))
    for k, v in own.items():
        assert on_disk[k].dtype == v.dtype and torch.equal(on_disk[k], v), k
    loaded = from_pretrained(tmp_path / "ck")
    for k, v in loaded.vision.state_dict().items():
        assert torch.equal(v, own[k]), k
    # the reference, reading the files' tensors by their official names, equals the loaded encoder
    imgs = images(SIZES[:2])
    ref = reference_image_tokens(on_disk, model.config.vision_config, imgs)
    for o, r in zip(loaded.vision(imgs), ref):
        assert rel(o, r) < TOL
    # saved in bf16, each vision tensor is its bf16 rounding, and loads back as exactly that
    save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    disk16 = read_checkpoint_tensors(str(tmp_path / "bf16"))
    for k, v in own.items():
        assert disk16[k].dtype == torch.bfloat16 and torch.equal(disk16[k], v.to(torch.bfloat16)), k
    loaded16 = from_pretrained(tmp_path / "bf16")
    for k, v in loaded16.vision.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), disk16[k]), k


# --- GPU: the packed encoder on each fast attention path (not run on CPU) ------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,dtype,tol", [("varlen", torch.bfloat16, 2e-2), ("flex", torch.bfloat16, 2e-2),
                                               ("flex", torch.float32, 1e-4)])
def test_gpu_packed_encoder_on_fast_attention_matches_reference(backend, dtype, tol):
    # The release's widths (12 heads of 128, 1024 wide, 7168 out) with 2 blocks; eight images of different sizes in
    # one packed sequence. Against the same encoder (same dtype) on the reference attention (per-image SDPA): outputs
    # and every parameter's gradient, bf16 2e-2 / fp32 1e-4 of the largest magnitude, as the op's own tests. The fp32
    # run also checks the GPU's output against the float64 reference of vision_reference.py (1e-4).
    from k3.ops.registry import Backends

    cfg = VisionConfig(vt_num_hidden_layers=2)
    encs = {}
    # every other op on its reference in both, so the attention is the only difference
    for name, b in [("ref", Backends(default="torch")), ("fast", Backends(default="torch",
                                                                          per_op={"vision_attn": backend}))]:
        encs[name] = random_encoder(cfg, seed=3).cuda().to(dtype)
        for m in encs[name].modules():
            m.backends = b
    sizes = [(448, 672), (28, 28), (896, 308), (224, 224), (56, 1120), (336, 336), (28, 56), (672, 448)]
    imgs = [im.cuda().to(dtype) for im in images(sizes, seed=4)]
    out = encs["fast"](imgs, packed=True)
    want = encs["ref"](imgs, packed=True)
    assert rel(out.float(), want.float()) < tol
    dy = torch.randn(want.shape, device="cuda")
    (out.float() * dy).sum().backward()
    (want.float() * dy).sum().backward()
    ref_params = dict(encs["ref"].named_parameters())
    for name, p in encs["fast"].named_parameters():
        assert rel(p.grad.float(), ref_params[name].grad.float()) < tol, name
    if dtype == torch.float32:
        # cuDNN convolutions run fp32 as TF32 by default (torch.backends.cudnn.allow_tf32): the patch embedding's
        # conv alone then sits ~2.6e-4 from float64 (measured on an H100). Against float64 the conv runs in fp32
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            out = encs["fast"](imgs, packed=True)
        cpu_sd = {k: v.cpu() for k, v in encs["ref"].state_dict().items()}
        with torch.no_grad():
            ref64 = torch.cat(reference_image_tokens(cpu_sd, cfg.to_dict(), [im.cpu() for im in imgs[:3]]))
        assert rel(out[:ref64.shape[0]].detach().cpu(), ref64) < 1e-4
