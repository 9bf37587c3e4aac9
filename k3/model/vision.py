"""Native vision: the MoonViT-V2 encoder and its patch-merger projector (report §2.4).

MoonViT-V2 is a 27-layer ViT trained from scratch together with the LM: RMSNorm, no bias anywhere, 12 heads of
width 128 (qkv width 1536 on a 1024-wide residual stream), a gelu(tanh) MLP of width 4096, 14x14 patches and a
learned 64x64 position table bilinearly resized to each image's patch grid. Its output is pixel-shuffled 2x2
("sd2_tpool": four neighbouring patches become one 4096-wide token) and mapped by the "patchmergerv2" MLP
projector into the LM embedding width (7168).

Parameter names are the release's (checkpoint-layout.md §2.8), without any `language_model.` prefix:

    vision_tower.patch_embed.proj.weight          [1024, 3, 14, 14]   conv, stride 14
    vision_tower.patch_embed.pos_emb.weight       [64, 64, 1024]      learned 2-D table
    vision_tower.encoder.blocks.{i}.norm0.weight  [1024]              pre-attention RMSNorm
    vision_tower.encoder.blocks.{i}.wqkv.weight   [4608, 1024]        rows [q | k | v], 1536 each
    vision_tower.encoder.blocks.{i}.wo.weight     [1024, 1536]
    vision_tower.encoder.blocks.{i}.norm1.weight  [1024]              pre-MLP RMSNorm
    vision_tower.encoder.blocks.{i}.mlp.fc0.weight [4096, 1024]
    vision_tower.encoder.blocks.{i}.mlp.fc1.weight [1024, 4096]
    vision_tower.encoder.final_layernorm.weight   [1024]
    mm_projector.proj.0.weight                    [4096, 4096]        pixel-shuffled token -> hidden
    mm_projector.proj.2.weight                    [7168, 4096]        hidden -> LM width
    mm_projector.post_norm.weight                 [7168]              RMSNorm on the projector output

Projector shapes, derived from the release totals (§2.8: 447,358,976 params, ViT 401.2M + projector 46.1M):
    ViT   = conv 602,112 + pos table 4,194,304 + 27 x 14,682,112 (per block) + final norm 1,024 = 401,214,464
    rest  = 447,358,976 - 401,214,464 = 46,144,512
    proj.0 (4096x4096) + proj.2 (7168x4096) = 16,777,216 + 29,360,128 = 46,137,344, leaving exactly 7,168
so `post_norm` is a [7168] vector: it normalizes the projector *output* (after proj.2), in the LM width. A [4096]
norm (on the pixel-shuffled input, or between proj.0 and proj.2) would leave 3,072 parameters unexplained.
The ViT's own final_layernorm already normalizes every patch before the pixel shuffle, so there is no pre-norm.

Inferred details (not readable from names and shapes alone; they matter only when loading release weights):
  * wqkv rows are laid out [q; k; v], each split into heads as [heads, head_dim];
  * inside a merged token the four patch vectors are concatenated in raster order of the 2x2 window:
    (top-left, top-right, bottom-left, bottom-right);
  * the position table is resized with align_corners=False;
  * the projector activation is exact gelu (`projector_hidden_act: gelu`), the ViT MLP's is gelu(tanh)
    (`activation_func: gelu_pytorch_tanh`).

Native resolution, packed: the images of one call keep their own sizes. Their patch tokens (positions added per
image) are concatenated into one sequence that every block encodes at once; the blocks' norms, projections and MLP
act per token, and attention (op ``vision_attn``, k3/ops/vision_attn.py) is restricted to each image, a block-diagonal
pattern: per-image SDPA as the reference, FlashAttention's varlen kernel or flex_attention with a block mask on GPU.
The output is split back per image before the pixel shuffle. tests/model/vision_reference.py is an independent
transcription of these equations that the module is tested against (tests/model/test_vision_reference.py).

Video is not supported yet: the release adds a fixed (non-learned, not stored) temporal position part over
`init_pos_emb_time` frames and factorizes attention into intra-frame and inter-frame passes with temporal
pooling ("tpool"). An image is a single frame, for which none of that applies: this module implements T = 1.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import VisionConfig
from k3.model.common import RMSNorm
from k3.ops.registry import Backends
from k3.ops.vision_attn import ImagePacking, vision_attention

# The ViT's RMSNorms (norm0/norm1/final_layernorm). vision_config has no key for it; the release uses 1e-5.
VIT_RMS_NORM_EPS = 1e-5
IN_CHANNELS = 3

# The activations VisionConfig accepts (k3.config.VISION_ACTIVATIONS names them).
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# ------------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------------
class DividedPosEmb(nn.Module):
    """Learned 2-D position table [H0, W0, C] ("divided_fixed": the spatial part is learned; the temporal part
    of the release is fixed and only used for video, see the module docstring). For a patch grid other than
    H0 x W0 the table is resized (bilinear by default, align_corners=False) to that grid."""

    def __init__(self, height: int, width: int, dim: int, mode: str = "bilinear"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.mode = mode
        nn.init.normal_(self.weight, std=0.02)

    def table(self, h: int, w: int) -> torch.Tensor:
        """[h, w, C] position embeddings for an h x w patch grid (the stored table itself at the native size)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight
        t = self.weight.permute(2, 0, 1).unsqueeze(0).float()  # [1, C, H0, W0]
        t = F.interpolate(t, size=(h, w), mode=self.mode, align_corners=False)
        return t[0].permute(1, 2, 0).to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, h, w, C] -> x + table(h, w)."""
        return x + self.table(x.shape[1], x.shape[2]).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, mode={self.mode}"


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(IN_CHANNELS, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = DividedPosEmb(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size,
                                     cfg.pos_emb_interpolation_mode)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, H/p, W/p, C] patch embeddings plus positions, patches in raster order."""
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).permute(0, 2, 3, 1)
        return self.pos_emb(x)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.fc0 = nn.Linear(hidden, intermediate, bias=False)
        self.fc1 = nn.Linear(intermediate, hidden, bias=False)
        self.act_name = act
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))

    def extra_repr(self) -> str:
        return f"act={self.act_name}"


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x += wo(attn(norm0 x)); x += fc1(act(fc0(norm1 x))). Full (non-causal) attention
    over the patches of one image; no rotary positions (the learned table is the only position signal). The block
    runs on a packed sequence of several images' patches: only attention needs to know where each image lies."""

    backends: Backends | None = None  # which implementation runs the attention (K3ForCausalLM.set_backends)

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        C, Q = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.num_heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(C, VIT_RMS_NORM_EPS)
        self.wqkv = nn.Linear(C, 3 * Q, bias=False)
        self.wo = nn.Linear(Q, C, bias=False)
        self.norm1 = RMSNorm(C, VIT_RMS_NORM_EPS)
        self.mlp = VisionMLP(C, cfg.vt_intermediate_size, cfg.activation_func)

    def attention(self, x: torch.Tensor, packing: ImagePacking) -> torch.Tensor:
        """x [T, C] (the patches of the images of `packing`, packed) -> [T, C]; each image attends to itself only
        (op vision_attn: block-diagonal softmax attention, scale 1/sqrt(head_dim))."""
        T = x.shape[0]
        q, k, v = self.wqkv(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, heads, head_dim] each
        o = vision_attention(q, k, v, packing, backends=self.backends)
        return self.wo(o.reshape(T, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, packing: ImagePacking) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), packing)
        return x + self.mlp(self.norm1(x))


class VisionEncoderStack(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, VIT_RMS_NORM_EPS)

    def forward(self, x: torch.Tensor, packing: ImagePacking) -> torch.Tensor:
        """x [T, C] packed patch tokens -> [T, C] normalized features."""
        for block in self.blocks:
            x = block(x, packing)
        return self.final_layernorm(x)


def pixel_shuffle(x: torch.Tensor, kernel: Sequence[int] = (2, 2)) -> torch.Tensor:
    """Space-to-depth merge ("sd2"): x [N, h, w, C] -> [N, (h/kh)*(w/kw), kh*kw*C].

    Merged tokens are in raster order of the (h/kh) x (w/kw) grid of windows; the features of one token are the
    kh*kw patch vectors of its window concatenated in raster order within the window (for 2x2: top-left,
    top-right, bottom-left, bottom-right). For an image (one frame) the temporal pooling of "sd2_tpool" is the
    identity."""
    kh, kw = kernel
    N, h, w, C = x.shape
    if h % kh or w % kw:
        raise ValueError(f"patch grid {h}x{w} is not divisible by the merge kernel {kh}x{kw}")
    x = x.reshape(N, h // kh, kh, w // kw, kw, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(N, (h // kh) * (w // kw), kh * kw * C)


def _group_images(cfg: VisionConfig, pixel_values: torch.Tensor | Sequence[torch.Tensor],
                  ) -> tuple[list[tuple[list[int], torch.Tensor]], int]:
    """Validate the input and group same-sized images into batches: ([(indices, [n, 3, H, W])], n_images)."""
    if isinstance(pixel_values, torch.Tensor):
        if pixel_values.dim() == 3:
            pixel_values = pixel_values.unsqueeze(0)
        if pixel_values.dim() != 4:
            raise ValueError(f"pixel_values must be [N, 3, H, W], got shape {tuple(pixel_values.shape)}")
        groups = [(list(range(pixel_values.shape[0])), pixel_values)]
        shapes = [tuple(pixel_values.shape[1:])] if pixel_values.shape[0] else []
        n = pixel_values.shape[0]
    else:
        images = list(pixel_values)
        for i, im in enumerate(images):
            if not isinstance(im, torch.Tensor) or im.dim() != 3:
                raise ValueError(f"image {i} must be a [3, H, W] tensor, got "
                                 f"{tuple(im.shape) if isinstance(im, torch.Tensor) else type(im).__name__}")
        by_shape: dict[tuple, list[int]] = {}
        for i, im in enumerate(images):
            by_shape.setdefault(tuple(im.shape), []).append(i)
        groups = [(idx, torch.stack([images[i] for i in idx])) for idx in by_shape.values()]
        shapes = list(by_shape)
        n = len(images)
    mh, mw = cfg.pixel_multiple
    for c, H, W in shapes:
        if c != IN_CHANNELS:
            raise ValueError(f"images must have {IN_CHANNELS} channels, got {c}")
        if H <= 0 or W <= 0 or H % mh or W % mw:
            raise ValueError(f"image size {H}x{W} must be a positive multiple of {mh}x{mw} pixels "
                             f"(patch_size {cfg.patch_size} x merge_kernel_size {list(cfg.merge_kernel_size)})")
    return groups, n


# ------------------------------------------------------------------------------------------------------
# the three public modules
# ------------------------------------------------------------------------------------------------------
class MoonViT(nn.Module):
    """MoonViT-V2 (`vision_tower`). State-dict keys: patch_embed.proj.weight, patch_embed.pos_emb.weight,
    encoder.blocks.{i}.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}.weight, encoder.final_layernorm.weight."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoderStack(cfg)

    def encode_packed(self, pixel_values: torch.Tensor | Sequence[torch.Tensor],
                      ) -> tuple[torch.Tensor, ImagePacking, list[tuple[int, int]]]:
        """Images (an [N, 3, H, W] tensor or a list of [3, H, W], sizes may differ) -> (features [T, C], packing,
        patch grids): every image's patch embeddings plus positions, in raster order, concatenated in image order
        into one sequence of T = sum h_i * w_i tokens that the blocks encode together, attention restricted to each
        image. Same-sized images share one convolution call."""
        groups, n = _group_images(self.config, pixel_values)
        per_image: list[torch.Tensor | None] = [None] * n
        for idx, batch in groups:
            if batch.shape[0] == 0:
                continue
            emb = self.patch_embed(batch)  # [n_g, h, w, C]
            for j, i in enumerate(idx):
                per_image[i] = emb[j]
        grids = [(e.shape[0], e.shape[1]) for e in per_image]  # type: ignore[union-attr]
        packing = ImagePacking([h * w for h, w in grids])
        C = self.config.vt_hidden_size
        if n == 0:
            return self.patch_embed.proj.weight.new_zeros(0, C), packing, grids
        x = torch.cat([e.reshape(-1, C) for e in per_image], 0)  # type: ignore[union-attr]
        return self.encoder(x, packing), packing, grids

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Same-sized images [N, 3, H, W] -> normalized patch features [N, H/p, W/p, C]. Each image attends only
        to its own patches."""
        if pixel_values.dim() != 4:
            raise ValueError(f"encode takes same-sized images [N, 3, H, W], got shape {tuple(pixel_values.shape)}")
        N, _, H, W = pixel_values.shape
        x, _, _ = self.encode_packed(pixel_values)
        p = self.config.patch_size
        return x.view(N, H // p, W // p, -1)

    def forward(self, pixel_values: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """[N, 3, H, W] tensor or a list of [3, H, W] images (sizes may differ; H, W multiples of
        patch_size x merge kernel) -> per image the pixel-shuffled features [(H/28)*(W/28), 4*C]. All images are
        encoded together in one packed sequence (`encode_packed`)."""
        x, packing, grids = self.encode_packed(pixel_values)
        kernel = self.config.merge_kernel_size
        return [pixel_shuffle(t.view(1, h, w, -1), kernel)[0]
                for t, (h, w) in zip(x.split(list(packing.lengths), 0), grids)]


class PatchMergerProjector(nn.Module):
    """"patchmergerv2" (`mm_projector`): pixel-shuffled token [4*C] -> proj.0 [4C -> 4C] -> gelu ->
    proj.2 [4C -> text_hidden] -> post_norm (RMSNorm over text_hidden, eps projector_ln_eps).
    post_norm is [text_hidden] = [7168]: the only shape that matches the release's 46,144,512 projector
    parameters (see the module docstring for the arithmetic)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d_in = cfg.projector_input_size
        act = nn.GELU(approximate="tanh" if cfg.projector_hidden_act != "gelu" else "none")
        self.proj = nn.Sequential(nn.Linear(d_in, d_in, bias=False), act,
                                  nn.Linear(d_in, cfg.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 4*C] -> [..., text_hidden]."""
        return self.post_norm(self.proj(x))


class VisionEncoder(nn.Module):
    """Images -> LM token embeddings. State-dict keys are exactly the release names (vision_tower.*,
    mm_projector.*), so a release checkpoint's vision tensors load with strict=True and no renaming."""

    def __init__(self, cfg: VisionConfig | None = None):
        super().__init__()
        cfg = VisionConfig() if cfg is None else cfg
        self.config = cfg
        self.vision_tower = MoonViT(cfg)
        self.mm_projector = PatchMergerProjector(cfg)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> "VisionEncoder":
        """N(0, std) matrices, conv and position table; output projections (wo, fc1) scaled by 1/sqrt(2L);
        unit norms."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        out_std = std / math.sqrt(2 * self.config.vt_num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "norm0.weight", "norm1.weight")):
                p.fill_(1.0)
                continue
            s = out_std if name.endswith(("wo.weight", "mlp.fc1.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)
        return self

    def forward(self, pixel_values, packed: bool = False):
        """pixel_values: [N, 3, H, W] or a list of [3, H, W] (H, W multiples of 28 for the release).
        Returns per image a [(H/28)*(W/28), text_hidden] tensor of token embeddings in raster order of the merged
        2x2 patch groups, or (packed=True) those tensors concatenated in image order."""
        feats = self.vision_tower(pixel_values)
        if not feats:
            empty = self.mm_projector.post_norm.weight.new_zeros(0, self.config.text_hidden_size)
            return empty if packed else []
        lens = [f.shape[0] for f in feats]
        out = self.mm_projector(torch.cat(feats, 0))
        return out if packed else list(out.split(lens, 0))


def merge_image_embeddings(input_embeds: torch.Tensor, input_ids: torch.Tensor, image_embeds,
                           placeholder_id: int) -> torch.Tensor:
    """Put the image token embeddings at the placeholder positions of the text embeddings.

    input_embeds [B, T, D], input_ids [B, T]; image_embeds: a list of [n_i, D] tensors (VisionEncoder's output)
    or one packed [sum n_i, D] tensor. Placeholders are filled in reading order (batch row, then position) with the
    image tokens in order. Returns a new tensor (differentiable w.r.t. both inputs). Raises ValueError when the
    number of placeholders differs from the number of image tokens."""
    if input_embeds.dim() != 3:
        raise ValueError(f"input_embeds must be [batch, tokens, dim], got shape {tuple(input_embeds.shape)}")
    if tuple(input_ids.shape) != tuple(input_embeds.shape[:2]):
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} does not match input_embeds "
                         f"{tuple(input_embeds.shape)}")
    D = input_embeds.shape[-1]
    if isinstance(image_embeds, torch.Tensor):
        tokens = image_embeds
    else:
        parts = list(image_embeds)
        tokens = torch.cat(parts, 0) if parts else input_embeds.new_zeros(0, D)
    if tokens.dim() != 2:
        raise ValueError(f"image embeddings must be [tokens, dim] tensors, got shape {tuple(tokens.shape)}")
    if tokens.shape[-1] != D:
        raise ValueError(f"image embeddings have width {tokens.shape[-1]} but the text embeddings have {D}")
    mask = input_ids == placeholder_id
    n_slots = int(mask.sum())
    if n_slots != tokens.shape[0]:
        raise ValueError(f"input_ids hold {n_slots} image placeholder tokens (id {placeholder_id}) but the images "
                         f"give {tokens.shape[0]} token embeddings")
    if n_slots == 0:
        return input_embeds
    mask3 = mask.unsqueeze(-1).expand_as(input_embeds)
    return input_embeds.masked_scatter(mask3, tokens.to(device=input_embeds.device, dtype=input_embeds.dtype))


__all__ = [
    "MoonViT", "PatchMergerProjector", "VisionEncoder", "merge_image_embeddings", "pixel_shuffle",
    "DividedPosEmb", "VIT_RMS_NORM_EPS",
]
